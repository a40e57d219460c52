"""The multi-rank harness itself (conftest.run_ranks): a rank that crashes while it works fails the test, naming
the rank and the signal, with its Python stack printed; nothing retries it."""

import os
import signal

import pytest

from conftest import run_ranks


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
