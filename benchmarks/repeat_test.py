"""Run pytest node ids many times each and count how each run ended: the check for rare crashes.

    python benchmarks/repeat_test.py --runs 30 --out benchmarks/results/tmp \
        "tests/test_sampler.py::test_generation_computes_in_the_trainers_dtype_on_every_layout[tp2]"

The node ids run in turns (one run of each, then the next round), so several ids load the machine as CI's
suite does; each run is a fresh pytest process with MALLOC_PERTURB_ set, so that a freed block is overwritten
(a use after free reads garbage instead of the old values), and MALLOC_CHECK_=3, which glibc 2.34 and later
ignore unless libc_malloc_debug is preloaded (docs/reliability.md). A run that did not pass keeps its output
(`<out>/<id>-<run>.log`); the CSV has a row per run: the node id, the run, its exit code, the seconds, and the
signs of a crash in the output (a fatal signal, glibc's heap messages, a timeout). `--summarize RUNS.csv ...`
writes benchmarks/results/repeat_test.csv (and its table): per node id, the runs, how many passed and the crash
signs seen.
"""

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results_md  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TABLES = {"repeat_test": dict(script="repeat_test.py --summarize", pick=None)}
# what a crashed rank leaves in the output: faulthandler's line, glibc's heap checks, C++'s terminate
CRASH = re.compile(r"Fatal Python error: \w+|malloc\(\): [^\n]*|free\(\): [^\n]*|double free[^\n]*|corrupted [^\n]*"
                   r"|terminate called[^\n]*|Segmentation fault|SIGSEGV|SIGABRT|exitcode\s*:\s*-\d+")


def run_once(node: str, timeout: int) -> tuple[int | None, float, str]:
    env = {**os.environ, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "204"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return None, time.monotonic() - start, out + "\n[timeout]"


def summarize(paths: list[Path]) -> Path:
    """Per node id over the runs CSVs: runs, passes, crash signs; written to benchmarks/results/repeat_test.csv."""
    rows = [r for path in paths for r in csv.DictReader(open(path, newline=""))]
    out = []
    for node in dict.fromkeys(r["node"] for r in rows):
        mine = [r for r in rows if r["node"] == node]
        signs = sorted({s for r in mine for s in r["crash_signs"].split("; ") if s})
        out.append({"node": node, "runs": len(mine), "passed": sum(r["exit_code"] == "0" for r in mine),
                    "median_s": f"{statistics.median(float(r['seconds']) for r in mine):.0f}",
                    "crash_signs": "; ".join(signs) or "none"})
    results_md.write_csv(RESULTS / "repeat_test.csv", out, list(out[0]), **TABLES["repeat_test"])
    return RESULTS / "repeat_test.csv"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("nodes", nargs="*", help="pytest node ids")
    p.add_argument("--summarize", nargs="+", type=Path, metavar="RUNS_CSV", help="summarize earlier runs instead")
    p.add_argument("--runs", type=int, default=30, help="runs of each node id")
    p.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tmp" / "repeat_test")
    args = p.parse_args(argv)
    if args.summarize:
        print(f"wrote {summarize(args.summarize)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(1, args.runs + 1):
        for i, node in enumerate(args.nodes):
            code, seconds, out = run_once(node, args.timeout)
            signs = sorted(set(CRASH.findall(out))) + (["timeout"] if code is None else [])
            rows.append({"node": node, "run": run, "exit_code": "" if code is None else code,
                         "seconds": f"{seconds:.1f}", "crash_signs": "; ".join(signs)})
            if code != 0:
                (args.out / f"{i}-{run}.log").write_text(out)
            print(f"run {run} node {i}: exit {code} in {seconds:.0f} s {'; '.join(signs)}", flush=True)
            with open(args.out / "runs.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    for i, node in enumerate(args.nodes):
        mine = [r for r in rows if r["node"] == node]
        bad = [r for r in mine if r["exit_code"] != 0]
        print(f"{node}: {len(mine) - len(bad)} of {len(mine)} passed; node {i}'s failed runs: "
              f"{[r['run'] for r in bad]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
