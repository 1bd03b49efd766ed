"""Bringing a validated config to life on this rank: process group, topology, run directory."""

from __future__ import annotations

import os

from megazero.config import Config, save_config
from parallel.launch import LaunchEnv, init_process_group, pick_device
from parallel.topology import RankGrid, Topology


def initialize(cfg: Config, launch: LaunchEnv):
    """Start the process group and build the topology; returns (device, topology)."""
    device = pick_device(cfg.train.device, launch.local_rank)
    init_process_group(launch, device, cfg.train.collective_timeout_s)
    p = cfg.parallel
    grid = RankGrid(tp=p.tp, pp=p.pp, dp=p.dp, order=p.order)
    topology = Topology(grid, ranks_per_node=launch.local_world_size)
    return device, topology


def start_run(cfg: Config, launch: LaunchEnv) -> int:
    device, topology = initialize(cfg, launch)
    if topology.rank == 0:
        os.makedirs(cfg.logging.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.logging.run_dir, "config.yaml"))
        print(f"megazero: {topology.describe()} ({device.type}); resolved config in "
              f"{os.path.join(cfg.logging.run_dir, 'config.yaml')}")
        print("megazero: the training loop is not built yet; this run validated the config, "
              "built the process groups and stopped.")
    return 0
