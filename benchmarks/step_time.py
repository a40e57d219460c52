"""End-to-end step time of GRPO against torchtitan's own cross-entropy training, same model and batch shape.

Variants, each a torchrun job of torchtitan's train.py on --tp ranks (train_configs/debug_cpu.toml with
the model, batch and sequence length overridden):
    ce          torchtitan's `llama3` TrainSpec and cross-entropy loss on a local text dataset
    grpo_beta0  `grpo_llama3`, [grpo] beta = 0: no reference model (the default fused policy pass)
    grpo_beta0_unfused  the same with [grpo] fused_policy_pass = false: log-probs first, the loss's backward after
    grpo_beta   `grpo_llama3`, [grpo] beta = --beta: a frozen reference, one extra forward per microbatch
    forward     not training: the `llama3` model's forward and cross-entropy under no_grad and loss_parallel,
                parallelized as torchtitan's Trainer does it; the cost of one extra forward pass

Simplifications:
1. Step time is torchtitan's own `time_metrics/end_to_end(s)` (rank 0's wall seconds between two logged
   steps, log_freq 1: data loading, forward, backward, optimizer, metrics), read from TensorBoard.
   Beside it, rank 0's CPU seconds per step: the jobs' custom_import is this file, which imports
   `plugin` and adds `step_time/cpu(s)` to every logged step. The first --warmup steps are dropped.
2. Random weights, fp32, no compile. Every GRPO token is a completion token (32 random prompt ids,
   seq_len + 1 - 32 random completion ids, group size 4, random 0/1 rewards), so the GRPO loss
   covers as many positions as cross-entropy does; the CE text is the bundled arithmetic rollouts
   packed into seq_len windows, as torchtitan packs c4.
3. On a shared CPU wall time follows the other jobs: the variants run interleaved, --repeats rounds,
   each round in a rotated order; a variant's ratio to CE is the median over rounds of
   (its median step / CE's median step in the same round). CPU seconds move much less with the
   other jobs (one OpenMP thread per rank, and gloo blocks rather than spins while it waits).

Usage: python benchmarks/step_time.py [--flavor debugmodel] [--batch 8] [--seq-len 256] [--repeats 4]
The defaults take about 17 minutes on 2 busy cores (20 jobs of 15-35 s). --smoke runs a tiny shape
once (about 90 s).
Writes <out>/step_time.csv and .png (default benchmarks/results/) and prints a table.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import CONFIG, REPO, build_model
from job_status import read_scalars, run_job
import results_md

VARIANTS = ("ce", "grpo_beta0", "grpo_beta0_unfused", "grpo_beta", "forward")
GROUP_SIZE = 4
PROMPT_LEN = 32
CPU_TAG = "step_time/cpu(s)"
COLUMNS = ("variant", "flavor", "batch", "seq_len", "tp", "beta", "repeats", "steps_timed", "median_step_s",
           "ratio_to_ce", "ratio_min", "ratio_max", "median_step_cpu_s", "ratio_to_ce_cpu", "ratio_min_cpu",
           "ratio_max_cpu", "round_medians_s", "round_medians_cpu_s", "ref_pass_s", "target_ratio", "meets_target",
           "target_ratio_cpu", "meets_target_cpu")
# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"step_time": dict(script="step_time.py", pick=results_md.columns(
    "variant", ("median_step_cpu_s", "CPU s / step"), ("ratio_to_ce_cpu", "/ cross-entropy"),
    ("ratio_min_cpu", "min over rounds"), ("ratio_max_cpu", "max over rounds"), ("target_ratio_cpu", "target"),
    ("meets_target_cpu", "meets target")))}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="debugmodel", help="a llama3 flavor")
    p.add_argument("--batch", type=int, default=8, help="local_batch_size, a multiple of the group size 4")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (ranks)")
    p.add_argument("--beta", type=float, default=0.04, help="[grpo] beta of the grpo_beta variant")
    p.add_argument("--steps", type=int, default=12, help="training steps (forward calls) per job")
    p.add_argument("--warmup", type=int, default=4, help="first steps of each job left out")
    p.add_argument("--repeats", type=int, default=4, help="rounds of all variants")
    p.add_argument("--smoke", action="store_true", help="a tiny shape, one round: checks that it runs")
    p.add_argument("--timeout", type=int, default=600, help="seconds per job")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # the forward job, set by the launcher
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.seq_len, args.steps, args.warmup, args.repeats = GROUP_SIZE, 48, 2, 1, 1
    if args.batch % GROUP_SIZE:
        p.error(f"--batch {args.batch} must be a multiple of the group size {GROUP_SIZE}")
    if args.seq_len <= PROMPT_LEN or args.seq_len % args.tp:
        p.error(f"--seq-len {args.seq_len} must exceed {PROMPT_LEN} and be divisible by --tp {args.tp}")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def write_data(folder: Path, seq_len: int) -> None:
    """The CE text folder (a c4_test-style dataset) and the GRPO rollout file."""
    (folder / "text").mkdir()
    with open(REPO / "data" / "arith_rollouts.jsonl") as f:
        lines = [json.loads(line) for line in f]
    with open(folder / "text" / "train.jsonl", "w") as f:
        for i in range(0, len(lines), 8):  # a document per two groups
            f.write(json.dumps({"text": " ".join(r["prompt"] + r["completion"] for r in lines[i : i + 8])}) + "\n")
    rng, vocab = random.Random(0), 2048  # the bundled tokenizer's ids: inside every llama3 flavor's vocabulary
    with open(folder / "rollouts.jsonl", "w") as f:
        for _ in range(64):
            row = {"prompt_ids": [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)],
                   # prompt + completion = seq_len + 1: the input fills seq_len with no padding
                   "completions_ids": [[rng.randrange(3, vocab) for _ in range(seq_len + 1 - PROMPT_LEN)]
                                       for _ in range(GROUP_SIZE)],
                   "rewards": [float(rng.random() < 0.5) for _ in range(GROUP_SIZE)]}
            f.write(json.dumps(row) + "\n")


def overrides(args, variant: str, data: Path) -> list[str]:
    """torchtitan command-line overrides of the bundled config for one variant."""
    common = ["--experimental.custom_import", "step_time", "--model.flavor", args.flavor,
              "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len), "--training.steps", str(args.steps),
              "--parallelism.tensor_parallel_degree", str(args.tp), "--metrics.log_freq", "1",
              "--metrics.enable_tensorboard"]
    if variant in ("ce", "forward"):
        return common + ["--model.name", "llama3", "--training.dataset", "c4_test",
                         "--training.dataset_path", str(data / "text")]
    beta = 0.0 if variant.startswith("grpo_beta0") else args.beta
    unfused = ["--grpo.no_fused_policy_pass"] if variant.endswith("_unfused") else []
    return common + ["--training.dataset_path", str(data / "rollouts.jsonl"), "--grpo.beta", str(beta), *unfused]


def run_variant(args, variant: str, data: Path, dump: Path, env: dict) -> dict:
    """One job: its step times after the warm-up, and for grpo_beta the reference pass's."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.tp}",
                "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0"]
    dump.mkdir()
    if variant == "forward":
        cmd = launcher + [str(Path(__file__).resolve()), "--worker",
                          json.dumps({"argv": overrides(args, variant, data), "out": str(dump / "forward.json"),
                                      "steps": args.steps})]
    else:
        cmd = launcher + ["-m", "torchtitan.train", "--job.config_file", CONFIG, "--job.dump_folder", str(dump),
                          *overrides(args, variant, data)]
    code, out = run_job(cmd, env=env, cwd=REPO, timeout=args.timeout)
    if code != 0:
        sys.stderr.write(out[-6000:])
        raise RuntimeError(f"{variant}: the job {'timed out' if code is None else f'exited {code}'}")
    if variant == "forward":
        times = json.loads((dump / "forward.json").read_text())
        return {"times": times["wall"][args.warmup :], "cpu": times["cpu"][args.warmup :], "ref": []}
    steps = [tags for _, tags in sorted(read_scalars(dump).items())][args.warmup :]
    return {"times": [t["time_metrics/end_to_end(s)"] for t in steps], "cpu": [t[CPU_TAG] for t in steps],
            "ref": [t["grpo/ref_time(s)"] for t in steps if "grpo/ref_time(s)" in t]}


