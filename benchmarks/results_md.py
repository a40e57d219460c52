"""A benchmark's CSV as a short Markdown table beside it (`<stem>.md`), the figures the docs include.

Each benchmark calls `write(csv_path)` right after it writes a CSV. `python benchmarks/results_md.py`
rewrites the tables of every CSV in benchmarks/results/ from the committed CSVs, running nothing;
`python docs/generate.py` does the same and then copies the tables into the docs pages that include them.

A table shows what `TABLES` picks for the CSV's name (the longest matching prefix): some columns, a
few rows, or a summary of the rows; a CSV without an entry is shown whole.
"""

import csv
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def pct(value: str) -> str:
    return f"{float(value):.1%}" if value else ""


def mib(gib: str) -> str:
    return f"{float(gib) * 1024:.1f}" if gib else ""


def share(ratio: str) -> str:
    return f"{float(ratio):.1%}" if ratio else ""


def logprob_memory(rows):
    # growth_vs_shard is a ratio; OOM and other failed rows have no figures
    return [{
        "variant": r["variant"], "pass": r["pass"], "status": r.get("status", "ok"), "T": r["seq"], "V": r["vocab"],
        "TP": r["tp"], "chunk": r["chunk"], "growth (MiB)": mib(r["growth_gib"]),
        "growth / logits shard": share(r["growth_vs_shard"]), "CPU s": f"{float(r['cpu_s']):.2f}" if r["cpu_s"] else "",
        "max abs diff vs gather": r["max_abs_diff_vs_gather"],
    } for r in rows]


def learning_signal(rows):
    before = [float(r["margin_before"]) for r in rows]
    after = [float(r["margin_after"]) for r in rows]
    return [
        {f"{len(rows)} held-out groups": "mean margin (nats)", "before": f"{statistics.mean(before):+.2f}",
         "after": f"{statistics.mean(after):+.2f}"},
        {f"{len(rows)} held-out groups": "median margin (nats)", "before": f"{statistics.median(before):+.2f}",
         "after": f"{statistics.median(after):+.2f}"},
        {f"{len(rows)} held-out groups": "groups whose margin rose", "before": "",
         "after": f"{sum(a > b for a, b in zip(after, before)) / len(rows):.0%}"},
    ]


def online_learning(rows):
    return [{"online step": r["step"], "greedy exact match": pct(r["heldout_greedy"]),
             "sampled (temperature 1)": pct(r["heldout_sampled"]), "prompts with mixed draws": pct(r["heldout_mixed"])}
            for r in rows if r["heldout_greedy"]]


def smollm2_learning(rows):
    return [{"step": r["step"], "transformers greedy, last number right": pct(r["transformers_accuracy"]),
             "the run's own greedy evaluation": pct(r["run_eval_accuracy"]),
             "bare-number replies": pct(r["transformers_bare_number"] or r["run_eval_bare_number"])}
            for r in rows if r["transformers_accuracy"] or r["run_eval_accuracy"]]


def over_seeds(figures: dict[str, str], points: bool, largest: tuple[str, str] | None = None):
    """Rows -> a line per seed with each figure's before, after and rise, then their mean ± sd over seeds and
    the smallest rise. `figures`: CSV key -> header; `points`: shares shown in %, rises in points;
    `largest`: (CSV key, header) of one more column, shown per seed and as its largest over seeds."""
    def show(v: float, rise: bool) -> str:
        return (f"{100 * v:+.1f} pt" if rise else f"{v:.1%}") if points else f"{v:+.2f}"

    def summary(rows):
        parts = [(f"{key}_{part}", f"{label} {part}", part == "rise")
                 for key, label in figures.items() for part in ("before", "after", "rise")]
        extra = [largest] if largest else []
        column = lambda key: [float(r[key]) for r in rows]  # noqa: E731
        out = [{"seed": r["seed"], **{h: show(float(r[k]), rise) for k, h, rise in parts},
                **{h: f"{float(r[k]):.2f}" for k, h in extra}} for r in rows]
        out.append({"seed": "mean ± sd", **{
            h: f"{show(statistics.mean(column(k)), rise)} ± {show(statistics.stdev(column(k)), rise).lstrip('+')}"
            for k, h, rise in parts}, **{h: "" for k, h in extra}})
        out.append({"seed": "smallest", **{h: show(min(column(k)), True) if rise else "" for k, h, rise in parts},
                    **{h: f"largest {max(column(k)):.2f}" for k, h in extra}})
        return out
    return summary


def memory_soak(rows, warmup=500):
    from memory_soak import summarize, typed  # this folder

    return [{"rank": s["rank"], "VmRSS at step 1 / 500 / last (MiB)":
             f"{s['rss_first']:.1f} / {s['rss_warm']:.1f} / {s['rss_last']:.1f} (step {s['last_step']})",
             "VmRSS slope from step 500 (MiB / 1,000 steps)": f"{s['rss_slope']:+.2f} ± {s['rss_se']:.2f}",
             "window-max slope": f"{s['win_max_slope']:+.2f} ± {s['win_max_se']:.2f}"}
            for s in summarize(typed(rows), warmup)]


