"""On a GPU, a training step that never finishes (here a kernel that spins far past the deadline,
where a collective replayed in a CUDA graph would wait for a lost peer) ends the rank with one line
and status ``EXIT_STATUS``, within seconds of the deadline: the host thread is blocked in the CUDA
driver (here queueing the step behind the stuck kernel, since a kernel's first launch loads its module,
which waits for the device; in a run past its first steps, reading the step's results), the
watchdog's thread runs beside it and ends the process with the kernel still running."""

import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megazero.device_watchdog import EXIT_STATUS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPIN_CYCLES = 2**41  # about 20 minutes of a GPU's clock: for ever, as far as these tests are concerned


def _run(code: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=180)
    return done, time.monotonic() - start


def test_the_trainer_stops_a_rank_whose_step_never_finishes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done, took = _run(f"""
        import sys
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
        from tests.test_trainer import _overrides, _train, write_arithmetic_shard
        root = sys.argv[1]
        write_arithmetic_shard(root + "/arith_text_document", 200)

        def prepare(trainer):
            step = trainer.engine.train_step

            def stuck_from_step_3(micro, lr=None):
                if trainer.state.step + 1 == 3:  # step 3's work never finishes, as behind a lost peer
                    torch.cuda._sleep({SPIN_CYCLES})
                return step(micro, lr)
            trainer.engine.train_step = stuck_from_step_3

        _train(_overrides(root + "/arith_text_document", root + "/run", steps=8, extra=(
            "--train.device", "cuda", "--train.compile", "false", "--train.collective_timeout_s", "3")), 1, prepare)
        print("trained to the end")
    """, str(tmp_path))
    assert done.returncode == EXIT_STATUS, done.stderr[-3000:]
    assert "trained to the end" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"megazero: rank 0 waited 3.15 s for step (3's results|[34] to queue) on its device "
                        r"\(train.collective_timeout_s, and 5%\): a collective, or a peer rank, is stuck; stopping "
                        r"this rank; stopping now loses steps 1-\d \(no checkpoint yet\)", last), last
    assert took < 120
