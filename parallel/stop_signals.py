"""The signals that ask a run to stop: SIGTERM (a scheduler's, a person's ``kill``), SIGUSR1 (SLURM's
warning before the time limit) and SIGINT (Ctrl-C). The launcher (``parallel.launch``) passes them
to its workers, which it starts with them blocked; ``megazero``'s command line unblocks them once it
can take them. Kept apart from the launcher, which imports torch, for that command line, which does
not."""

import os
import signal
from typing import Mapping

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def started_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in env
