"""The training loop: data in the order fixed by (seed, consumed samples), one engine step per global
batch, learning-rate and batch-size schedules, evaluation, metrics, checkpoints and clean stops.

Every data-dependent decision that changes what ranks do next (stop for time or preemption, stop
after repeated NaN losses) is taken from a value all ranks agree on: an all-reduced flag, or the
loss, which the pipeline broadcasts to every rank.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import math
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megazero.checkpoint import (
    CheckpointError, CheckpointWriter, PreemptionHandler, earlier_instead, probe_writable, read_manifest,
    start_checkpoint,
    step_dir_name,
)
from megazero.checkpoint.state import files_to_load, load_checkpoint, rank_files
from megazero.config import Config
from megazero.config.loader import config_to_dict
from megazero.data import (build_datasets, recorded_tokenizer, repeated_validation, shard_digests,
                           shard_token_digests, tokenizer_record, train_samples)
from megazero.device_watchdog import DeviceWatchdog
from megazero.engine import Engine, describe_layout, layout_record, pipeline_placement, pipeline_split, same_ranks
from megazero.errors import UserError
from megazero.flops import device_name, flops_per_token, peak_flops
from megazero.metrics import MetricsLogger, StepMetrics
from megazero.training_schedules import build_batch_schedule, build_lr_schedule
from megazero.optim.memory import memory_report
from megazero.profiling import StepProfiler
from data_pipeline.blend import BLEND_RULE
from data_pipeline.loader import global_batch
from models import kernels
from parallel import comm

WALL_CLOCK = "the wall-clock limit (train.max_wall_seconds)"
RANK_FILES_ALLOWANCE = 2**20
"""Bytes a rank's checkpoint holds beyond its master and moments: file headers, the manifests, the
random and data state, file-system blocks. Without it a disk with room for just the tensors passed
the start-up probe, and every relaunch trained up to the first save and failed there."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped ones included)
    consumed: int = 0  # training samples consumed
    skipped: int = 0  # steps skipped for a NaN/inf loss or an fp16 overflow
    bad_in_row: int = 0  # consecutive skipped steps (a non-finite loss or gradient, an fp16 overflow)
    stopped_by: Optional[str] = None  # what stopped the run with steps left: a signal ("SIGTERM") or WALL_CLOCK
    saved_to: Optional[str] = None  # the checkpoint written as the run stopped


