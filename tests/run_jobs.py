"""Several torchtitan jobs, one after another, in one torchrun launch (the tests' `torchrun_jobs`).

    torchrun --nproc_per_node N tests/run_jobs.py JOBS.json

JOBS.json is a list of jobs, each the argument list `-m torchtitan.train` would be given, or
{"argv": [...], "fails": true, "nproc": K} (both keys optional). A job that `fails` must stop with an error: its
traceback is logged and the next job runs. On several ranks, every rank must stop at the same check before its
first collective (a rank that fails alone leaves its peers waiting until the launch's timeout). A job with `nproc`
runs on the launch's first K ranks alone, as a launch of K ranks would run it (its own process group of K, and
WORLD_SIZE, LOCAL_WORLD_SIZE and ROLE_WORLD_SIZE saying K); the other ranks go on to the next job,
whose process group waits for them all. Every job runs
as torchtitan.train's `main` runs it: its own config, Trainer, process group and seed; torchtitan's
seed-checkpoint mode too. Each job's log starts with a "run_jobs: job N of M" line. What a job
shares with the one before is the process: imports, the inductor cache on disk, and memory already
taken from the system (a launch's memory figures are its own only in a launch of its own); what a job
changes in the process for the next (compiled graphs, torchtitan's compiled MoE experts) is undone after it.

Why: a launch spends most of a short test run starting up (seen here: 11 of 16 s for a 2-step
2-rank run, the two ranks importing torchtitan on 2 cores), so one launch checks several runs.
"""

import contextlib
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torchtitan.train
from torchtitan.config import ConfigManager
from torchtitan.models.moe import moe as torchtitan_moe
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

_init_process_group = dist.init_process_group
# torchtitan's apply_compile replaces this module-level function with a compiled one for the rest of the process
# ("patch some globals only once", models/llama4/infra/parallelize.py, which qwen3 uses): an eager MoE job after a
# compiled one ran its experts compiled, and its gradients moved at 1e-7 relative (test_moe's 1-rank runs, 2026-12-05)
_EXPERTS_GROUPED_MM = torchtitan_moe._run_experts_grouped_mm


class _NoSleep:
    """torchtitan.train's `time`, less the 2 s its rank 0 sleeps at the end of every run "for other ranks to
    complete", once per job here: the plugin's metrics processor already ends a run with a barrier
    (plugin/runtime/metrics.py, docs/reliability.md), and the next job starts with a rendezvous."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        pass


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


# torchrun's variables that count the launch's ranks (on one node; GROUP_WORLD_SIZE counts nodes); a job on fewer
# ranks sees its own count
SIZES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")


@contextlib.contextmanager
def ranks(nproc: int | None):
    """The environment of a launch of `nproc` ranks (this rank among its first `nproc`), for the job's duration."""
    saved = {k: os.environ[k] for k in SIZES if k in os.environ}
    if nproc is not None:
        os.environ.update({k: str(nproc) for k in saved})
    try:
        yield
    finally:
        os.environ.update(saved)


def run(job: int, argv: list[str]) -> None:
    dist.init_process_group = _init_for(job)
    try:
        config = ConfigManager().parse_args(argv)
        trainer = Trainer(config)
    finally:
        dist.init_process_group = _init_process_group
    try:
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        trainer.close()
    del trainer


def clean_up() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    torch.compiler.reset()  # the next job compiles its own graphs, as a launch of its own would
    torchtitan_moe._run_experts_grouped_mm = _EXPERTS_GROUPED_MM  # and runs its experts eagerly unless it compiles


def main() -> None:
    torchtitan.train.time = _NoSleep()
    init_logger()
    jobs = json.loads(open(sys.argv[1]).read())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for job, spec in enumerate(jobs):
        spec = spec if isinstance(spec, dict) else {"argv": spec}
        argv, fails, nproc = spec["argv"], spec.get("fails", False), spec.get("nproc")
        assert nproc is None or 1 <= nproc <= world_size, f"job {job + 1}: nproc {nproc} in a launch of {world_size}"
        start = time.perf_counter()
        logger.info(f"run_jobs: job {job + 1} of {len(jobs)}: {' '.join(argv)}"
                    f"{f' (on {nproc} of the {world_size} ranks)' if nproc else ''}")
        if nproc is not None and rank >= nproc:
            continue
        try:
            with ranks(nproc):
                run(job, argv)
        except (Exception, SystemExit):  # SystemExit: torchtitan's parser exits on a bad value
            if not fails:
                raise
            logger.error(f"run_jobs: job {job + 1} of {len(jobs)} failed, as it should:\n{traceback.format_exc()}")
        else:
            if fails:
                raise SystemExit(f"run_jobs: job {job + 1} of {len(jobs)} should have failed and did not")
            logger.info(f"run_jobs: job {job + 1} of {len(jobs)} done in {time.perf_counter() - start:.1f} s")
        clean_up()
    # every job ended as it should: on CPU, leave before the interpreter's shutdown, where gloo's threads can abort a
    # rank (plugin.cpu.exit_before_shutdown arms this for torchtitan.train's own process; this script is not that one)
    import plugin.cpu  # the jobs' custom_import loaded it

    if plugin.cpu.is_active():
        plugin.cpu.leave_process(0)


if __name__ == "__main__":
    main()
