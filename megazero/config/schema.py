"""The typed configuration of a megazero run.

Every field carries a one-line ``help`` in its metadata: ``megazero train --help-config`` prints
them, and a test checks that none is missing. Sections mirror the parts of the engine that read
them, so a module takes only the section it needs (the model never sees the optimizer's fields).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from models.config import ModelConfig, option


@dataclass
class ParallelConfig:
    tp: int = option(1, "Tensor-parallel size: ranks that split each layer (keep within a node)")
    pp: int = option(1, "Pipeline-parallel size: stages the layers are split into")
    dp: Optional[int] = option(None, "Data-parallel size (None = world size / (tp*pp))")
    virtual_stages: int = option(1, "Model chunks per pipeline rank for the interleaved schedules "
                                    "(interleaved_1f1b, interleaved_zb) and zb-v (2)")
    pipeline_schedule: str = option("auto", "Pipeline schedule: auto (1f1b, interleaved_1f1b with virtual stages), "
                                    "gradient_accumulation, 1f1b, interleaved_1f1b, zb-h1 (zero bubble: weight gradients "
                                    "fill the bubble), zb-h2 (zb-h1 with twice the warm-up forwards: less idle, rank 0 "
                                    "holds 2pp-1 micro-batches), interleaved_zb (interleaved_1f1b with zb-h1's split "
                                    "backward: with virtual stages) or zb-v (two chunks a rank in a V, rank 0 holding the "
                                    "first and last stage; virtual_stages 2)")
    sequence_parallel: bool = option(False, "Shard norm and dropout activations along the sequence (needs tp > 1)")
    tp_comm: str = option("auto", "How sequence-parallel linears communicate: auto (peer_memory where the blocks replay as CUDA graphs and the GPUs of a tensor group, in one node, map each other's memory; else overlap), serial (NCCL collective, then the product), overlap (NCCL collectives beside the products) or peer_memory (the GPUs' copy engines over NVLink beside the products; CUDA, one node)")
    order: str = option("tp-dp-pp", "Rank order from fastest to slowest axis: tp-dp-pp or tp-pp-dp")
    allow_tp_across_nodes: bool = option(False, "Permit tensor-parallel groups that span nodes (slow; off by default)")
    pipeline_split: Optional[list] = option(None, "Explicit layers per pipeline stage, e.g. [5, 6, 6, 5]; a count may end in a half, [12.5, 11.5], cutting a block between its attention and its MLP (None = balanced against the head on the last stage, in half blocks where that lowers the busiest stage's work by over 1%, with virtual stages the busiest chunk's without adding to the busiest rank's; under zb-v whole blocks per rank, each rank's first chunk the smaller half)")
    recompute: str = option("none", "Activation checkpointing: none, full or selective (attention core only)")
    recompute_every: int = option(1, "With full recompute, checkpoint every k-th block")


@dataclass
class ZeroConfig:
    stage: int = option(1, "ZeRO stage: 0 plain DP, 1 optimizer state, 2 +gradients, 3 +parameters")
    bucket_size_mb: float = option(200.0, "Size of each gradient/parameter communication bucket in MiB (of gradients); one block's fp32 gradients or more lets stage 3 gather a block in one collective")
    prefetch_depth: int = option(1, "Stage 3: blocks whose parameters are gathered ahead of use")
    persistence_threshold: int = option(0, "Stage 3: parameters with fewer elements stay whole on every rank")
    overlap_comm: bool = option(True, "Start the whole-gradient reductions (stages 0-1; 2-3 under a pipeline) in the "
                                        "last backward, not after it")
    offload_optimizer: bool = option(False, "Keep master weights and Adam state on the CPU and step there")


@dataclass
class PrecisionConfig:
    dtype: str = option("fp32", "Parameter and activation dtype: fp32, bf16 or fp16 (master weights stay fp32)")
    initial_loss_scale: float = option(65536.0, "fp16: starting dynamic loss scale (at most float32's largest, about 3.4e38)")
    loss_scale_window: int = option(1000, "fp16: clean steps before the loss scale doubles")
    hysteresis: int = option(2, "fp16: overflows tolerated before the loss scale halves, re-armed each time the scale grows (then every overflow halves it, as Megatron's)")
    min_loss_scale: float = option(1.0, "fp16: the run stops with an error if the scale falls below this")
    accumulate_fp32: bool = option(True, "Accumulate gradients across micro-batches in fp32")


@dataclass
class OptimizerConfig:
    name: str = option("adamw", "Optimizer: adamw")
    lr: float = option(3e-4, "Peak learning rate")
    min_lr: float = option(3e-5, "Floor of the decayed learning rate (MT-NLG: 10% of peak)")
    beta1: float = option(0.9, "Adam beta1")
    beta2: float = option(0.95, "Adam beta2")
    eps: float = option(1e-8, "Adam epsilon")
    weight_decay: float = option(0.1, "Decoupled weight decay, applied to matrices only")
    clip_grad: float = option(1.0, "Clip the global gradient norm to this (0 = off)")
    fused: bool = option(True, "Use a fused GPU AdamW when one is available (megazero's one-pass kernel, else torch's)")


@dataclass
class ScheduleConfig:
    warmup_steps: int = option(0, "Linear learning-rate warm-up steps")
    decay_steps: Optional[int] = option(None, "Steps of decay after warm-up (None = to the end of training); Megatron's --lr-decay-iters counts the warm-up too")
    decay_style: str = option("cosine", "Learning-rate decay: cosine, linear or constant")
    rampup_start_batch: Optional[int] = option(None, "Batch-size ramp-up: first global batch (None = no ramp-up)")
    rampup_increment: int = option(32, "Batch-size ramp-up: samples added at each increase")
    rampup_samples: int = option(0, "Batch-size ramp-up: samples over which the batch reaches its full size")


@dataclass
class DataConfig:
    blend: Optional[list] = option(None, "Datasets as [[weight, prefix], ...] (prefix of .bin/.idx files; weights are relative, divided by their sum)")
    blend_preset: Optional[str] = option(None, "Named blend weights, e.g. mtnlg530b (prefixes from data.blend_root)")
    blend_root: Optional[str] = option(None, "Directory holding the preset blend's datasets")
    split: str = option("969,30,1", "Train,validation,test proportions of each dataset's documents")
    tokenizer: Optional[str] = option(None, "Tokenizer: a SentencePiece .model or a Hugging Face tokenizer.json")
    cache_dir: Optional[str] = option(None, "Where sample indices are cached (None = beside the data)")
    seed: int = option(1234, "Seed of the data order")


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = option(None, "Checkpoint directory (None = RUN_DIR/checkpoints)")
    save_interval: int = option(0, "Save every N steps (0 = only at the end and on preemption)")
    save_on_exit: bool = option(True, "Save when training ends (a stop for train.max_wall_seconds or a preemption saves either way)")
    keep_last: int = option(3, "Number of newest complete checkpoints kept in save_dir; older ones are "
                                 "removed after each save")
    load: Optional[str] = option(None, "Checkpoint to start from while save_dir holds none; once the run has saved its own, a relaunch continues from save_dir (to roll back, move save_dir's newer checkpoints out of it). None: the latest in save_dir, if any")
    async_save: bool = option(True, "On GPU, write checkpoints in a background thread")
    allow_config_changes: bool = option(False, "Resume although the data order (the blend's files and weights, data.split, data.seed, or a sample count that changes a dataset's epochs) or the learning rate of the next step or of any step ahead up to the checkpoint's run's last differs from the checkpoint's run; refused by default, naming the fields")
    allow_tokenizer_change: bool = option(False, "Train on from a checkpoint with data of another tokenizer than the one it records, whose ids its embedding rows do not mean (a deliberate change of tokenizer); refused by default, whatever checkpoint.allow_config_changes says")


@dataclass
class LoggingConfig:
    run_dir: str = option("runs/default", "Directory for the resolved config, metrics.jsonl and checkpoints")
    log_interval: int = option(10, "Steps between log lines")
    wandb: bool = option(False, "Log to Weights & Biases")
    wandb_mode: str = option("offline", "wandb mode: offline or online")
    wandb_project: str = option("megazero", "wandb project name")
    tensorboard: bool = option(False, "Write TensorBoard event files to RUN_DIR/tensorboard")
    profile_steps: Optional[list[int]] = option(None, "Profile training steps [first, last] with torch.profiler, host and device: each rank of logging.profile_ranks writes RUN_DIR/profile/rankR_stepsFIRST-LAST.json.gz (Perfetto, chrome://tracing). The trainer does not queue ahead of the step before the window or of its last step, on any rank, so the trace holds the window's steps only (None = off)")
    profile_ranks: list[int] = option([0], "Ranks that profile logging.profile_steps")


@dataclass
class TrainConfig:
    micro_batch_size: int = option(4, "Samples per micro-batch on one data-parallel rank")
    global_batch_size: int = option(16, "Samples per optimizer step over all data-parallel ranks")
    train_steps: Optional[int] = option(100, "Stop after this many optimizer steps")
    train_tokens: Optional[int] = option(None, "Stop after this many tokens (None = no token limit); set train_steps null with it (and schedule.decay_steps)")
    max_wall_seconds: Optional[float] = option(None, "Save and stop after this much wall-clock time, counted from the command's start (start-up and checkpoint loading included, as Megatron's --exit-duration-in-mins)")
    eval_interval: int = option(0, "Evaluate every N steps (0 = never)")
    eval_steps: int = option(4, "Batches per evaluation")
    seed: int = option(1234, "Seed of model initialisation and dropout")
    device: str = option("auto", "cpu, cuda or auto (cuda when available)")
    compile: Optional[bool] = option(None, "torch.compile each transformer block and the head (and, at tp 1, the embedding): true, false, or null (the default) = on for GPU runs, off on CPU")
    cuda_graphs: Optional[bool] = option(None, "Replay each compiled block's forward and backward as CUDA graphs (torch.compile's reduce-overhead mode), so the host no longer launches their kernels one by one: for tensor-parallel runs, whose halved GEMMs leave the host's launch work as the bound. true, false, or null (the default) = on where parallel.tp_comm is or becomes peer_memory and the blocks can replay. Needs compile on GPUs, parallel.pp 1, zero.stage 0-2, no split-backward schedule, parallel.recompute none and no dropout. A step the trainer waits for on its device over train.collective_timeout_s (and 5%) stops the rank, so a collective stuck inside a replayed graph is caught too")
    steps_ahead: int = option(1, "Optimizer steps (1-8) the host queues on the device before it reads the oldest one's loss: 1 lets the host log and prepare the next batch while the device computes; more absorb uneven host time when the host needs nearly a whole step to queue one")
    max_bad_steps: int = option(5, "Stop after this many consecutive NaN/inf losses")
    collective_timeout_s: float = option(600.0, "Seconds (0.001 to 1e9) before a hung collective fails with its rank and group; on GPUs, 5% more bounds the trainer's waits for a step on its device, which reaches collectives inside CUDA graphs; peer-memory barriers (parallel.tp_comm) give up at twice it")
    memory_budget_gib: Optional[float] = option(None, "Device memory per rank in GiB that the planner's start-up estimate must fit (None = the GPU's own; CPU runs are then unchecked)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "GPT architecture"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "3D layout"})
    zero: ZeroConfig = field(default_factory=ZeroConfig, metadata={"help": "ZeRO data parallelism"})
    precision: PrecisionConfig = field(default_factory=PrecisionConfig, metadata={"help": "Mixed precision"})
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata={"help": "AdamW"})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"help": "LR and batch schedules"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Datasets and tokenizer"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Saving and resuming"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Metrics and run directory"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Batch sizes and stopping"})

    @property
    def save_dir(self) -> str:
        """Where checkpoints go: ``checkpoint.save_dir``, else ``RUN_DIR/checkpoints``."""
        return self.checkpoint.save_dir or os.path.join(self.logging.run_dir, "checkpoints")
