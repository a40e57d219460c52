"""When a separate generator pays on this 2-core machine: train_configs/smollm2_async_cpu.toml at max_staleness
k = 0, 1 and 2 (the trainer on core 0, the generator process on core 1), and the colocated run of the same work on
both cores (train_configs/smollm2_online_cpu.toml's settings: generator_mode = "colocate", 2 threads).

Each run: --training.steps N (default 12) from the converted SmolLM2 folder, evaluation and checkpoints off, in its
own dump folder, one after another (nothing else should run). From each run's TensorBoard events:
- step_s: torchtitan's time_metrics/end_to_end(s), the median over steps 3..N (the first two start the generator
  and its caches);
- trainer_wait_share: the share of the trainer's time spent waiting for batches (async/trainer_wait_share); the
  colocated run's is its generation share (online/generation_share), the time it spends sampling;
- generator_idle_share: the generator's share of time waiting for weights (async/generator_idle_share);
- push_s, push_GiB: one weight push; staleness_mean: versions between a batch's weights and its step.
step_vs_k0 is each run's step time over k = 0's of the same placement (the issue's goal: k = 1 at most 0.8).
"shared" runs leave both processes on both cores (no generator_devices, 2 threads each).

Usage (about 12 minutes on 2 cores):
    python -m plugin.convert_gguf --out outputs/smollm2_135m && python data/smollm2_data.py
    python benchmarks/async_rollouts.py
Writes benchmarks/results/async_rollouts.csv, .md and .png.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results_md
from job_status import read_scalars

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = "train_configs/smollm2_async_cpu.toml"
COLUMNS = ["run", "placement", "max_staleness", "steps", "step_s", "step_vs_k0", "trainer_wait_share",
           "generator_idle_share", "push_s", "push_GiB", "staleness_mean", "reward_mean", "wall_s"]
TABLES = {"async_rollouts": dict(script="async_rollouts.py", pick=lambda rows: [
    {"run": r["run"], "placement": r["placement"], "step (s)": f"{float(r['step_s']):.2f}",
     "vs k=0": f"{float(r['step_vs_k0']):.2f}x", "trainer waits": results_md.share(r["trainer_wait_share"]),
     "generator idle": results_md.share(r["generator_idle_share"]),
     "push (s)": f"{float(r['push_s']):.3f}" if r["push_s"] else "",
     "staleness": r["staleness_mean"]} for r in rows])}
RUNS = {  # name -> (placement, extra flags, environment)
    "colocated": ("trainer samples, 2 cores", ["--online.generator_mode", "colocate", "--online.max_staleness", "0",
                                              "--online.behavior_logprobs", "policy"], {"OMP_NUM_THREADS": "2"}),
    "k=0": ("trainer core 0, generator core 1", ["--online.max_staleness", "0"], {}),
    "k=1": ("trainer core 0, generator core 1", ["--online.max_staleness", "1"], {}),
    "k=2": ("trainer core 0, generator core 1", ["--online.max_staleness", "2"], {}),
    # no placement: both processes on both cores, 2 threads each; the OS shares them
    "k=0 shared": ("both on both cores", ["--online.max_staleness", "0", "--online.generator_devices"],
                   {"OMP_NUM_THREADS": "2"}),
    "k=1 shared": ("both on both cores", ["--online.max_staleness", "1", "--online.generator_devices"],
                   {"OMP_NUM_THREADS": "2"}),
}


def run(name: str, steps: int, work: Path) -> dict:
    placement, flags, env = RUNS[name]
    dump = work / name.replace("=", "").replace(" ", "_")
    shutil.rmtree(dump, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan.train",
               "--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(steps),
               "--validation.no-enable", "--checkpoint.no-enable", *flags]
    start = time.perf_counter()
    with open(work / f"{dump.name}.log", "w") as log:
        subprocess.run(command, cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - start
    scalars = read_scalars(dump)
    timed = [scalars[s] for s in range(3, steps + 1) if s in scalars]

    def median(tag: str) -> float | str:
        values = [s[tag] for s in timed if tag in s]
        return statistics.median(values) if values else ""

    wait = median("async/trainer_wait_share") if name != "colocated" else median("online/generation_share")
    return dict(run=name, placement=placement, max_staleness="" if name == "colocated" else name[2], steps=steps,
                step_s=median("time_metrics/end_to_end(s)"), trainer_wait_share=wait,
                generator_idle_share=median("async/generator_idle_share"), push_s=median("async/push_time(s)"),
                push_GiB=median("async/push_GiB"), staleness_mean=median("async/staleness_mean"),
                reward_mean=median("grpo/reward_mean"), wall_s=round(wall, 1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--work", default=str(REPO / "outputs" / "async_rollouts"))
    p.add_argument("--results", default=str(RESULTS / "async_rollouts.csv"))
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.runs.split(","):
        rows.append(run(name, args.steps, work))
        print(rows[-1], flush=True)
    for r in rows:  # against k = 0 of the same placement (colocated: the pinned one)
        base = next((b["step_s"] for b in rows if b["run"] == ("k=0 shared" if "shared" in r["run"] else "k=0")), None)
        r["step_vs_k0"] = round(r["step_s"] / base, 3) if base else ""
    path = results_md.write_csv(Path(args.results), rows, COLUMNS, **TABLES["async_rollouts"])
    plot(rows, Path(args.results).with_suffix(".png"))
    print(path.read_text())


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = [r["run"] for r in rows]
    steps = [r["step_s"] for r in rows]
    waits = [r["step_s"] * float(r["trainer_wait_share"] or 0) for r in rows]
    ax.bar(names, steps, color="#8fb3d9", label="step")
    ax.bar(names, waits, color="#d98f8f", label="trainer waiting for a batch (colocated: sampling)")
    ax.set_ylabel("seconds per step")
    ax.set_title("SmolLM2 sums on 2 CPU cores: a separate generator")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