def forward_worker(spec: dict) -> None:
    """The `llama3` model's forward + cross-entropy under no_grad, on this rank of a TP group; rank 0 writes the times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.distributed import ParallelDims

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, etp=1, world_size=world)
    # as the Trainer: TP with loss_parallel on the output layer; seed 0, so the same weights and tokens on every rank
    model, cfg, _, train_spec = build_model(*spec["argv"], parallel_dims=pd)
    loss_fn = train_spec.build_loss_fn(cfg)
    batch = cfg.training.local_batch_size
    tokens = torch.randint(0, model.model_args.vocab_size, (batch, cfg.training.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # [B, T]
    times = {"wall": [], "cpu": []}
    for _ in range(spec["steps"]):
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad(), loss_parallel():
            loss_fn(model(inputs), labels).item()
        times["wall"].append(time.perf_counter() - wall)
        times["cpu"].append(time.process_time() - cpu)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(times))
    dist.destroy_process_group()


def install_step_clock() -> None:
    """In a training job, as its custom_import: GRPO and the CPU patches, and rank 0's CPU seconds per logged step."""
    import plugin  # noqa: F401  (what custom_import = "plugin" gives the bundled config)
    from torchtitan.components.metrics import MetricsProcessor

    log, last = MetricsProcessor.log, [time.process_time()]

    def log_with_cpu_time(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        now = time.process_time()
        extra = {**(extra_metrics or {}), CPU_TAG: now - last[0]}
        last[0] = now
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra)

    # GRPOMetricsProcessor.log ends in super().log, so the GRPO jobs go through this too
    MetricsProcessor.log = log_with_cpu_time


