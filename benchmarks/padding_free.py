"""Padding-free against padded training: one GRPO step (policy and reference passes, forward and backward) on the same
sequences, laid out as torchtitan pads them ([B, seq_len]) and as one row of real tokens ([grpo] padding_free).

Shapes:
    debug_tp2   llama3 debugmodel, TP=2 (2 gloo ranks), seq_len 1,088, B = 8 sequences
    smollm2     SmolLM2-135M's shape (smollm2_135m flavor: width, heads, vocabulary 49,152) cut to --smollm2-layers
                layers, 1 rank, seq_len 1,088, B = 8
Length spreads (prompt 64 tokens, the rest completion):
    long_tail   the quantiles of a log-normal whose median is a fifth of seq_len (sigma 0.95), as reasoning
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

Then, with --online-steps N > 0, the SmolLM2 online example (train_configs/smollm2_online_cpu.toml, which needs
the converted folder outputs/smollm2_135m, docs/real_models.md) for N steps with padding-free training on and off,
interleaved the same way, evaluation off: torchtitan's time_metrics/end_to_end(s) (generation included) and
the trainer's grpo/real_token_fraction, medians over the steps after the first.

--check DEVICE (gpu_oneshot.py's padding-free part) instead compares the two layouts on one device, 1 rank, the
debug model at seq_len 1,088 on the long-tail spread, in fp32 and under bf16 autocast (on CUDA the varlen
flash kernel): log-probs, loss, grad norm and step time, printed as a Markdown section.

Usage: python benchmarks/padding_free.py [--repeats 3] [--steps 2] [--shapes debug_tp2,smollm2] [--online-steps 8]
Writes <out>/padding_free.csv, .png and .md (default benchmarks/results/) and prints the table.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results_md
from harness import REPO
from job_status import read_scalars, run_job

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
    return [min(SEQ_LEN, max(PROMPT + 8, round(SEQ_LEN / 5 * math.exp(0.95 * x)))) for x in z]


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


def check(device: str) -> None:
    """Padded against padding-free on one device: agreement and step time, as a Markdown section on stdout."""
    import torch

    from harness import build_model
    from plugin.data.batch import Collate
    from plugin.data.rollouts import Completion
    from plugin.scoring.loss import build_grpo_loss

    lens = lengths("long_tail")
    g = torch.Generator().manual_seed(0)
    batch = [Completion(torch.randint(3, 2048, (n + 1,), generator=g).tolist(), PROMPT, float(i % 2))
             for i, n in enumerate(lens)]
    lines = [f"### Padding-free against padded, {device}: debugmodel, 1 rank, seq_len {SEQ_LEN}, B = {BATCH}, "
             f"{sum(lens) / (BATCH * SEQ_LEN):.0%} real tokens", "",
             "| compute | max abs log-prob diff | loss rel diff | grad norm rel diff | padded step (s) | padding-free step (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for compute in ("fp32", "bf16 autocast"):
        out = {}
        for layout in ("padded", "padding_free"):
            flag = "--grpo.padding_free" if layout == "padding_free" else "--grpo.no_padding_free"
            model, cfg, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--training.seq_len", str(SEQ_LEN),
                                         flag, device=device)
            loss_fn = build_grpo_loss(cfg)
            inputs, labels = Collate(SEQ_LEN, 0, cfg.grpo, 2)(
                torch.tensor([c.reward for c in batch]), torch.tensor([len(c.tokens) - PROMPT for c in batch]),
                list(range(BATCH)), batch)
            kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items() if k != "input"}
            tokens, labels = inputs["input"].to(device), labels.to(device)
            amp = torch.autocast(device, dtype=torch.bfloat16, enabled=compute != "fp32")
            times = []
            for i in range(4):
                model.zero_grad(set_to_none=True)
                sync()
                start = time.perf_counter()
                with amp:
                    pred = model(tokens, **kwargs)
                    loss = loss_fn(pred, labels) / int((labels != -100).sum())
                loss.backward()
                sync()
                times.append(time.perf_counter() - start)
            padded_pred, padded_labels = pred.padded(labels)
            mask = padded_labels != -100
            norm = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5
            out[layout] = (padded_pred.logprobs.detach()[mask].float().cpu(), float(loss), norm,
                           statistics.median(times[1:]))
            del model, pred
        (lp_a, loss_a, norm_a, t_a), (lp_b, loss_b, norm_b, t_b) = out["padded"], out["padding_free"]
        lines.append(f"| {compute} | {float((lp_a - lp_b).abs().max()):.2e} | {abs(loss_b - loss_a) / abs(loss_a):.2e} | "
                     f"{abs(norm_b - norm_a) / norm_a:.2e} | {t_a:.3f} | {t_b:.3f} |")
    print("\n".join(lines), flush=True)


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


def online_example(args) -> list[dict]:
    """The SmolLM2 online example's step with padding-free training on and off, interleaved over rounds."""
    import tempfile

    rows = []
    for r in range(args.repeats):
        for layout in ("padded", "padding_free") if r % 2 == 0 else ("padding_free", "padded"):
            dump = Path(tempfile.mkdtemp(prefix=f"pf_online_{layout}_"))
            flag = "--grpo.padding_free" if layout == "padding_free" else "--grpo.no_padding_free"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "torchtitan.train",
                   "--job.config_file", "train_configs/smollm2_online_cpu.toml", "--job.dump_folder", str(dump),
                   "--training.steps", str(args.online_steps), "--validation.no_enable", flag]
            code, out = run_job(cmd, env={**os.environ, "OMP_NUM_THREADS": "2"}, cwd=REPO)
            if code != 0:
                raise RuntimeError(f"the SmolLM2 online example failed ({layout}):\n{out[-3000:]}")
            steps = read_scalars(dump)
            timed = [steps[k] for k in sorted(steps) if k > 1]
            rows.append(dict(shape="smollm2_online_example", spread="online", layout=layout, round=r,
                             real_fraction=round(statistics.median(x["grpo/real_token_fraction"] for x in timed), 4),
                             step_s=round(statistics.median(x["time_metrics/end_to_end(s)"] for x in timed), 4),
                             real_tokens_per_s="", peak_rss_growth_gib=""))
            print(rows[-1], flush=True)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per shape and spread: padding-free over padded, within each round, the median over rounds (rows as written to,
    or read from, the CSV)."""
    num = lambda v: float(v) if v not in ("", None) else math.nan  # noqa: E731
    rows = [{**r, **{k: num(r[k]) for k in ("real_fraction", "step_s", "peak_rss_growth_gib")}, "round": int(r["round"])}
            for r in rows]
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for spread in (*SPREADS, "online"):
            sel = [r for r in rows if r["shape"] == shape and r["spread"] == spread]
            if not sel:
                continue
            rounds = sorted({r["round"] for r in sel})
            pick = lambda layout, rnd: next(r for r in sel if r["layout"] == layout and r["round"] == rnd)  # noqa: E731
            speedups = [pick("padded", k)["step_s"] / pick("padding_free", k)["step_s"] for k in rounds]
            mem = [pick("padding_free", k)["peak_rss_growth_gib"] / max(pick("padded", k)["peak_rss_growth_gib"], 1e-9)
                   for k in rounds if spread != "online"]
            # the share of the padded layout's tokens that are real
            out.append(dict(shape=shape, spread=spread, real_fraction=pick("padded", rounds[0])["real_fraction"],
                            padded_step_s=statistics.median(pick("padded", k)["step_s"] for k in rounds),
                            padding_free_step_s=statistics.median(pick("padding_free", k)["step_s"] for k in rounds),
                            real_tps_ratio=round(statistics.median(speedups), 3),
                            ratio_range=f"{min(speedups):.2f}-{max(speedups):.2f}",
                            peak_memory_ratio=round(statistics.median(mem), 3) if mem else math.nan))
    return out


def table_rows(rows: list[dict]) -> list[dict]:
    """The Markdown table's rows: per shape and spread, the medians over rounds."""
    out = []
    for t in summary(rows):
        online = t["spread"] == "online"  # the whole step, generation included
        out.append({"shape": t["shape"], "spread": "online step" if online else t["spread"],
                    "real tokens (padded layout)": f"{t['real_fraction']:.0%}",
                    "padded step (s)": f"{t['padded_step_s']:.2f}", "padding-free step (s)": f"{t['padding_free_step_s']:.2f}",
                    "speed-up: real tokens/s, padding-free / padded": f"{t['real_tps_ratio']:.2f}x",
                    "range over rounds": t["ratio_range"],
                    "peak memory, padding-free / padded": "-" if online else f"{t['peak_memory_ratio']:.2f}"})
    return out


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"padding_free": dict(script="padding_free.py", pick=table_rows)}


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{t['shape']}\n{t['spread']} ({100 * t['real_fraction']:.0f}% real)" for t in table]
    ax.bar(labels, [t["real_tps_ratio"] for t in table], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(2.0, color="tab:green", lw=0.8, ls="--", label="goal at 29% real: 2x")
    ax.set_ylabel("real tokens/s, padding-free / padded")
    ax.set_title(f"GRPO step (policy + reference, fwd + bwd), seq_len {SEQ_LEN}, B = {BATCH}\n"
                 "(the online example: its own config, whole steps)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--check", metavar="DEVICE", help="compare the layouts on DEVICE (cpu, cuda) and print a section")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--shapes", default="debug_tp2,smollm2")
    p.add_argument("--smollm2-layers", type=int, default=4, help="SmolLM2's 30 layers cut to this many")
    p.add_argument("--online-steps", type=int, default=0, help="steps of the SmolLM2 online example each way; 0: skip")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.check:
        return check(args.check)
    rows = run(args) if args.shapes else []
    if args.online_steps:
        rows += online_example(args)
    out = Path(args.out)
    md = results_md.write_csv(out / "padding_free.csv", rows, COLUMNS, **TABLES["padding_free"])
    plot(summary(rows), out / "padding_free.png")
    print(md.read_text())


if __name__ == "__main__":
    main()
