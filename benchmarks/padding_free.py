"""Padding-free against padded training: one GRPO step (policy and reference passes, forward and backward) on the same
sequences, laid out as torchtitan pads them ([B, seq_len]) and as one row of real tokens ([grpo] padding_free).

Shapes:
    debug_tp2   llama3 debugmodel, TP=2 (2 gloo ranks), seq_len 1,088, B = 8 sequences
    smollm2     SmolLM2-135M's shape (smollm2_135m flavor: width, heads, vocabulary 49,152) cut to --smollm2-layers
                layers, 1 rank, seq_len 1,088, B = 8
Length spreads (prompt 64 tokens, the rest completion):
    long_tail   the quantiles of a log-normal whose median is a fifth of seq_len (sigma 0.86), as reasoning
                completions spread: 29% of the padded tokens are real
    full        every sequence seq_len long: 100% real, where padding-free can only cost

Simplifications:
1. Random weights and tokens, fp32, eager, the bundled config's [grpo] settings (beta 0.04, the fused
   policy pass); no optimizer step (its cost does not depend on the layout).
2. Each measurement is a fresh process (peak RSS starts clean): the model is built as torchtitan's
   Trainer builds it, one warm-up step, then --steps timed steps; the step time is the median.
   Real tokens per second = the B sequences' tokens / step time. Peak memory is the process's peak
   RSS growth over the steps (rank 0), as the trainer's memory metrics report it on CPU.
3. A shared CPU is noisy: layouts run interleaved, --repeats rounds in alternating order, and each
   ratio (padding-free over padded) is taken within a round; the table gives the median over rounds.

Usage: python benchmarks/padding_free.py [--repeats 3] [--steps 2] [--shapes debug_tp2,smollm2]
Writes <out>/padding_free.csv, .png and .md (default benchmarks/results/) and prints the table.
"""

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO

SEQ_LEN, BATCH, PROMPT = 1088, 8, 64
SHAPES = {
    "debug_tp2": dict(tp=2, overrides=[]),
    "smollm2": dict(tp=1, overrides=["--model.flavor", "smollm2_135m"]),
}
SPREADS = ("long_tail", "full")
COLUMNS = ("shape", "spread", "layout", "real_fraction", "round", "step_s", "real_tokens_per_s", "peak_rss_growth_gib")


def lengths(spread: str) -> list[int]:
    """B sequence lengths (input tokens) for a spread."""
    if spread == "full":
        return [SEQ_LEN] * BATCH
    z = [statistics.NormalDist().inv_cdf((i + 0.5) / BATCH) for i in range(BATCH)]
    return [min(SEQ_LEN, max(PROMPT + 8, round(SEQ_LEN / 5 * math.exp(0.86 * x)))) for x in z]


def worker(spec: dict) -> None:
    """One layout's steps on this rank (torchrun sets the rank); rank 0 prints its figures as JSON."""
    import torch
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    from harness import Memory, build_model
    from plugin.data.batch import Collate
    from plugin.data.rollouts import Completion
    from plugin.scoring.loss import build_grpo_loss

    torch.set_num_threads(spec["threads"])
    tp = spec["tp"]
    if tp > 1:
        dist.init_process_group("gloo")
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=tp)
    flag = "--grpo.padding_free" if spec["layout"] == "padding_free" else "--grpo.no_padding_free"
    model, cfg, *_ = build_model("--parallelism.tensor_parallel_degree", str(tp), "--training.seq_len", str(SEQ_LEN),
                                 flag, *spec["overrides"], parallel_dims=pd, n_layers=spec.get("n_layers"))
    loss_fn = build_grpo_loss(cfg)
    g = torch.Generator().manual_seed(0)
    vocab = model.model_args.vocab_size
    batch = [Completion(torch.randint(3, vocab, (n + 1,), generator=g).tolist(), PROMPT, float(i % 2))
             for i, n in enumerate(spec["lengths"])]
    rewards = torch.tensor([c.reward for c in batch])
    inputs, labels = Collate(SEQ_LEN, 0, cfg.grpo, 2, pack_multiple=tp)(
        rewards, torch.tensor([len(c.tokens) - PROMPT for c in batch]), list(range(len(batch))), batch)
    kwargs = {k: v for k, v in inputs.items() if k != "input"}
    tokens = int((labels != -100).sum())

    def step():
        # as torchtitan's train_context under TP: backward too inside loss_parallel
        from contextlib import nullcontext

        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel() if tp > 1 else nullcontext():
            pred = model(inputs["input"], **kwargs)
            (loss_fn(pred, labels) / tokens).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: the reference's first load, allocator growth
    memory = Memory(torch.device("cpu"))
    base = memory.reset()
    times = []
    for _ in range(spec["steps"]):
        if tp > 1:
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT " + json.dumps({"step_s": statistics.median(times), "peak_rss_growth_gib": (memory.peak() - base) / 2**30,
                                      "input_numel": inputs["input"].numel()}), flush=True)
    if tp > 1:
        dist.destroy_process_group()