def run(args) -> tuple[list[dict], dict]:
    """Every round of every variant; returns the CSV rows and each variant's per-round medians."""
    rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        tmp = Path(tmp)
        write_data(tmp, args.seq_len)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp / "hf_cache"), "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO / "benchmarks"), str(REPO), os.environ.get("PYTHONPATH"))))}
        for r in range(args.repeats):
            for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:  # rotated order
                start = time.perf_counter()
                result = run_variant(args, variant, tmp, tmp / f"{variant}_{r}", env)
                rounds[variant].append(result)
                print(f"round {r} {variant}: median step {statistics.median(result['times']):.3f} s, "
                      f"{statistics.median(result['cpu']):.3f} CPU s over "
                      f"{len(result['times'])} steps, job {time.perf_counter() - start:.0f} s", flush=True)
    rows = [dict(variant=v, flavor=args.flavor, batch=args.batch, seq_len=args.seq_len, tp=args.tp,
                 beta=args.beta if v == "grpo_beta" else (0.0 if v.startswith("grpo_beta0") else ""), repeats=args.repeats,
                 steps_timed=sum(len(x["times"]) for x in rounds[v])) for v in VARIANTS]
    medians = {}
    for key, suffix in (("times", ""), ("cpu", "_cpu")):
        medians[key] = {v: [statistics.median(x[key]) for x in rounds[v]] for v in VARIANTS}
        ratios = {v: [m / ce for m, ce in zip(medians[key][v], medians[key]["ce"])] for v in VARIANTS}
        # the targets: beta = 0 within 5% of CE; beta > 0 within one extra forward pass + 5%
        forward = statistics.median(ratios["forward"])
        targets = {"grpo_beta0": 1.05, "grpo_beta0_unfused": 1.05, "grpo_beta": 1 + forward + 0.05}
        for row in rows:
            v, ratio = row["variant"], statistics.median(ratios[row["variant"]])
            row.update({
                f"median_step{suffix}_s": round(statistics.median(t for x in rounds[v] for t in x[key]), 4),
                f"ratio_to_ce{suffix}": round(ratio, 3), f"ratio_min{suffix}": round(min(ratios[v]), 3),
                f"ratio_max{suffix}": round(max(ratios[v]), 3),
                f"round_medians{suffix}_s": " ".join(f"{m:.4f}" for m in medians[key][v]),
                f"target_ratio{suffix}": round(targets[v], 3) if v in targets else "",
                f"meets_target{suffix}": ratio <= targets[v] if v in targets else "",
            })
    for row in rows:
        ref = [t for x in rounds[row["variant"]] for t in x["ref"]]
        row["ref_pass_s"] = round(statistics.median(ref), 4) if ref else ""
    return rows, medians


def plot(rows: list[dict], medians: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["variant"] for r in rows]
    for ax, key, suffix, what in zip(axes, ("times", "cpu"), ("", "_cpu"), ("wall", "rank 0 CPU")):
        heights = [r[f"median_step{suffix}_s"] for r in rows]
        ax.bar(names, heights, color=["C0", "C1", "C4", "C2", "C7"], alpha=0.8)
        for i, (v, h) in enumerate(zip(names, heights)):  # each round's median: the spread the shared machine adds
            ax.plot([i] * len(medians[key][v]), medians[key][v], "k.", alpha=0.6)
            ax.annotate(f"{rows[i][f'ratio_to_ce{suffix}']}x CE", (i, h), textcoords="offset points", xytext=(0, 4),
                        ha="center", fontsize=8)
        for r in rows:
            if r[f"target_ratio{suffix}"]:
                ax.axhline(heights[0] * r[f"target_ratio{suffix}"], ls="--", lw=0.8,
                           color={"grpo_beta0": "C1", "grpo_beta0_unfused": "C4"}.get(r["variant"], "C2"),
                           label=f"{r['variant']} target: {r[f'target_ratio{suffix}']}x CE")
        ax.set_ylabel(f"median step time, {what} seconds")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    r = rows[0]
    fig.suptitle(f"llama3 {r['flavor']}, batch {r['batch']} x seq {r['seq_len']}, TP={r['tp']} on CPU, "
                 f"{r['repeats']} interleaved rounds; dots: each round's median", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        forward_worker(json.loads(args.worker))
        return
    rows, medians = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_md.write_csv(out / "step_time.csv", rows, COLUMNS, **TABLES["step_time"])
    plot(rows, medians, out / "step_time.png")
    print("| variant | median step s | ratio to CE (rounds' min-max) | target | met | median step CPU s "
          "| ratio to CE, CPU (min-max) | target, CPU | met, CPU | reference pass s |\n"
          "|---|---:|---:|---:|---|---:|---:|---:|---|---:|")
    for r in rows:
        cells = [r["variant"], r["median_step_s"], f"{r['ratio_to_ce']} ({r['ratio_min']}-{r['ratio_max']})",
                 r["target_ratio"], r["meets_target"], r["median_step_cpu_s"],
                 f"{r['ratio_to_ce_cpu']} ({r['ratio_min_cpu']}-{r['ratio_max_cpu']})", r["target_ratio_cpu"],
                 r["meets_target_cpu"], r["ref_pass_s"]]
        print("| " + " | ".join("-" if c == "" else str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
else:  # imported by torchtitan as the training jobs' custom_import (benchmarks/ is on their PYTHONPATH)
    install_step_clock()
