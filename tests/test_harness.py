"""The multi-rank harness itself (conftest.run_ranks): a rank that crashes while it works fails the test, naming
the rank and the signal, with its Python stack printed; nothing retries it. The launch tally counts each
torchrun agent once, and a job of tests/run_jobs.py on fewer ranks than its launch sees its own rank count."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import LaunchTally, run_ranks


def _rank_1_crashes(rank, world_size):
    import torch.distributed as dist

    dist.barrier()  # both ranks are up and in the group, as in a real test's work
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()  # rank 0 waits on the dead peer: gloo reports the lost connection


def test_a_crashed_rank_fails_the_test_with_its_signal_and_stack(capfd):
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(2, _rank_1_crashes)
    assert "process 1 terminated with signal SIGSEGV" in str(failure.value)
    assert "Fatal Python error: Segmentation fault" in capfd.readouterr().err  # faulthandler's stack of rank 1


def _rank_1_raises_at_length(rank, world_size):
    if rank == 1:
        raise ValueError("x" * 200_000)  # a traceback longer than a pipe's 64 KiB buffer


def test_a_long_traceback_fails_the_test():
    """A rank's traceback longer than a pipe holds still reaches the failure (it once hung the test instead)."""
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(2, _rank_1_raises_at_length)
    message = str(failure.value)
    assert "--- rank 1 ---" in message and "ValueError: " + "x" * 200_000 in message


# a stand-in for a torchrun agent (its command line holds FAKE_AGENT as one argument; the suite's own tally, which
# looks for torchrun, does not count it) that forks a child which keeps the agent's command line for a second before
# it execs, as a rank does between fork and exec
FAKE_AGENT = "fake.torchrun.agent"
FORKING_AGENT = textwrap.dedent("""
    import os, sys, time
    child = os.fork()
    if child == 0:
        time.sleep(1.0)
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(0.5)"])
    os.waitpid(child, 0)
""")


def test_the_tally_counts_an_agent_once_not_its_children_before_they_exec():
    tally = LaunchTally(is_agent=lambda cmdline: FAKE_AGENT.encode() in cmdline)
    tally.watch()
    try:
        subprocess.run([sys.executable, "-c", FORKING_AGENT, FAKE_AGENT], check=True, timeout=60)
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.6)", FAKE_AGENT], check=True, timeout=60)
    finally:
        tally.stop()
    assert tally.running["torchrun"] == 2


def test_a_job_on_fewer_ranks_sees_a_launch_of_its_size(monkeypatch):
    """tests/run_jobs.py's `nproc`: for the job, torchrun's size variables say its rank count; after it, the launch's."""
    import run_jobs

    launch = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "1"}
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    with run_jobs.ranks(2):  # GROUP_WORLD_SIZE counts nodes: still one
        assert {name: os.environ[name] for name in launch} == {**dict.fromkeys(launch, "2"), "GROUP_WORLD_SIZE": "1"}
    assert {name: os.environ[name] for name in launch} == launch
    with run_jobs.ranks(None):
        assert {name: os.environ[name] for name in launch} == launch
