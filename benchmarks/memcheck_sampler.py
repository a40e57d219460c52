"""The TP=2 sampler's decode under valgrind's memcheck: does any code write to freed memory or free twice?

    python benchmarks/memcheck_sampler.py --workload cached --threads 1
    python benchmarks/memcheck_sampler.py --workload dtypes --threads 2

`tests/test_sampler.py`'s TP=2 workloads, on 2 gloo ranks launched by hand (each its own process, so each can run
under valgrind): `dtypes`, the bf16 mixed-precision dtype check (a model build, the online sampler's generation, a
training forward) and a cached draw of each model; `cached`, each model's cached draws, plain and with tool-like
turns, and the vocab-sharded sampling check. CI once saw heap corruption in rank 1 there (glibc's "malloc():
unaligned tcache chunk detected" while the decode step waited on a functional collective; docs/reliability.md).

memcheck runs each rank with `--undef-value-errors=no` (only invalid reads, writes and frees), a 400 MB quarantine
of freed blocks (a late write into one is caught, not absorbed by a reuse) and `PYTHONMALLOC=malloc` (Python's own
objects through malloc too); 80-90x slower than native (the cached workload: 407 s a rank against 5.2 s). Each
rank's errors are counted by kind, without glibc's dynamic loader's reads past a string (frames in `dl-*.c`, a
known false positive of memcheck), and appended to benchmarks/results/memcheck_sampler.csv with the table; the logs
stay under `--out`. `--native` runs the same workload without valgrind (a check of the launcher). `--loop SECONDS`
runs it natively, over and over in each rank's one process until SECONDS have passed, freed and new blocks filled
by `MALLOC_PERTURB_` (`MALLOC_CHECK_=3` is set too, inert on glibc 2.34 and later without libc_malloc_debug
preloaded: docs/reliability.md): a race between threads that memcheck's one-thread-at-a-time scheduling cannot
show would have the workload's whole run to happen in; a rank's output holding glibc's or Python's fatal error
message counts as an error.

    python benchmarks/memcheck_sampler.py --workload cached --threads 2 --loop 600
"""

import argparse
import csv
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import results_md  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TABLES = {"memcheck_sampler": dict(script="memcheck_sampler.py", pick=None)}
MEMCHECK = ["valgrind", "--tool=memcheck", "--undef-value-errors=no", "--leak-check=no", "--error-limit=no",
            "--num-callers=40", "--freelist-vol=400000000"]
ERROR = re.compile(r"^==\d+== (Invalid (?:read|write|free\(\) / delete / delete\[\] / realloc\(\))[^\n]*|"
                   r"Mismatched free[^\n]*)\n((?:==\d+==    (?:at|by) [^\n]*\n)+)", re.M)
# glibc's heap-check aborts ("malloc(): unaligned tcache chunk detected", "double free or corruption (out)", ...) and
# Python's fatal errors, as a rank's output shows them
FATAL = re.compile(r"^(?:(?:malloc|free|realloc|munmap_chunk)\(\)|double free|corrupted |Fatal Python error).*$", re.M)


def rank_main(workload: str, loop: float = 0) -> None:
    """One rank's work (RANK, WORLD_SIZE, MASTER_* from the launcher); with `loop`, again until `loop` seconds passed."""
    import torch
    import torch.distributed as dist

    sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]
    torch.set_num_threads(int(os.environ["MEMCHECK_THREADS"]))
    dist.init_process_group("gloo")
    import test_sampler as ts

    start, runs = time.perf_counter(), 0
    while True:
        if workload == "dtypes":
            ts._dtypes((2, 1))
        for name in ("grpo_llama3", "grpo_qwen3"):
            model = ts.build(name, 2, 1)
            ts.draw(model, [], True)
            if workload == "cached":
                ts.draw(model, [], True, turns=ts.ToolLike())
        if workload == "cached":
            ts._sharded_sampling(2)
        runs += 1
        done = torch.tensor([time.perf_counter() - start >= loop], dtype=torch.int)
        dist.all_reduce(done)  # both ranks stop after the same run
        if done.item():
            break
    print(f"rank {dist.get_rank()}: {workload} done {runs} time(s) in {time.perf_counter() - start:.1f} s", flush=True)
    dist.destroy_process_group()


def errors_in(log: str) -> dict[str, int]:
    """Error kinds and counts in a memcheck log, the dynamic loader's false positives left out."""
    kinds: dict[str, int] = {}
    for kind, frames in ERROR.findall(log):
        if re.search(r"\(dl-\w+\.c:\d+\)", frames):  # inside glibc's dynamic loader
            continue
        kind = kind.split(" of size")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["dtypes", "cached"], default="cached")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads a rank (2: the layout CI crashed in)")
    ap.add_argument("--native", action="store_true", help="without valgrind")
    ap.add_argument("--loop", type=float, default=0, metavar="SECONDS",
                    help="natively, the workload again and again for SECONDS, MALLOC_PERTURB_ on")
    ap.add_argument("--out", type=Path, default=RESULTS / "tmp" / "memcheck_sampler")
    ap.add_argument("--rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        return rank_main(args.workload, args.loop)
    args.native = args.native or args.loop > 0
    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "MEMCHECK_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONMALLOC": "malloc",
           **({"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"} if args.loop else {})}
    procs, logs = [], []
    start = time.perf_counter()
    for rank in range(2):
        logs.append(args.out / f"{args.workload}-threads{args.threads}-rank{rank}.valgrind.log")
        wrapper = [] if args.native else [*MEMCHECK, f"--log-file={logs[-1]}"]
        cmd = [*wrapper, sys.executable, __file__, "--workload", args.workload, "--rank", str(rank),
               "--loop", str(args.loop)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=open(args.out / f"{args.workload}-rank{rank}.out", "w"),
                                      stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    seconds = time.perf_counter() - start
    rows = []
    for rank, (code, log) in enumerate(zip(codes, logs)):
        kinds = {} if args.native else errors_in(log.read_text())
        out = (args.out / f"{args.workload}-rank{rank}.out").read_text(errors="replace")
        fatal = FATAL.findall(out)
        kinds.update({line.strip()[:80]: 1 for line in fatal[:3]})
        runs = re.search(r"done (\d+) time", out)
        tool = f"loop x{runs.group(1) if runs else '?'}" if args.loop else "native" if args.native else "memcheck"
        rows.append({"date": time.strftime("%Y-%m-%d"), "workload": args.workload, "threads": args.threads,
                     "tool": tool, "rank": rank, "exit_code": code,
                     "seconds": f"{seconds:.0f}",
                     "errors": "; ".join(f"{k}: {n}" for k, n in kinds.items()) or "none"})
        print(rows[-1])
    if not args.native or args.loop:
        path = RESULTS / "memcheck_sampler.csv"
        old = list(csv.DictReader(open(path, newline=""))) if path.exists() else []
        results_md.write_csv(path, old + rows, list(rows[0]), **TABLES["memcheck_sampler"])


if __name__ == "__main__":
    main()
