"""Several torchtitan jobs, one after another, in one torchrun launch (the tests' `torchrun_jobs`).

    torchrun --nproc_per_node N tests/run_jobs.py JOBS.json

JOBS.json is a list of argument lists, each what `-m torchtitan.train` would be given. Every job runs
as torchtitan.train's `main` runs it: its own config, Trainer, process group and seed; torchtitan's
seed-checkpoint mode too. What a job shares with the one before is the process: imports, the
inductor cache on disk, and memory already taken from the system (a launch's memory figures are
its own only in a launch of its own).

Why: a launch spends most of a short test run starting up (seen here: 11 of 16 s for a 2-step
2-rank run, the two ranks importing torchtitan on 2 cores), so one launch checks several runs.
"""

import gc
import json
import sys
import time

import torch
import torch.distributed as dist
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

_init_process_group = dist.init_process_group


def _init_for(job: int):
    """init_process_group for one job: its keys in the launch's store under a prefix of their own.

    The store (torchrun's agent store) outlives a process group. A second default group under the
    same prefix would find the first one's gloo addresses there and wait on them until it timed out.
    """

    def init_process_group(*args, **kwargs):
        store, rank, world_size = next(dist.rendezvous("env://"))
        _init_process_group(*args, store=dist.PrefixStore(f"job{job}", store), rank=rank,
                            world_size=world_size, **kwargs)

    return init_process_group


def run(job: int, argv: list[str]) -> None:
    config = ConfigManager().parse_args(argv)
    dist.init_process_group = _init_for(job)
    trainer = Trainer(config)
    try:
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        trainer.close()
        dist.init_process_group = _init_process_group
    dist.destroy_process_group()
    del trainer
    gc.collect()
    torch.compiler.reset()  # the next job compiles its own graphs, as a launch of its own would


def main() -> None:
    init_logger()
    jobs = json.loads(open(sys.argv[1]).read())
    for job, argv in enumerate(jobs):
        start = time.perf_counter()
        logger.info(f"run_jobs: job {job + 1} of {len(jobs)}: {' '.join(argv)}")
        run(job, argv)
        logger.info(f"run_jobs: job {job + 1} of {len(jobs)} done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
