"""A training rank that dies in native code says where.

A segmentation fault inside a library (a profiler thread, a kernel's host code) kills the rank with
signal 11; the launcher then reports only "exitcode -11", and the test worlds saw exactly that, twice,
with nothing to go on. ``start_run`` enables Python's fault handler first, so the rank prints every
thread's Python stack as it dies. Here a rank crashes on purpose in the first step after it, beside
a thread of its own (planted: the handler not enabled, and the stack is gone; or enabled for the
crashing thread alone). The stacks go where ``sys.stderr`` writes: a file it was pointed at, or,
where it is a stream without a file descriptor (captured in memory), the process's standard error
(planted: the handler given that stream, which it refuses, and no rank starts; or always writing to
standard error).
"""

import subprocess
import sys

import pytest

CRASHING_RANK = """
import ctypes
import io
import sys
import threading
import megazero.startup as startup
from megazero.config import Config
from parallel.launch import LaunchEnv

def lock_then_crash(cfg):
    ctypes.string_at(0)  # reads address 0: a segmentation fault

def waiting_beside(started):
    started.set()
    threading.Event().wait()

started = threading.Event()
threading.Thread(target=waiting_beside, args=(started,), daemon=True).start()
started.wait()
startup.lock_directories = lock_then_crash
if STDERR == "in memory":
    sys.stderr = io.StringIO()
elif STDERR:
    sys.stderr = open(STDERR, "w")
startup.start_run(Config(), LaunchEnv(0, 1, 0, 1))
"""


@pytest.mark.parametrize("stderr", ["", "in memory", "file"])
def test_a_rank_that_segfaults_prints_every_threads_stack(stderr, tmp_path):
    log = tmp_path / "stderr.log"
    target = str(log) if stderr == "file" else stderr
    done = subprocess.run([sys.executable, "-c", f"STDERR = {target!r}\n{CRASHING_RANK}"], capture_output=True,
                          text=True, timeout=120)
    said = log.read_text() if stderr == "file" else done.stderr
    assert done.returncode == -11, (done.returncode, done.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in said, said[-2000:]
    assert "lock_then_crash" in said and "start_run" in said and "waiting_beside" in said, said[-2000:]
