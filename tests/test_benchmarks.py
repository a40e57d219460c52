"""The benchmarks survive an out-of-memory job: it is recorded as OOM and the run goes on."""

import csv
import os
import signal
import subprocess
import sys

import pytest
import torch

import job_status  # benchmarks/, on the tests' path (pyproject.toml)
from conftest import REPO


@pytest.mark.slow  # torchrun jobs of the benchmark
def test_oom_variant_is_recorded_and_the_run_goes_on(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/logprob_memory.py", "--device", "cpu", "--batch", "1", "--seq", "64",
         "--vocab", "256", "--dim", "32", "--tp", "2", "--chunk", "32", "--repeats", "1",
         "--variants", "loss_parallel,chunked", "--passes", "reference", "--out", str(tmp_path),
         "--simulate-oom", "chunked"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    with open(tmp_path / "logprob_memory.csv") as f:
        rows = {(r["variant"], r["pass"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("loss_parallel", "reference"), ("chunked", "reference")}
    ok, oom = rows["loss_parallel", "reference"], rows["chunked", "reference"]
    assert ok["status"] == "ok" and float(ok["peak_gib"]) > 0 and float(ok["time_s"]) > 0
    assert oom["status"] == "OOM" and oom["peak_gib"] == oom["growth_gib"] == oom["time_s"] == ""
    assert "OutOfMemoryError" in oom["detail"]
    assert (tmp_path / "logprob_memory.png").stat().st_size > 0
    assert "| chunked | reference | OOM |" in (tmp_path / "logprob_memory.md").read_text()

    table = [line for line in proc.stdout.splitlines() if line.startswith("| chunked | reference |")]
    assert table and "| OOM |" in table[0]
    assert "| loss_parallel | reference | OOM" not in proc.stdout


@pytest.mark.parametrize("exc, oom", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), True),
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 93825044 bytes"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("--seq 63 must be divisible by --tp 2"), False),
])
def test_is_oom(exc, oom):
    assert job_status.is_oom(exc) is oom


TORCHRUN_KILLED = """
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4391)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 4391
"""


def test_classify():
    classify = job_status.classify
    assert classify(0, "all fine") == ("ok", "")
    assert classify(None, "") == ("timeout", "")
    assert classify(1, "", [{"status": "OOM", "detail": "OutOfMemoryError: CUDA out of memory"}]) == (
        "OOM", "OutOfMemoryError: CUDA out of memory")
    # killed by the kernel: the process itself, a shell's 128 + 9, or a rank under torchrun
    assert classify(-9)[0] == classify(137)[0] == classify(1, TORCHRUN_KILLED)[0] == "OOM"
    # an OOM that no handler reported, e.g. while a rank was starting
    assert classify(1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")[0] == "OOM"
    status, detail = classify(1, "Traceback (most recent call last):\n  ...\nValueError: bad shape\nexit\n")
    assert status == "error: ValueError: bad shape" and detail == "ValueError: bad shape"
    # torchrun prefixes a rank's lines, and its own ChildFailedError says less than the rank's error
    ranks = "[rank0]: Traceback:\n[rank0]: ValueError: --seq 63\ntorch...errors.ChildFailedError: \n====\n"
    assert classify(1, ranks)[0] == "error: ValueError: --seq 63"
    assert classify(1, "", [{"status": "error", "detail": "KeyError: 'x'"}])[0] == "error: KeyError: 'x'"
    assert classify(2, "")[0] == "error: exit 2"


MEMCHECK_LOG = """==7== Invalid read of size 8
==7==    at 0x4023C6C: strncmp (strcmp-sse2.S:160)
==7==    by 0x4004BEE: is_dst (dl-load.c:216)
==7==    by 0x40059BE: _dl_dst_count (dl-load.c:253)
==7== 
==7== Invalid write of size 2
==7==    at 0x1A2B: gloo::transport::tcp::Pair::read() (pair.cc:612)
==7==    by 0x1A3C: gloo::transport::tcp::Loop::run() (loop.cc:90)
==7== 
==7== Invalid free() / delete / delete[] / realloc()
==7==    at 0x48: free (vg_replace_malloc.c:985)
==7==    by 0x1B: c10::free_cpu(void*) (alloc_cpu.cpp:140)
"""


def test_memcheck_counts_errors_but_the_dynamic_loaders_false_positives():
    from memcheck_sampler import errors_in

    assert errors_in(MEMCHECK_LOG) == {"Invalid write": 1, "Invalid free() / delete / delete[] / realloc()": 1}
    assert errors_in("==7== ERROR SUMMARY: 0 errors from 0 contexts\n") == {}


def test_memcheck_loop_finds_glibcs_and_pythons_fatal_lines_only():
    from memcheck_sampler import FATAL

    out = ("rank 1: cached done 3 time(s) in 9.1 s\nmalloc(): unaligned tcache chunk detected\n"
           "Fatal Python error: Aborted\n[titan] a log line that mentions malloc and corrupted data\n"
           "double free or corruption (out)\n")
    assert FATAL.findall(out) == ["malloc(): unaligned tcache chunk detected", "Fatal Python error: Aborted",
                                  "double free or corruption (out)"]


def test_run_job_sees_a_sigkill_as_oom_and_kills_on_timeout():
    code = f"import os, signal; os.kill(os.getpid(), {int(signal.SIGKILL)})"
    returncode, _ = job_status.run_job([sys.executable, "-c", code])
    assert job_status.classify(returncode)[0] == "OOM"
    returncode, _ = job_status.run_job([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert returncode is None


def test_simulated_oom_spec():
    spec = job_status.simulated_oom
    assert spec("chunked", "chunked", "policy") == "raise"
    assert spec("chunked:reference", "chunked", "policy") is None
    assert spec("gather:policy:kill,chunked", "gather", "policy") == "kill"
    assert spec("chunked_compiled", "chunked", "policy") is None
    assert spec(None, "chunked", "policy") is None


def test_worker_pids_and_proc_status():
    """What memory_soak.py and test_faults.py read of a torchrun job's workers: children by rank, their memory."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(sleeper, env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)})
             for rank in (1, 0)]
    other = subprocess.Popen(sleeper, env={k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")})
    try:
        expected = {0: procs[1].pid, 1: procs[0].pid}
        assert job_status.worker_pids(os.getpid()) == job_status.worker_pids(os.getpid(), "LOCAL_RANK") == expected
        status = job_status.proc_status(procs[0].pid, ("VmRSS", "VmHWM"))
        assert set(status) == {"VmRSS", "VmHWM"} and 0 < status["VmRSS"] <= status["VmHWM"]
    finally:
        for p in (*procs, other):
            p.kill()
            p.wait()
    assert job_status.proc_status(procs[0].pid, ("VmRSS",)) is None


def test_gpu_oneshot_help():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_oneshot.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "--smoke" in proc.stdout, proc.stderr


def test_generation_speed_smoke(tmp_path):
    """benchmarks/generation_speed.py at a tiny size: both samplers timed, the same tokens, CSV and PNG written."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/generation_speed.py", "--new-tokens", "2,4", "--batch", "2", "--prompt-len", "3",
         "--repeats", "1", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(tmp_path / "generation_speed.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["sampler"], r["new_tokens"]) for r in rows] == [("cached", "2"), ("oracle", "2"), ("cached", "4"),
                                                               ("oracle", "4")]
    assert all(float(r["tokens_per_s"]) > 0 and r["same_tokens"] == "True" for r in rows)
    assert (tmp_path / "generation_speed.png").stat().st_size > 0
    assert "| cached | 4 |" in (tmp_path / "generation_speed.md").read_text()
    assert "| 4 |" in proc.stdout
