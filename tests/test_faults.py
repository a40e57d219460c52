"""Faults: a rank lost mid-run; torchrun restarts the job, which resumes bitwise from the latest full checkpoint.

The launch recipe (docs/reliability.md, "A lost rank"):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 1 ...

Why the variable: since torch 2.5 the c10d rendezvous (torchrun's default on one node, `--standalone`,
`--rdzv-backend c10d` on any port) lets the workers' `init_process_group` use the elastic agent's own
TCPStore, created once per agent and kept across restarts, with nothing in the keys naming the attempt.
A restarted worker then finds the killed attempt's keys still there (gloo's per-rank addresses,
NCCL's unique id) and can read its peer's dead address before the peer rewrites it: gloo's
connectFullMesh fails ("Connection refused" / "Connect timeout") or hangs until the init timeout. Who
writes first is a race, so a fixed port or the static backend recovers now and then, not reliably.
With the variable set, every attempt gets a fresh store, hosted by the new rank 0 on a new port.

Simplifications:
1. One fault: local rank 1 of 2 (TP=2) gets SIGKILL as soon as the step-2 checkpoint is complete
   (its `.metadata`, written last, exists), while steps 3-8 are still to run.
2. The worker to kill is found through /proc (a child of the torchrun process with LOCAL_RANK=1);
   nothing in the product or the training config knows about the fault.
3. Each launch of rank 0 writes its own TensorBoard event file (both may share one run folder:
   torchtitan names it by the minute), so the restarted attempt's scalars are read from its own file.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import CONFIG, REPO, check, torchrun
from job_status import worker_pids  # benchmarks/job_status.py, as memory_soak.py finds its workers

STEPS, INTERVAL, KILL_AFTER = 8, 2, 2
TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "grpo/kl", "grpo/reward_mean")
RECIPE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _flags(dump: Path, seed: Path) -> list[str]:
    return ["--job.dump_folder", str(dump), "--training.steps", str(STEPS), "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(seed), "--checkpoint.no-last-save-model-only",
            "--checkpoint.interval", str(INTERVAL)]


def launch_and_kill(dump: Path, seed: Path, victim: int = 1, timeout: float = 400):
    """torchrun --max-restarts 1 with the recipe's environment; SIGKILL one worker once step-KILL_AFTER is saved.

    Returns (returncode, log, killed_pid).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0",
           "-m", "torchtitan.train", "--job.config_file", CONFIG, *_flags(dump, seed),
           "--comm.init_timeout_seconds", "90"]  # a failed re-connect fails in 90 s, not torchtitan's 300
    env = {**os.environ, "OMP_NUM_THREADS": "1", **RECIPE_ENV}
    log_path = dump / "launch.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        metadata = dump / "checkpoint" / f"step-{KILL_AFTER}" / ".metadata"
        killed = None
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if killed is None and metadata.exists():
                    killed = worker_pids(proc.pid, "LOCAL_RANK")[victim]
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the session of this torchrun only
            proc.wait()
    return proc.returncode, log_path.read_text(), killed


def scalars_by_launch(dump: Path) -> list[dict[str, dict[int, float]]]:
    """TensorBoard scalars of each event file (one per launch of rank 0), oldest first: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    launches = []
    for path in (dump / "tb").glob("*/events.out.tfevents.*"):
        first_time, scalars = None, {}
        for event in EventFileLoader(str(path)).Load():
            first_time = event.wall_time if first_time is None else first_time
            for value in event.summary.value:
                if value.HasField("tensor"):
                    scalars.setdefault(value.tag, {})[event.step] = tensor_util.make_ndarray(value.tensor).item()
        if first_time is not None:
            launches.append((first_time, scalars))
    return [scalars for _, scalars in sorted(launches, key=lambda x: x[0])]


def test_lost_rank_restarts_and_resumes_bitwise(tmp_path, seed_checkpoint):
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    straight.mkdir(), faulted.mkdir()
    check(torchrun(2, CONFIG, *_flags(straight, seed_checkpoint)))
    returncode, log, killed = launch_and_kill(faulted, seed_checkpoint)

    assert killed is not None, "the run ended before step-%d was saved:\n%s" % (KILL_AFTER, log[-6000:])
    assert returncode == 0, log[-10000:]
    # torchrun reports the failure with the earliest timestamp: usually the killed rank 1 (SIGKILL, -9),
    # but rank 0's own error (its peer gone mid-collective) can be stamped first, as its error file
    # carries the time it raised while the agent notes rank 1's death only at its next poll
    failure = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d) \(pid: (\d+)\)", log)
    assert failure, log[-6000:]
    if failure[2] == "1":
        assert (failure[1], failure[3]) == ("-9", str(killed)), failure[0]

    # the restarted attempt loaded the latest full checkpoint there was, at or after the kill
    loads = re.findall(r"Loading the checkpoint from (\S+)\.\n", log)
    assert len(loads) == 2 and loads[0] == str(seed_checkpoint), loads
    resumed = Path(loads[1])
    assert resumed.parent == faulted / "checkpoint", loads
    resume_step = int(resumed.name.removeprefix("step-"))
    assert KILL_AFTER <= resume_step < STEPS and resume_step % INTERVAL == 0, loads

    expected = scalars_by_launch(straight)
    assert len(expected) == 1
    expected = expected[0]
    *before, after = scalars_by_launch(faulted)
    assert len(before) <= 1  # the killed attempt's rank 0 writes its events only if it closes its writer in time
    assert sorted(after[TAGS[0]]) == list(range(resume_step + 1, STEPS + 1))
    for tag in TAGS:
        assert sorted(expected[tag]) == list(range(1, STEPS + 1)), tag
        for step, value in after[tag].items():
            assert value == expected[tag][step], (tag, step, value, expected[tag][step])
        for step, value in (before[0].get(tag, {}) if before else {}).items():
            assert value == expected[tag][step], (tag, step, value, expected[tag][step])
    assert expected["grpo/kl"][STEPS] > 0