class _HostCopy:
    """Device scalars copied to host memory behind the work queued so far: reading them waits for
    that work only, not for what was queued after (an ``.item()`` then would wait for everything)."""

    def __init__(self, *values: torch.Tensor):
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in values])
        self._event = None
        if stacked.is_cuda:
            self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = stacked

    def read(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class _QueuedStep:
    """A step on the device whose results the host has not read yet."""
    values: _HostCopy  # its loss, gradient norm and skip flag
    loss_scale: float
    step: int
    size: int  # samples
    lr: float
    consumed: int  # samples consumed once it is done
    queued_at: float  # time.perf_counter() as its queueing began
    queued_by: float  # ... and as it ended: on a CPU, which computes while queueing, the step's end


def checkpoint_split(cfg: Config, layout: dict) -> Optional[list[float]]:
    """The pipeline split to resume with, given the layout a checkpoint records: the run's own
    ``parallel.pipeline_split`` if set, else the checkpoint's when the run has its pipeline shape
    and placement (else None: the default). The default split can change between versions (it became
    balanced by work), and loading into another split reshards, which does not restore the ranks'
    random generators: the run would no longer continue exactly as it would have. Under another
    placement (zb-v's V against a loop) each rank holds other stages, so the load reshards anyway,
    and the checkpoint's split was balanced for a head on another rank."""
    p = cfg.parallel
    split = layout.get("pipeline_split")
    if p.pipeline_split is not None or not isinstance(split, list):
        return p.pipeline_split
    same_shape = ((layout.get("pp"), layout.get("virtual_stages"), layout.get("placement", "loop"))
                  == (p.pp, p.virtual_stages, pipeline_placement(cfg)))
    return list(split) if same_shape and sum(split) == cfg.model.num_layers else None


class Trainer:
    def __init__(self, cfg: Config, device: torch.device, topology, started: Optional[float] = None):
        """``started``: the ``time.monotonic()`` the run's clock for ``train.max_wall_seconds`` starts at
        (the command's start; None: now). Building the engine and the sample indices and loading a
        checkpoint take minutes at scale, and a limit sized to a job's allocation (Megatron's
        ``--exit-duration-in-mins`` counts from the process's start) must count them."""
        self.started = time.monotonic() if started is None else started
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ckpt, source = start_checkpoint(cfg.checkpoint.load, cfg.save_dir)
        if cfg.checkpoint.load and source == "checkpoint.save_dir" and self.rank == 0:
            print(f"megazero: resuming this run's own checkpoint {ckpt}, not checkpoint.load (which starts a run "
                  "only while checkpoint.save_dir holds no checkpoint)", flush=True)
        manifest = read_manifest(ckpt) if ckpt is not None else None
        if manifest is not None:
            kept = checkpoint_split(cfg, manifest["meta"]["layout"])
            if cfg.parallel.pipeline_split is None and kept not in (None, pipeline_split(cfg)) and self.rank == 0:
                print(f"megazero: keeping the checkpoint's pipeline split {kept} (the default is now "
                      f"{pipeline_split(cfg)}; set parallel.pipeline_split to choose)", flush=True)
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_split=kept))
        self.cfg, self.device, self.topo = cfg, device, topology
        # Stop flags go over gloo, host to host: on NCCL they would queue behind the device's work.
        self._control = None if self.world == 1 else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=cfg.train.collective_timeout_s), group_desc="control")
        self.engine = Engine(cfg, topology, device)
        self._say_resolved(cfg, self.engine.cfg)
        self._settle_kernels()
        self.lr = build_lr_schedule(cfg.optimizer, cfg.schedule, cfg.train)
        self.batches = build_batch_schedule(cfg.schedule, cfg.train, topology.dp_size)
        meta = manifest["meta"] if manifest is not None else {}
        self.train_samples = train_samples(cfg, meta.get("step", 0), meta.get("consumed", 0),
                                           meta.get("train_samples"))
        self.train_data, self.valid_data = build_datasets(cfg, self.train_samples)
        for note in repeated_validation(self.valid_data, cfg) if self.rank == 0 else ():
            print(f"megazero: {note}", flush=True)
        self.tokenizer = tokenizer_record(cfg) if self.rank == 0 else None  # only rank 0's meta is kept
        self.shards = shard_digests(cfg) if self.rank == 0 else None
        self.shard_tokens = shard_token_digests(cfg) if self.rank == 0 else None
        self.state = TrainState()
        self.saved_step = 0  # the step of the newest checkpoint this run saved or resumed from
        self.resumed_step = 0  # the step of the checkpoint this run resumed from (0: none)
        self._last_finished: Optional[float] = None  # when the last step read ended (see ``_finish_step``)
        self._evaluated = False  # whether an evaluation ran (compiled its forward-only blocks)
        self.writer = CheckpointWriter(cfg.save_dir, rank=self.rank, world_size=self.world,
                                       barrier=lambda: dist.barrier(), keep_last=cfg.checkpoint.keep_last,
                                       async_save=cfg.checkpoint.async_save and device.type == "cuda",
                                       gather=None if self.world == 1 else self._gather)
        self._check_save_dir()
        self.started_from = source  # the setting naming the checkpoint started from, for the messages
        self._resume(ckpt, manifest, source)
        self._log_memory()
        m = cfg.model
        self.logger = MetricsLogger(
            cfg.logging.run_dir, total_steps=cfg.train.train_steps, log_interval=cfg.logging.log_interval,
            flops_per_token=flops_per_token(m), num_devices=self.world,
            peak_flops=peak_flops(device_name(device), cfg.precision.dtype), start_step=self.state.step,
            writer=self.rank == 0, progress_bar=self.rank == 0,
            wandb={"project": cfg.logging.wandb_project, "mode": cfg.logging.wandb_mode,
                   "config": config_to_dict(cfg)} if cfg.logging.wandb else None,
            tensorboard=cfg.logging.tensorboard, device=device)
        self.profiler = StepProfiler(cfg.logging.profile_steps, cfg.logging.profile_ranks, self.rank,
                                     cfg.logging.run_dir, device)
        self.watchdog = DeviceWatchdog(cfg.train.collective_timeout_s if device.type == "cuda" else None, self.rank,
                                       describe=lambda: f"stopping now loses {self._unsaved()}")

    def _say_resolved(self, cfg: Config, resolved: Config) -> None:
        """Name what the tensor-parallel settings left to the run became on this machine."""
        if self.rank != 0 or cfg.parallel.tp == 1:
            return
        chosen = []
        if cfg.parallel.tp_comm == "auto":
            chosen.append(f"parallel.tp_comm auto -> {resolved.parallel.tp_comm}")
        if cfg.train.cuda_graphs is None:
            chosen.append(f"train.cuda_graphs null -> {str(resolved.train.cuda_graphs).lower()}")
        if chosen:
            print(f"megazero: {', '.join(chosen)} on this machine", flush=True)

    def _settle_kernels(self) -> None:
        """Settle which optional kernel packages the seam runs, on every rank (each imports them, and
        turns off one whose import fails); rank 0 names those installed but not run."""
        lines = kernels.settle_kernels(self.device)
        for line in lines if self.rank == 0 else ():
            print(f"megazero: {line}", flush=True)

    # --- resume and save ---------------------------------------------------------------------
    def _check_save_dir(self) -> None:
        """Probe the checkpoint directory for writing and for room for one checkpoint (the fp32 master
        and two Adam moments of every rank's shard, and ``RANK_FILES_ALLOWANCE`` for the rest of its
        files) before the first step, not at the first save. Rank 0 probes the shared directory; every
        rank raises the same error."""
        shard_bytes = torch.tensor([12.0 * self.engine.optimizer.master.numel() + RANK_FILES_ALLOWANCE],
                                   device=self.device)
        comm.all_reduce(shard_bytes, dist.group.WORLD)
        problem = [None]
        if self.rank == 0:
            try:
                probe_writable(self.writer.root, int(shard_bytes.item()))
            except CheckpointError as exc:
                problem = [str(exc)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise CheckpointError(problem[0], agreed=True)

    def _finished_already(self) -> str:
        """What to do about a run that starts where it ends, by where its checkpoint came from: another
        logging.run_dir is no way out where the checkpoints are kept apart from it, or named by
        checkpoint.load."""
        step, more = self.state.step, "raise train.train_steps or train.train_tokens to train on"
        if self.started_from == "checkpoint.load":
            return (f"checkpoint.load {self.cfg.checkpoint.load} is at step {step}, where this run ends; nothing to "
                    f"train ({more}, or start a new run from its weights: `megazero convert "
                    f"{self.cfg.checkpoint.load} DST --to megazero --reset-step`, then checkpoint.load DST)")
        if self.cfg.checkpoint.save_dir is not None:
            return (f"checkpoint.save_dir {self.cfg.save_dir} holds a run that finished at step {step}; nothing to "
                    f"train ({more}, or give a new run another checkpoint.save_dir)")
        return f"this run already finished at step {step}; nothing to train ({more}, or use another logging.run_dir)"

    def _resume(self, ckpt, manifest: Optional[dict], source: str) -> None:
        if ckpt is None:
            unfinished = sorted(self.writer.root.glob("step_*.tmp"))
            if unfinished and self.rank == 0:
                print(f"megazero: {self.writer.root} holds no complete checkpoint, only the unfinished save "
                      f"{unfinished[-1].name}; starting from step 0", flush=True)
            return
        meta = manifest["meta"]
        in_place = same_ranks(meta["layout"], self.cfg)
        try:  # every rank stops on the first rank's error: a damaged or changed file, or any other (control group)
            plan = files_to_load(ckpt, self.rank, self.engine.optimizer, manifest, in_place, self._control)
            exact = load_checkpoint(ckpt, self.rank, self.engine.chunks, self.engine.optimizer, manifest, in_place,
                                    plan, self._control)
        except CheckpointError as exc:
            raise CheckpointError(f"{source}: {exc}{earlier_instead(ckpt, source)}", agreed=exc.agreed) from None
        self.saved_step = self.resumed_step = meta["step"]
        self.state = TrainState(step=meta["step"], consumed=meta["consumed"], skipped=meta["skipped"],
                                bad_in_row=meta.get("bad_in_row", 0))
        if self.rank == 0:
            if self.tokenizer is None:  # the data names none: the weights still take the loaded ids
                self.tokenizer = recorded_tokenizer(meta)
            how = (("same layout" if meta["layout"] == layout_record(self.cfg) else
                    f"same shards as {describe_layout(meta['layout'])}") if exact else
                   f"resharded from {describe_layout(meta['layout'])}")
            print(f"megazero: resumed from {ckpt} at step {self.state.step} ({how})", flush=True)
            if self.engine.optimizer.scaler_note:
                print(f"megazero: note: {self.engine.optimizer.scaler_note}", flush=True)

    def save(self) -> None:
        meta = {"step": self.state.step, "consumed": self.state.consumed, "skipped": self.state.skipped,
                "bad_in_row": self.state.bad_in_row, "layout": layout_record(self.cfg),
                "config": config_to_dict(self.cfg), "blend_rule": BLEND_RULE, "train_samples": self.train_samples}
        if self.tokenizer is not None:
            meta["tokenizer"] = self.tokenizer
        if self.shards:
            meta["shards"] = self.shards
        if self.shard_tokens:
            meta["shard_tokens"] = self.shard_tokens
        self.writer.save(self.state.step, rank_files(self.engine.chunks, self.engine.optimizer, self.rank), meta=meta)
        self.state.saved_to = str(self.writer.root / step_dir_name(self.state.step))
        self.saved_step = self.state.step
        if self.rank == 0:
            how = "writing in the background" if self.writer.async_save else "saved"
            print(f"megazero: checkpoint of step {self.state.step} {how} to {self.state.saved_to}", flush=True)

    def _log_memory(self) -> None:
        """The most loaded rank's ZeRO memory line and the spread over ranks: one line per rank would
        be thousands of lines at scale."""
        opt = self.engine.optimizer
        measured = opt.memory_bytes()
        line = memory_report(measured, opt.predicted_memory(), self.rank, self.cfg.zero.stage)
        reports = [None] * self.world
        dist.all_gather_object(reports, (sum(measured.values()), line))
        if self.rank == 0:
            totals = [total for total, _ in reports]
            print(max(reports)[1], flush=True)
            if self.world > 1:
                print(f"megazero: model states over {self.world} ranks: {min(totals) / 2**30:.3f} to "
                      f"{max(totals) / 2**30:.3f} GiB per rank", flush=True)

    # --- the loop ----------------------------------------------------------------------------
    def _agree(self, *values: bool) -> list[bool]:
        """``values`` ORed over every rank. The control group is gloo: this waits for the other
        ranks' hosts to get here, never for work queued on a device."""
        if self.world == 1:
            return list(values)
        flags = torch.tensor([1.0 if value else 0.0 for value in values])
        comm.all_reduce(flags, self._control, op=dist.ReduceOp.MAX)
        return [value > 0 for value in flags.tolist()]

    def done(self) -> bool:
        """Whether the run has reached train.train_steps or train.train_tokens (a relaunch of a finished run)."""
        t = self.cfg.train
        if t.train_steps is not None and self.state.step >= t.train_steps:
            return True
        return t.train_tokens is not None and self.state.consumed * self.cfg.model.seq_length >= t.train_tokens

    def _evaluates(self, step: int) -> bool:
        return bool(self.cfg.train.eval_interval and step % self.cfg.train.eval_interval == 0)

    def _saves(self, step: int) -> bool:
        """Whether ``step`` gets a periodic checkpoint (the last step's is the exit save's business)."""
        interval = self.cfg.checkpoint.save_interval
        return bool(interval and step % interval == 0) and not self.done()

    def _pause_after(self, step: int) -> bool:
        """Whether the step just queued must finish before the next is queued: it is evaluated, saved
        or the last, and those read or write the parameters as that step left them; or it bounds a
        profiled window, whose trace holds only the window's steps."""
        return self.done() or self._evaluates(step) or self._saves(step) or self.profiler.pauses_after(step)

    def train(self) -> TrainState:
        """Steps are queued ahead (``train.steps_ahead``, 1 by default): the host reads step N's loss
        and gradient norm while the device already runs step N+1, so the device does not wait for
        the host to log, check and prepare the next batch. A step after which the run evaluates,
        saves or ends, and the steps that bound a profiled window, are not run ahead of. Stop
        requests (a signal, the time limit) are agreed on before each round of queueing (one step a
        round once the queue is full): one seen then stops after the steps in flight; one that
        arrives later, after the steps queued next. A profiled window (``logging.profile_steps``) is
        written however the loop ends."""
        if self.done():
            if self.rank == 0:
                print(f"megazero: {self._finished_already()}", flush=True)
            return self.state
        with PreemptionHandler(unsaved=self._unsaved) as preemption, self.logger, self.profiler, self.watchdog:
            try:
                preempted, late = self._run_steps(preemption)
            except BaseException as exc:
                if getattr(exc, "agreed", False):  # every rank stops here, so the save's barriers are safe
                    self._commit_pending_save()
                raise
            self.profiler.close()  # before the exit save, which is not part of any step
            why = self._agreed_signal(preemption.signal_name) if preempted else WALL_CLOCK if late else None
            if not self.done():  # steps left: stopped, not finished (a scheduler requeues on 75)
                self.state.stopped_by = why
            if why and self.rank == 0:
                print(f"megazero: stopping at step {self.state.step} for {why}; saving", flush=True)
            saved = self.state.saved_to is not None and self.saved_step == self.state.step
            if (self.cfg.checkpoint.save_on_exit or why) and not saved:
                self.save()
            self.writer.wait()
        return self.state

    def _run_steps(self, preemption: PreemptionHandler) -> tuple[bool, bool]:
        """Queue, finish, evaluate and save steps until the run is done or agrees to stop; returns
        whether a stop signal and whether the time limit stopped it."""
        t = self.cfg.train
        in_flight: collections.deque[_QueuedStep] = collections.deque([self._queue_step()])
        while True:
            late = t.max_wall_seconds is not None and time.monotonic() - self.started > t.max_wall_seconds
            preempted, late = self._agree(preemption.requested, late)
            stopping = preempted or late
            if in_flight:
                try:
                    while (not stopping and len(in_flight) <= t.steps_ahead
                           and not self._pause_after(in_flight[-1].step)):
                        in_flight.append(self._queue_step())
                except BaseException:  # the steps before still get their lines (or their own error)
                    self._record_all(in_flight)
                    raise
                done = self._complete_next(in_flight)
                if not stopping and self._saves(done.step):
                    self.save()
                while stopping and in_flight:  # a stop lets the steps already queued finish
                    self._complete_next(in_flight)
            elif not (stopping or self.done()):  # after an evaluation or a save
                in_flight.append(self._queue_step())
            if stopping or (not in_flight and self.done()):
                return preempted, late

    def _commit_pending_save(self) -> None:
        """Commit a background save a stopping run leaves written but not committed (it is committed at
        the next save or the run's end, which a diverging run never reaches): its checkpoint is the
        one the error tells the user to resume from. A failure of that save is said, not raised over
        the error that stopped the run."""
        try:
            self.writer.wait()
        except CheckpointError as exc:
            if self.rank == 0:
                print(f"megazero: {exc}", file=sys.stderr, flush=True)

    def _complete(self, queued: _QueuedStep) -> None:
        """Read a queued step's results, evaluate if this step is due, and log it (a profiled window
        ends before the evaluation after its last step); a step that makes the run diverging is
        logged, not evaluated, then stops the run."""
        metrics = self._finish_step(queued)
        self.profiler.after_step(queued.step)
        if self.state.bad_in_row >= self.cfg.train.max_bad_steps:
            self.logger.record(metrics)  # the step the error names has its line, as every step before
            raise UserError(f"the loss or the gradients were NaN or inf for {self.state.bad_in_row} steps in a "
                            f"row (to step {queued.step}): the run is diverging; lower optimizer.lr, raise "
                            "schedule.warmup_steps or resume from an earlier checkpoint", agreed=True)
        if self._evaluates(queued.step):
            metrics.val_loss = self._evaluate()
        self.logger.record(metrics)

    def _complete_next(self, in_flight: collections.deque) -> _QueuedStep:
        """``_complete`` the oldest queued step; where it stops the run (diverging), the steps queued
        behind it were run too, and are logged before the error goes on."""
        done = in_flight.popleft()
        try:
            self._complete(done)
        except BaseException:
            self._record_all(in_flight)
            raise
        return done

    def _record_all(self, in_flight: collections.deque) -> None:
        """Read and log every step still queued (the run is stopping on an error)."""
        while in_flight:
            self.logger.record(self._finish_step(in_flight.popleft()))

    def _unsaved(self) -> str:
        """What stopping now, without a save, loses (said on a second Ctrl-C, and as the device watchdog
        ends the process): the steps after the newest complete checkpoint. A save still being written
        in the background is complete only once the next save or the run's end commits it."""
        complete = self.writer.committed_step or self.resumed_step
        if self.state.step == complete:  # step 0 of a fresh run is no checkpoint: no step had finished
            return f"nothing: step {complete} is saved" if complete else "nothing: no step had finished"
        writing = self.writer.pending_step
        since = f"the last checkpoint is step {complete}" if complete else "no checkpoint yet"
        if writing is not None:
            since += f"; step {writing}'s is still being written and would be lost"
        first, last = complete + 1, self.state.step
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        return f"{steps} ({since})"

    def _agreed_signal(self, mine: Optional[str]) -> str:
        """The name of a signal some rank received (the lowest such rank's), the same on every rank."""
        return next(name for name in self._gather(mine) if name is not None)

    def _gather(self, mine) -> list:
        """Every rank's ``mine``, in rank order (host to host, on the control group)."""
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self._control)
        return everyone

    def _queue_step(self) -> _QueuedStep:
        """Queue the next global batch's forward, backward and update on the device, without reading
        anything back. Queueing can wait on the device too (a kernel's first launch, a copy from
        pageable memory), so it has the watchdog's deadline."""
        queued_at = time.perf_counter()
        step = self.state.step + 1
        with self.profiler.queueing(step):
            size = self.batches.global_batch(self.state.consumed)
            micro = global_batch(self.train_data, self.state.consumed, size, self.cfg.train.micro_batch_size,
                                 self.topo.dp_rank, self.topo.dp_size)
            lr = self.lr(step)
            # before a step's results have been read, the host compiles and records the blocks
            with self._device_deadline(f"step {step} to queue", armed=self._last_finished is not None):
                out = self.engine.train_step(micro, lr)
                values = _HostCopy(out.loss_value, out.result.norm, out.result.overflow)
            self.state.step = step
            self.state.consumed += size
        return _QueuedStep(values, out.result.loss_scale, step, size, lr, self.state.consumed, queued_at,
                           time.perf_counter())

    def _device_deadline(self, what: str, armed: bool):
        """The watchdog's deadline on a wait for the device, where ``armed``: not where the host may
        be compiling, which can take longer than any deadline."""
        return self.watchdog.waiting(what) if armed else contextlib.nullcontext()

    def _finish_step(self, queued: _QueuedStep) -> StepMetrics:
        """Read a queued step's results (waiting for that step only) and count skipped and bad steps."""
        reading = time.perf_counter()
        with self.watchdog.waiting(f"step {queued.step}'s results"):
            loss, grad_norm, skipped = queued.values.read()
        now = time.perf_counter()
        skipped = skipped > 0
        self.state.skipped += int(skipped)
        # fp16 overflows are the dynamic scaler's business (it stops the run at min_loss_scale); any
        # other skipped step means the loss or a gradient was NaN or inf.
        bad = not math.isfinite(loss) or (skipped and self.cfg.precision.dtype != "fp16")
        self.state.bad_in_row = self.state.bad_in_row + 1 if bad else 0
        # A step's time is from the end of the one before (or its own queueing, if later) to its end:
        # in a steady run, the time between two steps' ends. A GPU step ends when its results can be
        # read; a CPU step, computed while it was queued, when its queueing did (by the time it is
        # read, the host may have computed the next step too).
        end = queued.queued_by if self.device.type == "cpu" else now
        seconds = end - max(queued.queued_at, self._last_finished or 0.0)
        self._last_finished = end
        return StepMetrics(
            step=queued.step, loss=loss, lr=queued.lr, grad_norm=grad_norm,
            tokens=queued.size * self.cfg.model.seq_length, seconds=seconds,
            loss_scale=queued.loss_scale, skipped_steps=self.state.skipped,
            consumed_samples=queued.consumed, host_wait_s=now - reading)

    def _evaluate(self) -> float:
        """Mean loss over the first ``eval_steps`` global batches of the validation split (the same
        batches every time, so evaluations are comparable). The split was built with exactly that many
        samples (``build_datasets``), and one without documents refused at the start."""
        t = self.cfg.train
        size = t.global_batch_size
        losses = []
        for k in range(t.eval_steps):
            micro = global_batch(self.valid_data, k * size, size, t.micro_batch_size, self.topo.dp_rank,
                                 self.topo.dp_size)
            # the first evaluation compiles its forward-only blocks on the host
            with self._device_deadline(f"step {self.state.step}'s evaluation", armed=self._evaluated):
                losses.append(self.engine.eval_loss(micro))
        self._evaluated = True
        return sum(losses) / len(losses)