def measure(args, shape: str, spread: str, layout: str) -> dict:
    s = SHAPES[shape]
    spec = dict(layout=layout, tp=s["tp"], overrides=s["overrides"], lengths=lengths(spread), steps=args.steps,
                threads=max(1, 2 // s["tp"]), n_layers=args.smollm2_layers if shape == "smollm2" else None)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "PYTHONPATH": f"{REPO / 'benchmarks'}:{REPO}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(s["tp"]), "--master_port",
           str(29700 + os.getpid() % 200)] if s["tp"] > 1 else [sys.executable]
    out = subprocess.run([*cmd, str(Path(__file__).resolve()), "--worker", json.dumps(spec)], env=env, cwd=REPO,
                         capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{shape} {spread} {layout} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def run(args) -> list[dict]:
    rows = []
    for shape in args.shapes.split(","):
        for spread in SPREADS:
            lens = lengths(spread)
            real = sum(lens) / (BATCH * SEQ_LEN)
            for r in range(args.repeats):
                order = ("padded", "padding_free") if r % 2 == 0 else ("padding_free", "padded")
                for layout in order:
                    m = measure(args, shape, spread, layout)
                    rows.append(dict(shape=shape, spread=spread, layout=layout, real_fraction=round(real, 4), round=r,
                                     step_s=round(m["step_s"], 4), real_tokens_per_s=round(sum(lens) / m["step_s"], 1),
                                     peak_rss_growth_gib=round(m["peak_rss_growth_gib"], 4)))
                    print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per shape and spread: padding-free over padded, within each round, the median over rounds."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for spread in SPREADS:
            sel = [r for r in rows if r["shape"] == shape and r["spread"] == spread]
            if not sel:
                continue
            rounds = sorted({r["round"] for r in sel})
            pick = lambda layout, rnd: next(r for r in sel if r["layout"] == layout and r["round"] == rnd)  # noqa: E731
            speedups = [pick("padded", k)["step_s"] / pick("padding_free", k)["step_s"] for k in rounds]
            mem = [pick("padding_free", k)["peak_rss_growth_gib"] / max(pick("padded", k)["peak_rss_growth_gib"], 1e-9)
                   for k in rounds]
            out.append(dict(shape=shape, spread=spread, real_fraction=sel[0]["real_fraction"],
                            padded_step_s=statistics.median(pick("padded", k)["step_s"] for k in rounds),
                            padding_free_step_s=statistics.median(pick("padding_free", k)["step_s"] for k in rounds),
                            real_tps_ratio=round(statistics.median(speedups), 3),
                            ratio_range=f"{min(speedups):.2f}-{max(speedups):.2f}",
                            peak_memory_ratio=round(statistics.median(mem), 3)))
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| shape | spread | real tokens | padded step (s) | padding-free step (s) | real tokens/s, padding-free / padded "
             "(range) | peak memory, padding-free / padded |", "|---|---|---:|---:|---:|---:|---:|"]
    for t in table:
        lines.append(f"| {t['shape']} | {t['spread']} | {100 * t['real_fraction']:.0f}% | {t['padded_step_s']:.2f} | "
                     f"{t['padding_free_step_s']:.2f} | {t['real_tps_ratio']:.2f}x ({t['ratio_range']}) | "
                     f"{t['peak_memory_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{t['shape']}\n{t['spread']} ({100 * t['real_fraction']:.0f}% real)" for t in table]
    ax.bar(labels, [t["real_tps_ratio"] for t in table], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(2.0, color="tab:green", lw=0.8, ls="--", label="goal at 29% real: 2x")
    ax.set_ylabel("real tokens/s, padding-free / padded")
    ax.set_title(f"GRPO step (policy + reference, fwd + bwd), seq_len {SEQ_LEN}, B = {BATCH}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--shapes", default="debug_tp2,smollm2")
    p.add_argument("--smollm2-layers", type=int, default=4, help="SmolLM2's 30 layers cut to this many")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    rows = run(args)
    table = summary(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "padding_free.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    md = markdown(table)
    (out / "padding_free.md").write_text(
        "Written by `python benchmarks/padding_free.py` (its docstring says what is measured); per-round rows in "
        "padding_free.csv.\n\n" + md)
    plot(table, out / "padding_free.png")
    print(md)


if __name__ == "__main__":
    main()
