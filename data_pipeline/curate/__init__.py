"""Data curation before tokenizing: clean, quality (fastText + Pareto), exact and fuzzy dedup, decontamination.

Plain Python and numpy, run by ``megazero curate run CONFIG``; see docs/curation.md. Nothing here
imports torch or the model.
"""
