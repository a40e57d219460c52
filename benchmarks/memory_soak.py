"""Memory soak: does a long run of the main job hold its memory?

Runs the main job (`train_configs/debug_cpu.toml`: grpo_llama3 debugmodel, 2 CPU ranks, TP=2,
TensorBoard on) for --steps steps or --minutes minutes, whichever comes first, and samples each
rank's memory from OUTSIDE the job: the worker processes are torchrun's children (rank from their
environment), and every --sample-every steps, as soon as rank 0's log line "step: N" arrives on
torchrun's stdout, this script reads VmRSS, VmHWM, RssAnon and RssFile from /proc/<pid>/status of
every worker. Nothing in the job is changed but the step count, the log frequency and the dump folder.

Between samples it also polls every worker's VmRSS every --poll seconds and keeps, per sample, the
max and min over the --window steps before it: a sample read at the log line depends on where in
the step the rank is (glibc may have just returned free heap to the kernel), the window's extremes
do not.

Growth after warm-up (steps >= --warmup) is a least-squares slope per rank, with its standard error,
in MiB per 1,000 steps (target: <= 1), of the sampled VmRSS, of the window max and min, and of
RssAnon (heap and anonymous mappings only; RssFile also moves as library pages are touched or
evicted, which is no leak). The default warm-up is 500 steps: torchtitan turns on torch's flight
recorder ([comm] trace_buf_size = 20000), whose ring gloo fills at ~118 entries a step here, ~33
MiB per rank by step ~170, and the heap settles by step ~350 (docs/reliability.md).

Notes on the figures:
- VmHWM is the peak since the job's last reset of it: the plugin resets it (plugin.cpu.reset_peak_rss,
  /proc/self/clear_refs) before every reference pass and torchtitan at every logged step, so it is a
  within-step peak, not the run's.
- glibc malloc is left at its defaults unless --env sets e.g. MALLOC_ARENA_MAX=2 or
  MALLOC_TRIM_THRESHOLD_=1073741824 (diagnostics only: the main job runs with the defaults).
- The machine may be shared: time per step moves with other jobs, memory per step does not.

Usage:
    python benchmarks/memory_soak.py                        # 2,000 steps or 30 minutes (~19 min on 2 shared cores)
    python benchmarks/memory_soak.py --steps 300 --minutes 5 --sample-every 25 --warmup 50 --out /tmp/soak
    python benchmarks/memory_soak.py --env MALLOC_ARENA_MAX=2 --tag arena2
    python benchmarks/memory_soak.py -- --comm.trace_buf_size 0        # extra torchtitan flags after --
    python benchmarks/memory_soak.py --analyze benchmarks/results/memory_soak.csv   # table and plot again

Writes <out>/memory_soak[_TAG].csv (one row per rank per sample) and .png, prints a table; exits 1
if the job failed before reaching a stop condition.
"""

import argparse
import collections
import csv
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import results_md
from job_status import proc_status, worker_pids  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MiB = 2**20
TARGET_MIB_PER_1K = 1.0
STEP_RE = re.compile(r"step:\s*(\d+)\s")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock cap; the job is stopped after it (default 30)")
    p.add_argument("--sample-every", type=int, default=50, help="sample every N steps (default 50)")
    p.add_argument("--warmup", type=int, default=500,
                   help="fit the slopes from this step on (default 500: the flight recorder's ring fills by step ~350)")
    p.add_argument("--window", type=int, default=10,
                   help="steps before each sample over which the polled VmRSS's max and min are kept (default 10)")
    p.add_argument("--poll", type=float, default=0.05, help="seconds between VmRSS polls of the workers (default 0.05)")
    p.add_argument("--log-freq", type=int, default=1,
                   help="[metrics] log_freq; must divide --sample-every (default 1, the main job's own)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2, TP=2 as the main job)")
    p.add_argument("--config", default="train_configs/debug_cpu.toml")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the CSV and PNG (default benchmarks/results)")
    p.add_argument("--tag", default="", help="suffix of the output names: memory_soak_TAG.csv")
    p.add_argument("--dump-folder", type=Path, default=REPO / "benchmarks" / "results" / "tmp" / "memory_soak",
                   help="the job's dump folder (TensorBoard events, the job's log); git-ignored by default")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the job, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    p.add_argument("--analyze", type=Path, metavar="CSV",
                   help="run nothing: the table and plot (next to it) of an earlier run's CSV")
    p.add_argument("extra", nargs="*", help="extra torchtitan flags, after --")
    args = p.parse_args(argv)
    if args.sample_every % args.log_freq:
        p.error(f"--log-freq {args.log_freq} must divide --sample-every {args.sample_every}")
    for kv in args.env:
        if "=" not in kv:
            p.error(f"--env {kv!r}: expected KEY=VALUE")
    return args


