"""Start-up time and peak memory of the rollout loader against rollout file size.

For each format and size, a synthetic rollout file (flat rows, groups of 8, ~1 KB per row of
English-like text) is written once to --dir, then a fresh process indexes it with the bundled
tokenizer and cuts the first global batch. Per run: the indexing pass's time (every row parsed,
checked and tokenized), the time to the first batch, the index's size, and the process's peak
RSS growth over its RSS after imports (plugin.cpu.peak_rss_bytes, VmHWM reset after imports).

Simplifications:
1. One process, one core for the pass; a training job runs it on every rank at start-up.
2. The page cache is not dropped between runs (it is not RSS); CPU time per row is the steady figure.
3. A batch is 64 groups of 8 (512 completions) read by one rank; 10 batches follow the pass.

Usage: python benchmarks/rollout_scale.py [--sizes-mb 10,100,1000] [--formats jsonl,parquet]
           [--contents text,ids] [--dir /tmp/rollout_scale]
The defaults write 6 GB of files and run for about half an hour on one core (tokenizing 2 GB of text).
Writes benchmarks/results/rollout_scale.csv and .png and prints a table.
"""

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import results_md  # benchmarks/, the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GROUP_SIZE = 8
SEQ_LEN = 512
BATCHES = 10  # batches cut after the pass; the peak RSS covers them too
MiB = 2**20
# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"rollout_scale": dict(script="rollout_scale.py", pick=results_md.columns(
    "content", "format", ("file_mb", "file (MB)"), "rows", ("index_s", "indexing pass (s)"),
    ("cpu_us_per_row", "CPU per row (µs)"), ("first_batch_s", "first batch (s)"), ("index_mb", "index (MB)"),
    ("peak_rss_growth_mb", "peak RSS growth (MB)")))}


def synthetic_rows(seed: int, content: str):
    """Endless flat rollout rows, groups of 8: text (~150 words a completion) or token ids (~200 a completion)."""
    sys.path.append(str(REPO / "data"))  # the bundled example's word list, in the script that writes data/
    from example_data import _WORDS

    rng = random.Random(seed)
    group = 0
    while True:
        if content == "text":
            prompt = {"prompt": f"Q: {rng.randint(0, 99)}+{rng.randint(0, 99)}= Explain " + " ".join(rng.choices(_WORDS, k=12))}
        else:
            prompt = {"prompt_ids": [0] + [rng.randrange(3, 2048) for _ in range(20)]}
        for k in range(GROUP_SIZE):
            if content == "text":
                completion = {"completion": " " + " ".join(rng.choices(_WORDS, k=rng.randint(120, 180))) + ".\n"}
            else:
                completion = {"completion_ids": [rng.randrange(3, 2048) for _ in range(rng.randint(160, 240))] + [1]}
            yield {**prompt, **completion, "reward": float(k % 2), "group": group}
        group += 1


