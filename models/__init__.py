"""The GPT decoder, written like a single-device model, and its fused-ops seam."""

from models.gpt import GPT, RECOMPUTE_TARGETS, TP_PLAN

__all__ = ["GPT", "RECOMPUTE_TARGETS", "TP_PLAN"]
