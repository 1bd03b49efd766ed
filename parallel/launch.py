"""Reading the launcher's environment and starting the default process group.

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE; under SLURM without torchrun the same
facts come from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NTASKS_PER_NODE. With neither, the
process is a world of one, which still gets a (gloo, in-memory) process group so every code path
is the same whatever the world size.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.local_world_size)


def _slurm_tasks_per_node(env: Mapping[str, str]) -> Optional[int]:
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    match = re.match(r"(\d+)", value)  # SLURM_TASKS_PER_NODE looks like "8(x4)"
    return int(match.group(1)) if match else None


def read_launch_env(env: Mapping[str, str] = os.environ) -> LaunchEnv:
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return LaunchEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                         int(env.get("LOCAL_WORLD_SIZE", world)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        return LaunchEnv(int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)),
                         _slurm_tasks_per_node(env) or world)
    return LaunchEnv(0, 1, 0, 1)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    return "nccl" if device.type == "cuda" else "gloo"


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is visible; use --train.device cpu")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def init_process_group(launch: LaunchEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """Start the default group; a world of one uses an in-memory store and needs no rendezvous."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    if launch.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError("MASTER_ADDR/MASTER_PORT are not set: start multi-rank runs with torchrun "
                           "(scripts/pretrain_gpt.sh does) or export them under srun")
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=timeout)
