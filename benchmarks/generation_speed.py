"""Tokens per second of the KV-cached sampler against the full-forward oracle (plugin.generation.sampler).

The GRPO llama3 debugmodel, built as torchtitan's Trainer builds it on one CPU rank, samples a
batch of prompts with no stop id, so every sequence runs to the new-token budget. Each sampler
gets one warm-up call, then timed calls per budget (--repeats for the cached sampler,
--oracle-repeats for the oracle, whose long runs average over many steps); the figure is the median.

Simplifications:
1. One process, one thread (--threads), no parallelism, fp32, random weights (the speed does not
   depend on them). More threads than free cores make every small matmul wait on spinning
   OpenMP threads: on the shared 2-core machine, 2 threads ran the cached sampler 9x slower.
2. Tokens per second counts new tokens only: batch * new tokens / seconds of `generate`, prefill
   included, per wall second and per CPU second of the process; on a shared machine the CPU
   figure is the one to compare, the wall figure also follows the other jobs.
3. Both samplers draw with the same noise, so the table also says whether their tokens agree.

Usage: python benchmarks/generation_speed.py [--new-tokens 32,128,512] [--batch 8] [--prompt-len 16]
The defaults run for about 10 minutes on one core, nearly all of it the oracle at 512 new tokens.
Writes <out>/generation_speed.csv and .png (default benchmarks/results/) and prints a table.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import results_md
from harness import ONE_RANK, build_model  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("sampler", "threads", "batch", "prompt_len", "new_tokens", "time_s", "cpu_s", "tokens_per_s",
           "tokens_per_cpu_s", "speedup", "speedup_cpu", "same_tokens")
# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"generation_speed": dict(script="generation_speed.py", pick=results_md.columns(
    "sampler", "new_tokens", ("tokens_per_s", "tok/s"), ("tokens_per_cpu_s", "tok/CPU-s"),
    ("speedup", "cached / oracle"), ("speedup_cpu", "cached / oracle (CPU)"), "same_tokens"))}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="grpo_llama3", help="a GRPO TrainSpec: grpo_llama3 or grpo_qwen3")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--new-tokens", default="32,128,512", help="comma-separated budgets")
    p.add_argument("--batch", type=int, default=8, help="sequences per generate call")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed calls of the cached sampler per budget")
    p.add_argument("--oracle-repeats", type=int, default=1, help="timed calls of the oracle per budget")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return p.parse_args(argv)


def build(args, max_seq_len: int) -> torch.nn.Module:
    """The policy alone (no reference), as torchtitan's Trainer builds it, with a RoPE table of max_seq_len."""
    model, *_ = build_model("--model.name", args.model, "--model.flavor", args.flavor, "--training.seq_len",
                            str(max_seq_len), "--grpo.beta", "0", *ONE_RANK)
    return model


def measure(sampler, prompts, keys, repeats: int):
    """Median wall and CPU seconds of `repeats` generate calls, and the last call's samples."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        samples = sampler.generate(prompts, keys)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), samples


def run(args) -> list[dict]:
    from plugin.generation.engine import build_sampler

    torch.set_num_threads(args.threads)
    budgets = [int(n) for n in args.new_tokens.split(",")]
    needed = args.prompt_len + max(budgets) - 1  # the last new token is drawn from position needed - 1
    model = build(args, needed + needed % 2)  # torchtitan wants an even seq_len (its CP divisor)
    g = torch.Generator().manual_seed(0)
    vocab = model.model_args.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    keys = list(range(args.batch))
    rows = []
    for n in budgets:
        samples = {}
        for name, kv_cache in (("cached", True), ("oracle", False)):
            sampler = build_sampler(model, kv_cache=kv_cache, max_new_tokens=n, stop_ids=[], temperature=1.0, pad_id=0)
            sampler.generate(prompts[:1], keys[:1])  # warm-up
            repeats = args.repeats if kv_cache else args.oracle_repeats
            wall, cpu, samples[name] = measure(sampler, prompts, keys, repeats)
            assert all(len(c) == n for c in samples[name].completions)
            rows.append(dict(sampler=name, threads=args.threads, batch=args.batch, prompt_len=args.prompt_len,
                             new_tokens=n, time_s=round(wall, 3), cpu_s=round(cpu, 3),
                             tokens_per_s=round(args.batch * n / wall, 1),
                             tokens_per_cpu_s=round(args.batch * n / cpu, 1)))
            print(rows[-1], flush=True)
        cached, oracle = rows[-2], rows[-1]
        cached["speedup"] = round(cached["tokens_per_s"] / oracle["tokens_per_s"], 2)
        cached["speedup_cpu"] = round(cached["tokens_per_cpu_s"] / oracle["tokens_per_cpu_s"], 2)
        oracle["speedup"] = oracle["speedup_cpu"] = 1.0
        same = samples["cached"].completions == samples["oracle"].completions
        cached["same_tokens"] = oracle["same_tokens"] = same
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, marker in (("cached", "o"), ("oracle", "s")):
        rs = [r for r in rows if r["sampler"] == name]
        label = {"cached": "KVCacheSampler", "oracle": "NoCacheSampler (oracle)"}[name]
        line = ax.plot([r["new_tokens"] for r in rs], [r["tokens_per_cpu_s"] for r in rs], f"{marker}-",
                       label=f"{label}, per CPU second")[0]
        ax.plot([r["new_tokens"] for r in rs], [r["tokens_per_s"] for r in rs], f"{marker}:", color=line.get_color(),
                alpha=0.5, label=f"{label}, per wall second")
    for r in rows:
        if r["sampler"] == "cached":
            ax.annotate(f"{r['speedup_cpu']}x", (r["new_tokens"], r["tokens_per_cpu_s"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new tokens per sequence")
    ax.set_ylabel("new tokens / s")
    ax.set_title(f"llama3 debugmodel, batch {rows[0]['batch']}, prompts of {rows[0]['prompt_len']}, "
                 f"1 CPU rank, {rows[0]['threads']} thread(s)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_md.write_csv(out / "generation_speed.csv", rows, COLUMNS, **TABLES["generation_speed"])
    plot(rows, out / "generation_speed.png")
    print("| new tokens | cached tok/s | oracle tok/s | cached / oracle | cached tok/CPU-s | oracle tok/CPU-s "
          "| cached / oracle (CPU) | same tokens |\n|---:|---:|---:|---:|---:|---:|---:|---|")
    for cached, oracle in zip(rows[::2], rows[1::2]):
        print(f"| {cached['new_tokens']} | {cached['tokens_per_s']} | {oracle['tokens_per_s']} | {cached['speedup']}x | "
              f"{cached['tokens_per_cpu_s']} | {oracle['tokens_per_cpu_s']} | {cached['speedup_cpu']}x | "
              f"{cached['same_tokens']} |")


if __name__ == "__main__":
    main()