def write_file(path: Path, size_mb: int, content: str) -> None:
    """Whole groups of rows until the file reaches size_mb; written in chunks, never held whole."""
    target, rows = size_mb * MiB, synthetic_rows(size_mb, content)
    tmp = path.with_suffix(path.suffix + ".tmp")
    if path.suffix == ".jsonl":
        with open(tmp, "w") as f:
            while f.tell() < target:
                f.write("".join(json.dumps(next(rows)) + "\n" for _ in range(GROUP_SIZE * 64)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        while writer is None or os.path.getsize(tmp) < target:
            table = pa.Table.from_pylist([next(rows) for _ in range(GROUP_SIZE * 512)])
            writer = writer or pq.ParquetWriter(tmp, table.schema, compression="none")
            # small row groups (4096 rows): a batch decodes each row group it touches (docs/rollouts.md)
            writer.write_table(table, row_group_size=GROUP_SIZE * 512)
        writer.close()
    tmp.rename(path)


def measure(path: str) -> dict:
    """Index `path` and cut the first batch in this process; runs in a fresh process per file."""
    import numpy as np

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from plugin import cpu
    from plugin.config import GRPO
    from plugin.data.batch import BatchPlan, Collate
    from plugin.data.loader import RolloutDataset
    from plugin.data.rollouts import Encoder, index_rollouts

    tokenizer = HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))
    base = cpu.current_rss_bytes()
    cpu.reset_peak_rss()
    start, cpu_start = time.perf_counter(), time.process_time()
    index = index_rollouts(path, Encoder(tokenizer, 2048, SEQ_LEN))
    indexed, index_cpu = time.perf_counter(), time.process_time() - cpu_start
    plan = BatchPlan(group_size=GROUP_SIZE, groups_per_microbatch=64, grad_accum=1, dp_rank=0, dp_world_size=1)
    batches = iter(RolloutDataset(index, plan, Collate(SEQ_LEN, 1, GRPO(), GROUP_SIZE), seed=0))
    inputs, _ = next(batches)
    first = time.perf_counter()
    assert inputs["input"].shape == (64 * GROUP_SIZE, SEQ_LEN)
    for _ in range(BATCHES - 1):  # reading on must not accumulate memory either
        next(batches)
    return {
        "rows": index.rows, "groups": index.num_groups, "index_s": indexed - start, "index_cpu_s": index_cpu,
        "first_batch_s": first - indexed, "batch_s": (time.perf_counter() - first) / (BATCHES - 1),
        "index_bytes": index.nbytes, "rss_after_imports": base, "peak_rss_growth": cpu.peak_rss_bytes() - base,
        "mean_completion_tokens": float(np.mean(index.lengths)),
    }


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(f"{r['content']} {r['format']}" for r in results):
        rs = [r for r in results if f"{r['content']} {r['format']}" == name]
        size = [r["file_mb"] for r in rs]
        # CPU time: the wall time of a shared machine also follows its other load
        cpu_s = [float(r["cpu_us_per_row"]) * int(r["rows"]) / 1e6 for r in rs]
        line = ax_t.plot(size, cpu_s, "o-", label=f"{name}: indexing pass (CPU)")[0]
        ax_t.plot(size, [r["first_batch_s"] for r in rs], "s--", color=line.get_color(), label=f"{name}: first batch")
        line = ax_m.plot(size, [r["peak_rss_growth_mb"] for r in rs], "o-", label=f"{name}: peak RSS growth")[0]
        ax_m.plot(size, [r["index_mb"] for r in rs], "s--", color=line.get_color(), label=f"{name}: index size")
    sizes = sorted({r["file_mb"] for r in results})
    ax_m.plot(sizes, sizes, ":", color="gray", label="file size")
    for ax, ylabel in ((ax_t, "seconds"), (ax_m, "MiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rollout file size (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left" if ax is ax_t else "lower right")
    ax_t.set_title("start-up: one pass, linear in the file")
    ax_m.set_title("memory: the index, not the file")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="10,100,1000")
    parser.add_argument("--formats", default="jsonl,parquet")
    parser.add_argument("--contents", default="text,ids", help="text rows and/or token-id (pre-tokenized) rows")
    parser.add_argument("--dir", default="/tmp/rollout_scale")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for content, fmt in ((c, f) for c in args.contents.split(",") for f in args.formats.split(",")):
        for size_mb in map(int, args.sizes_mb.split(",")):
            path = folder / f"rollouts_{content}_{size_mb}mb.{fmt}"
            if not path.exists():
                write_file(path, size_mb, content)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            proc = subprocess.run([sys.executable, __file__, "--measure", str(path)], env=env, capture_output=True,
                                  text=True, check=True)
            m = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append({
                "content": content, "format": fmt, "file_mb": round(path.stat().st_size / MiB, 1), "rows": m["rows"], "groups": m["groups"],
                "index_s": round(m["index_s"], 2), "cpu_us_per_row": round(m["index_cpu_s"] / m["rows"] * 1e6, 1),
                "first_batch_s": round(m["first_batch_s"], 3), "batch_s": round(m["batch_s"], 3),
                "index_mb": round(m["index_bytes"] / MiB, 2),
                "peak_rss_growth_mb": round(m["peak_rss_growth"] / MiB, 1),
                "rss_after_imports_mb": round(m["rss_after_imports"] / MiB, 1),
            })
            print(results[-1], flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "rollout_scale.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    results_md.write(RESULTS / "rollout_scale.csv", **TABLES["rollout_scale"])
    plot(results, RESULTS / "rollout_scale.png")
    cols = list(results[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
