"""Shared test helpers: a gloo multi-rank runner on CPU and a torchrun launcher for end-to-end runs."""

import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> None:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; re-raise any rank's failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, errors), nprocs=world_size,
                           start_method="spawn")
    except Exception:
        msgs = []
        while not errors.empty():
            rank, tb = errors.get()
            msgs.append(f"--- rank {rank} ---\n{tb}")
        pytest.fail("\n".join(msgs) or "a rank failed", pytrace=False)


def torchrun(nproc: int, config: str, *overrides: str, env: dict | None = None, timeout: int = 600):
    """Launch torchtitan's own train.py under torchrun from the repo root; returns the CompletedProcess."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0",
        "-m", "torchtitan.train", "--job.config_file", config, *overrides,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
