"""A training rank that dies in native code says where.

A segmentation fault inside a library (a profiler thread, a kernel's host code) kills the rank with
signal 11; the launcher then reports only "exitcode -11", and the test worlds saw exactly that, twice,
with nothing to go on. ``start_run`` enables Python's fault handler first, so the rank prints every
thread's Python stack as it dies. Here a rank crashes on purpose in the first step after it
(planted: the handler not enabled, and the stack is gone). A rank whose ``sys.stderr`` is a stream
without a file descriptor (captured in memory) writes the stacks to the process's standard error
(planted: the handler given that stream, which it refuses, and no rank starts).
"""

import subprocess
import sys

import pytest

CRASHING_RANK = """
import ctypes
import io
import sys
import megazero.startup as startup
from megazero.config import Config
from parallel.launch import LaunchEnv

def lock_then_crash(cfg):
    ctypes.string_at(0)  # reads address 0: a segmentation fault

startup.lock_directories = lock_then_crash
if IN_MEMORY:
    sys.stderr = io.StringIO()
startup.start_run(Config(), LaunchEnv(0, 1, 0, 1))
"""


@pytest.mark.parametrize("in_memory", [False, True], ids=["stderr", "stderr-in-memory"])
def test_a_rank_that_segfaults_prints_every_threads_stack(in_memory):
    done = subprocess.run([sys.executable, "-c", f"IN_MEMORY = {in_memory}\n{CRASHING_RANK}"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -11, (done.returncode, done.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in done.stderr, done.stderr[-2000:]
    assert "lock_then_crash" in done.stderr and "start_run" in done.stderr, done.stderr[-2000:]
