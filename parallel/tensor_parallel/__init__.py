"""Megatron-style tensor parallelism applied to a plain model from its plan (a dict of styles)."""