def columns(*names):
    """Keep these columns, renamed where a pair (column, header) is given."""
    pairs = [n if isinstance(n, tuple) else (n, n) for n in names]
    return lambda rows: [{header: r.get(col, "") for col, header in pairs} for r in rows]


def padding_free(rows):
    from padding_free import table_rows  # benchmarks/padding_free.py: its summary over rounds

    return table_rows(rows)


def trl_parity(rows):
    from trl_parity import table_rows  # benchmarks/trl_parity.py: mean and spread over seeds

    return table_rows(rows)


def trl_parity_train(rows):
    from trl_parity import train_table_rows

    return train_table_rows(rows)


def trl_parity_replies(rows):
    from trl_parity import replies_table_rows

    return replies_table_rows(rows)


# CSV name prefix -> (the script that writes it, rows -> table rows; None: the CSV as it is)
TABLES = {
    "fused_precision": ("fused_precision.py", columns("path", ("dh_error", "dL/dh error"), ("dw_error", "dL/dW error"))),
    "generation_profile": ("generation_vs_transformers.py", columns(
        "batch", "new_tokens", "model_layers", "layers", "output", "sampling", "rest", "decode_cpu_s", "prefill_cpu_s")),
    "generation_speed": ("generation_speed.py", columns(
        "sampler", "new_tokens", ("tokens_per_s", "tok/s"), ("tokens_per_cpu_s", "tok/CPU-s"),
        ("speedup", "cached / oracle"), ("speedup_cpu", "cached / oracle (CPU)"), "same_tokens")),
    "generation_vs_transformers": ("generation_vs_transformers.py", columns(
        "workload", "engine", ("batch", "B"), "prompt_len", "group", "new_tokens", "cpu_s", "mean_length",
        ("tokens_per_cpu_s", "tok/CPU-s"), ("ours_vs_transformers", "ours / transformers"))),
    "learning_signal": ("learning_signal.py", learning_signal),
    "learning_signal_seeds": ("learning_signal.py --seeds", over_seeds(
        {"margin": "mean margin (nats)"}, points=False, largest=("kl_max", "largest grpo/kl"))),
    "logprob_memory": ("logprob_memory.py", logprob_memory),
    "memory_soak": ("memory_soak.py", memory_soak),
    "online_learning": ("learning_signal.py --online", online_learning),
    "online_learning_seeds": ("learning_signal.py --online --seeds", over_seeds(
        {"greedy": "greedy exact match", "sampled": "sampled"}, points=True)),
    "padding_free": ("padding_free.py", padding_free),
    "reference_offload": ("reference_offload.py", None),
    "rollout_scale": ("rollout_scale.py", columns(
        "content", "format", ("file_mb", "file (MB)"), "rows", ("index_s", "indexing pass (s)"),
        ("cpu_us_per_row", "CPU per row (µs)"), ("first_batch_s", "first batch (s)"), ("index_mb", "index (MB)"),
        ("peak_rss_growth_mb", "peak RSS growth (MB)"))),
    "smollm2_learning": ("smollm2_learning.py", smollm2_learning),
    "tool_learning": ("tool_learning.py", columns(
        "model", "step", "prompts", "mode", "replies", ("accuracy", "right"), ("call_rate", "calls"),
        ("right_call_rate", "right calls"), ("accuracy_without_call", "right without a call"),
        ("mean_model_tokens", "model tokens"), ("mean_tool_tokens", "tool tokens"), ("cpu_s", "CPU s"))),
    "trl_parity": ("trl_parity.py", trl_parity),
    "trl_parity_replies": ("trl_parity.py", trl_parity_replies),
    "trl_parity_train": ("trl_parity.py", trl_parity_train),
    "step_time": ("step_time.py", columns(
        "variant", ("median_step_cpu_s", "CPU s / step"), ("ratio_to_ce_cpu", "/ cross-entropy"),
        ("ratio_min_cpu", "min over rounds"), ("ratio_max_cpu", "max over rounds"), ("target_ratio_cpu", "target"),
        ("meets_target_cpu", "meets target"))),
}


def table(csv_path: Path) -> str:
    """The Markdown for one CSV: the picked rows and columns, then the file it came from."""
    csv_path = Path(csv_path)
    stem = csv_path.stem
    key = max((k for k in TABLES if stem.startswith(k)), key=len, default=None)
    script, pick = TABLES[key] if key else ("", None)
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    rows = pick(rows) if pick else rows
    if not rows:
        return f"`{csv_path.name}` holds no rows.\n"
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[h]) for h in header) + " |" for r in rows]
    source = f"`{csv_path.name}`" + (f", written by `benchmarks/{script}`" if script else "")
    return "\n".join(lines) + f"\n\nFrom {source}.\n"


def write_csv(csv_path: Path, rows: list[dict], columns) -> Path:
    """A benchmark's rows as `csv_path` (its folder made if need be), then its table beside it; returns the table's path."""
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return write(csv_path)


def write(csv_path: Path) -> Path:
    """Write `<stem>.md` beside the CSV; returns its path."""
    csv_path = Path(csv_path)
    md = csv_path.with_suffix(".md")
    md.write_text(table(csv_path))
    return md


def main(argv=None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or sorted(RESULTS.glob("*.csv"))
    for path in paths:
        print(f"wrote {write(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