# ---------------------------------------------------------------------------------------------
# the run


class Soak:
    def __init__(self, args):
        self.args = args
        self.samples: list[dict] = []
        self.last_step = 0
        self.workers: dict[int, int] = {}
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.tail: list[str] = []
        self.next_sample = args.sample_every
        # (latest logged step when read, rank, VmRSS bytes) of every poll; a few windows' worth
        self.polls: collections.deque = collections.deque(maxlen=200_000)

    def command(self) -> list[str]:
        a = self.args
        return [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.nproc}",
            "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0",
            "-m", "torchtitan.train", "--job.config_file", a.config,
            "--training.steps", str(a.steps), "--metrics.log_freq", str(a.log_freq),
            "--metrics.enable_tensorboard", "--job.dump_folder", str(a.dump_folder), *a.extra,
        ]

    def sample(self, step: int) -> None:
        if len(self.workers) < self.args.nproc:
            self.workers.update(worker_pids(self.proc.pid))
        elapsed = time.monotonic() - self.t0
        # polls made while the latest logged step was in [step - window, step): the window's steps
        lo = max(step - self.args.window, 1)  # not the start-up's polls
        window = collections.defaultdict(list)
        for s, rank, rss in self.polls:
            if lo <= s < step:
                window[rank].append(rss)
        for rank, pid in sorted(self.workers.items()):
            st = proc_status(pid, FIELDS)
            if st is None:
                continue
            row = {"step": step, "elapsed_s": round(elapsed, 2), "rank": rank, "pid": pid}
            row.update({f"{k.lower()}_mib": round(st.get(k, 0) / MiB, 3) for k in FIELDS})
            w = window.get(rank) or [st["VmRSS"]]
            row.update(win_max_mib=round(max(w) / MiB, 3), win_min_mib=round(min(w) / MiB, 3), win_polls=len(window.get(rank, ())))
            self.samples.append(row)

    def read_output(self, log) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            log.write(line)
            self.tail = (self.tail + [line])[-60:]
            m = STEP_RE.search(ANSI_RE.sub("", line))
            if not m:
                continue
            step = int(m.group(1))
            with self.lock:
                self.last_step = step
                # the first logged step is the baseline; then every --sample-every steps
                if step == 1 or step >= self.next_sample:
                    self.sample(step)
                    while self.next_sample <= step:
                        self.next_sample += self.args.sample_every
                    if step % 200 == 0 and self.workers:
                        rss = ", ".join(f"rank {r['rank']} {r['vmrss_mib']:.1f}" for r in self.samples[-len(self.workers):])
                        print(f"[soak] step {step} ({(time.monotonic() - self.t0) / 60:.1f} min): VmRSS MiB {rss}",
                              flush=True)

    def run(self) -> tuple[str, int]:
        a = self.args
        a.dump_folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.update(dict(kv.split("=", 1) for kv in a.env))
        cmd = self.command()
        print("[soak]", " ".join(cmd), flush=True)
        if a.env:
            print("[soak] env:", " ".join(a.env), flush=True)
        deadline = self.t0 + a.minutes * 60
        with open(a.dump_folder / "soak_job.log", "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            reader = threading.Thread(target=self.read_output, args=(log,), daemon=True)
            reader.start()
            stopped_by = "steps"
            last_scan = 0.0
            while self.proc.poll() is None:
                now = time.monotonic()
                if len(self.workers) < a.nproc and now - last_scan > 1.0:
                    last_scan = now
                    with self.lock:
                        self.workers.update(worker_pids(self.proc.pid))
                if now > deadline:
                    stopped_by = "minutes"
                    self.stop()
                    break
                # VmRSS of every worker between samples: the window's max and min are phase-independent
                step = self.last_step
                for rank, pid in list(self.workers.items()):
                    st = proc_status(pid, ("VmRSS",))
                    if st:  # None once the process is gone, {} while it exits
                        with self.lock:
                            self.polls.append((step, rank, st["VmRSS"]))
                time.sleep(a.poll)
            rc = self.proc.wait()
            reader.join(timeout=30)
        if stopped_by == "steps" and (rc != 0 or self.last_step < a.steps):
            stopped_by = f"failed (exit {rc})"
        return stopped_by, rc

    def stop(self) -> None:
        """SIGTERM to the job's process group (torchrun forwards it), SIGKILL after 30 s."""
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
# analysis


def fit(samples: list[dict], rank: int, key: str, warmup: int) -> tuple[float, float, int, float]:
    """Least squares of `key` against step, steps >= warmup: (slope in MiB per 1,000 steps, intercept,
    points, the slope's standard error in MiB per 1,000 steps)."""
    import numpy as np

    pts = [(s["step"], s[key]) for s in samples if s["rank"] == rank and s["step"] >= warmup]
    if len(pts) < 2:
        return float("nan"), float("nan"), len(pts), float("nan")
    x, y = np.array(pts, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (intercept + slope * x)
    sxx = ((x - x.mean()) ** 2).sum()
    se = float(np.sqrt((resid**2).sum() / (len(x) - 2) / sxx)) if len(x) > 2 and sxx > 0 else float("nan")
    return slope * 1000, intercept, len(pts), se * 1000


def summarize(samples: list[dict], warmup: int) -> list[dict]:
    rows = []
    for rank in sorted({s["rank"] for s in samples}):
        mine = [s for s in samples if s["rank"] == rank]
        after = [s for s in mine if s["step"] >= warmup] or mine
        rss_slope, _, n, rss_se = fit(samples, rank, "vmrss_mib", warmup)
        win_slope, _, _, win_se = fit(samples, rank, "win_max_mib", warmup)
        min_slope, _, _, min_se = fit(samples, rank, "win_min_mib", warmup)
        rows.append({
            "rank": rank, "points": n, "first_step": mine[0]["step"], "last_step": mine[-1]["step"],
            "warm_step": after[0]["step"],
            "rss_first": mine[0]["vmrss_mib"], "rss_warm": after[0]["vmrss_mib"], "rss_last": mine[-1]["vmrss_mib"],
            "rss_min": min(s["vmrss_mib"] for s in after), "rss_max": max(s["vmrss_mib"] for s in after),
            "hwm_max": max(s["vmhwm_mib"] for s in after),
            "rss_slope": rss_slope, "rss_se": rss_se, "win_max_slope": win_slope, "win_max_se": win_se,
            "win_min_slope": min_slope, "win_min_se": min_se,
            "anon_slope": fit(samples, rank, "rssanon_mib", warmup)[0],
            "rss_slope_200": fit(samples, rank, "vmrss_mib", 200)[0],
        })
    return rows


def table(summary: list[dict], warmup: int) -> str:
    lines = [
        f"| rank | samples from step {warmup} | VmRSS at step 1 / {warmup} / last (MiB) | VmRSS min-max from step {warmup} (MiB) "
        f"| VmHWM max (MiB) | VmRSS slope | window-max slope | window-min slope | RssAnon slope | VmRSS slope from step 200 |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        lines.append(
            f"| {r['rank']} | {r['points']} | {r['rss_first']:.1f} / {r['rss_warm']:.1f} / {r['rss_last']:.1f} "
            f"(step {r['last_step']}) | {r['rss_min']:.1f}-{r['rss_max']:.1f} | {r['hwm_max']:.1f} "
            f"| {r['rss_slope']:+.2f} ± {r['rss_se']:.2f} | {r['win_max_slope']:+.2f} ± {r['win_max_se']:.2f} "
            f"| {r['win_min_slope']:+.2f} ± {r['win_min_se']:.2f} "
            f"| {r['anon_slope']:+.2f} | {r['rss_slope_200']:+.2f} |"
        )
    lines.append("\nslopes in MiB per 1,000 steps, least squares, ± one standard error; window max: the highest of the "
                 "VmRSS polls over the --window steps before each sample (phase-independent); window min: the lowest")
    return "\n".join(lines)


def table_rows(rows: list[dict], warmup: int = 500) -> list[dict]:
    """The CSV's samples as the short table's rows: per rank, VmRSS at three steps and the slopes from `warmup`."""
    return [{"rank": s["rank"], "VmRSS at step 1 / 500 / last (MiB)":
             f"{s['rss_first']:.1f} / {s['rss_warm']:.1f} / {s['rss_last']:.1f} (step {s['last_step']})",
             "VmRSS slope from step 500 (MiB / 1,000 steps)": f"{s['rss_slope']:+.2f} ± {s['rss_se']:.2f}",
             "window-max slope": f"{s['win_max_slope']:+.2f} ± {s['win_max_se']:.2f}"}
            for s in summarize(typed(rows), warmup)]


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"memory_soak": dict(script="memory_soak.py", pick=table_rows)}


def plot(samples: list[dict], summary: list[dict], warmup: int, window: int, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(summary):
        c = colors[i % len(colors)]
        mine = [s for s in samples if s["rank"] == r["rank"]]
        steps = np.array([s["step"] for s in mine])
        rss = np.array([s["vmrss_mib"] for s in mine])
        ax.fill_between(steps, [s["win_min_mib"] for s in mine], [s["win_max_mib"] for s in mine], color=c, alpha=0.15,
                        label=f"rank {r['rank']} VmRSS min-max over the {window} steps before")
        ax.plot(steps, rss, "o-", ms=3, color=c,
                label=f"rank {r['rank']} VmRSS: {r['rss_slope']:+.2f} ± {r['rss_se']:.2f} MiB / 1k steps from step {warmup}")
        slope, icpt, _, _ = fit(samples, r["rank"], "vmrss_mib", warmup)
        xs = steps[steps >= warmup]
        if len(xs) >= 2:
            ax.plot(xs, icpt + slope / 1000 * xs, "--", color="k", lw=0.8)
        # right: change since the first sample at or after warm-up
        after = [s for s in mine if s["step"] >= warmup]
        if after:
            x = [s["step"] for s in after]
            ax2.plot(x, [s["vmrss_mib"] - after[0]["vmrss_mib"] for s in after], "o-", ms=3, color=c,
                     label=f"rank {r['rank']} VmRSS: {r['rss_slope']:+.2f} ± {r['rss_se']:.2f} MiB / 1k steps")
            ax2.plot(x, [s["win_max_mib"] - after[0]["win_max_mib"] for s in after], "s--", ms=2, color=c, alpha=0.7,
                     label=f"rank {r['rank']} window max: {r['win_max_slope']:+.2f} ± {r['win_max_se']:.2f} MiB / 1k steps")
    ax.axvline(warmup, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="step", ylabel="MiB", title="resident memory per rank (sampled at rank 0's log line)")
    ax.legend(fontsize=7)
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set(xlabel="step", ylabel="MiB", title=f"change since step {warmup} (least-squares fit from step {warmup})")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def load_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return typed(csv.DictReader(f))


def typed(rows) -> list[dict]:
    """CSV rows (strings) as the samples they were written from."""
    ints = ("step", "rank", "pid", "win_polls")
    return [{k: (int(v) if k in ints else float(v)) for k, v in r.items()} for r in rows]


def verdict(slope: float, se: float) -> str:
    if slope <= TARGET_MIB_PER_1K:
        return "flat"
    return "within 2 standard errors of the target" if slope - 2 * se <= TARGET_MIB_PER_1K else "GROWS"


def main(argv=None) -> int:
    args = parse_args(argv)
    stem = "memory_soak" + (f"_{args.tag}" if args.tag else "")
    csv_path, png_path = args.out / f"{stem}.csv", args.out / f"{stem}.png"
    malloc = " ".join(args.env) if args.env else "glibc malloc defaults"
    if args.analyze:  # the figures, table and plot of an earlier run's CSV
        samples = load_csv(args.analyze)
        last_step, minutes = max(s["step"] for s in samples), max(s["elapsed_s"] for s in samples) / 60
        stopped_by, failed = ("steps" if last_step >= args.steps else "minutes"), False
        png_path = args.analyze.with_suffix(".png")
    else:
        soak = Soak(args)
        stopped_by, rc = soak.run()
        failed = stopped_by.startswith("failed")
        minutes, samples, last_step = (time.monotonic() - soak.t0) / 60, soak.samples, soak.last_step
        args.out.mkdir(parents=True, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            cols = ["step", "elapsed_s", "rank", "pid", *(f"{k.lower()}_mib" for k in FIELDS), "win_max_mib",
                    "win_min_mib", "win_polls"]
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(samples)
        results_md.write(csv_path, **TABLES["memory_soak"])
        if failed:
            print("[soak] the job failed; its output's tail:\n" + "".join(soak.tail), file=sys.stderr)
    print(f"\n[soak] stopped by: {stopped_by}; last step {last_step} of {args.steps}; {minutes:.1f} min; "
          f"{len(samples)} samples; {malloc}")
    if not samples:
        print("[soak] no samples", file=sys.stderr)
        return 1
    summary = summarize(samples, args.warmup)
    print(table(summary, args.warmup))
    for key, name in (("rss_slope", "VmRSS"), ("win_max_slope", "window-max VmRSS")):
        worst = max(summary, key=lambda r: r[key])
        se = worst[key.replace("slope", "se")]
        print(f"highest {name} slope from step {args.warmup}: {worst[key]:+.2f} ± {se:.2f} MiB / 1,000 steps "
              f"(rank {worst['rank']}; target <= {TARGET_MIB_PER_1K:g}): {verdict(worst[key], se)}")
    title = (f"{args.config}, {args.nproc} ranks, log_freq {args.log_freq}, {malloc}: "
             f"{last_step} steps in {minutes:.1f} min (stopped by {stopped_by})")
    plot(samples, summary, args.warmup, args.window, title, png_path)
    print(f"wrote {png_path}" if args.analyze else f"wrote {csv_path} and {png_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
