"""Checkpoint files: atomic multi-rank saves, verified loads, preemption signals.

This package knows files, not models: callers decide what each rank's files contain (and how to
reshard them); here they are written atomically with checksums, in a format that loads without
running code, and found again safely.
"""

from megazero.checkpoint.format import (
    CheckpointError, earlier_instead, latest_checkpoint, list_checkpoints, load_file, probe_writable, read_manifest,
    resolve_checkpoint, start_checkpoint, step_dir_name, verify_checkpoint, verify_file,
)
from megazero.checkpoint.preemption import PreemptionHandler
from megazero.checkpoint.writer import CheckpointWriter

__all__ = [
    "CheckpointError", "CheckpointWriter", "PreemptionHandler", "earlier_instead", "latest_checkpoint", "list_checkpoints",
    "load_file", "probe_writable", "read_manifest", "resolve_checkpoint", "start_checkpoint", "step_dir_name",
    "verify_checkpoint", "verify_file",
]
