"""Running a stage's tasks resumably on a local process pool or on Ray.

A stage is a list of tasks; each task writes its own output files (atomically) and returns a small
stats dict, and then a completion marker ``.done/TASK.json`` holding those stats. Rerunning after a
kill skips the tasks whose marker exists, so only unfinished work is redone, and since each task's
output depends only on its inputs the final files are the same as those of an uninterrupted run,
for any worker count and either executor.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from data_pipeline.curate.shards import atomic_write_text
from data_pipeline.worker_pool import RERUN, WorkerDied, WorkerPool


@dataclass
class Task:
    name: str  # unique within the stage directory: names the completion marker
    fn: Callable[..., dict]  # a module-level function, so that it pickles to workers
    args: tuple


def _run_task(fn: Callable[..., dict], args: tuple, marker: str) -> dict:
    stats = fn(*args)
    atomic_write_text(marker, json.dumps(stats, sort_keys=True))
    return stats


def _run_packed(job: tuple) -> dict:
    return _run_task(*job)


class LocalExecutor:
    """A process pool of ``workers`` (fork where available); one worker runs in this process.

    The pool is started at the first task list that needs it and kept until ``close()``, so the
    sub-stages of a stage (fuzzy dedup has five) do not each pay for starting the workers, a cost
    that grows with their number and is paid while no task runs.
    """

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"executor.workers must be at least 1, got {workers}")
        self.workers = workers
        self._pool = None

    def run(self, jobs: list[tuple]) -> Iterator[dict]:
        if self.workers == 1 or len(jobs) <= 1:
            yield from map(_run_packed, jobs)
            return
        if self._pool is None:
            self._pool = WorkerPool(self.workers)
        yield from self._pool.imap(_run_packed, jobs, "a task of this stage", ordered=False)

    def close(self) -> None:
        """Stop the workers; every result has been collected by then, or a task failed and the run stops."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class RayExecutor:
    """Tasks as Ray remote functions on a cluster (``address``) or a local Ray instance (None).

    Ray is imported here only, so the default executor works without it installed.
    """

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError("executor.kind ray needs Ray: pip install 'megazero[ray]' (or pip install ray)") from None
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            kwargs = {"num_cpus": workers} if address is None and workers else {}
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, **kwargs)
        self._remote = ray.remote(_run_packed)

    def run(self, jobs: list[tuple]) -> Iterator[dict]:
        ray = self._ray
        pending = [self._remote.remote(job) for job in jobs]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                yield ray.get(done[0])
            except ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, Exception) else exc) from None
            except ray.exceptions.RayError as exc:  # the worker itself died (out of memory, a crash), or its node
                raise WorkerDied(f"a Ray worker ended ({type(exc).__name__}) while running a task of this stage, which "
                                 f"is lost; {RERUN}") from None

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


EXECUTORS = ("local", "ray")


def make_executor(kind: str, workers: int, ray_address: str | None):
    if kind == "local":
        return LocalExecutor(workers)
    if kind == "ray":
        return RayExecutor(ray_address, workers)
    raise ValueError(f"executor.kind: unknown executor {kind!r}; choose one of {', '.join(EXECUTORS)}")


def run_tasks(executor, directory: str, tasks: list[Task], desc: str, progress: bool = False) -> list[dict]:
    """Run the tasks without a completion marker; return every task's stats, in task order."""
    markers = os.path.join(directory, ".done")
    os.makedirs(markers, exist_ok=True)
    stale = glob.glob(os.path.join(directory, "**", "*.tmp-*"), recursive=True)  # ** passes over .done
    for path in stale + glob.glob(os.path.join(markers, "*.tmp-*")):
        os.remove(path)  # left by a killed run; the task that owns it reruns
    marker = {t.name: os.path.join(markers, f"{t.name}.json") for t in tasks}
    if len(marker) != len(tasks):
        raise AssertionError(f"{directory}: task names must be unique")
    finished = {t.name: _read_marker(marker[t.name]) for t in tasks}
    jobs = [(t.fn, t.args, marker[t.name]) for t in tasks if finished[t.name] is None]
    bar = _progress_bar(desc, len(tasks), len(tasks) - len(jobs)) if progress and jobs else None
    try:
        for _ in executor.run(jobs):
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    results = [finished[t.name] or _read_marker(marker[t.name]) for t in tasks]  # read once each
    unfinished = [t.name for t, stats in zip(tasks, results) if stats is None]
    if unfinished:
        raise ValueError(f"{directory}: task {unfinished[0]} ended without its completion marker; run again")
    return results


def _read_marker(path: str) -> dict | None:
    """A task's completion marker, or None when it has none; a damaged one (a disk that lost its last
    write) is removed, so its task runs again instead of stopping the stage on a JSON error."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            stats = json.load(f)
    except (ValueError, UnicodeDecodeError):
        stats = None
    if not isinstance(stats, dict):
        os.remove(path)
        return None
    return stats


def _progress_bar(desc: str, total: int, done: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit=" shards", file=sys.stderr, mininterval=0.5)


def merge_stats(items: list[dict]) -> dict:
    """Sum per-task stats: numbers add, dicts merge key by key, number lists add element-wise,
    other lists (examples) concatenate up to 20 entries."""
    out: dict = {}
    for item in items:
        for key, value in item.items():
            if key not in out:
                out[key] = json.loads(json.dumps(value))
            elif isinstance(value, dict):
                out[key] = merge_stats([out[key], value])
            elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                out[key] = [a + b for a, b in zip(out[key], value)]
            elif isinstance(value, list):
                out[key] = (out[key] + value)[:20]
            elif isinstance(value, (int, float)):
                out[key] += value
    return out
