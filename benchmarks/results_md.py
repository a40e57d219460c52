"""A benchmark's CSV as a short Markdown table beside it (`<stem>.md`), the figures the docs include.

This module formats and knows no benchmark. Each benchmark keeps its tables in its own `TABLES`,
CSV name prefix -> `dict(script=..., pick=...)`: `pick` turns the CSV's rows into the table's (some
columns, a few rows, a summary; None: the CSV as it is), `script` is the command named under the
table. A benchmark calls `write(csv_path, **TABLES[prefix])` right after it writes a CSV, or
`write_csv(...)` to write both; `python docs/generate.py` rebuilds every table from the committed
CSVs through the same `TABLES`.
"""

import csv
import statistics
from pathlib import Path


def pct(value: str) -> str:
    return f"{float(value):.1%}" if value else ""


def mib(gib: str) -> str:
    return f"{float(gib) * 1024:.1f}" if gib else ""


def share(ratio: str) -> str:
    return f"{float(ratio):.1%}" if ratio else ""


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


def columns(*names):
    """Keep these columns, renamed where a pair (column, header) is given."""
    pairs = [n if isinstance(n, tuple) else (n, n) for n in names]
    return lambda rows: [{header: r.get(col, "") for col, header in pairs} for r in rows]


def table(csv_path: Path, pick=None, script: str = "") -> str:
    """The Markdown for one CSV: the rows `pick` makes of it, then the file it came from."""
    csv_path = Path(csv_path)
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


def write_csv(csv_path: Path, rows: list[dict], columns, pick=None, script: str = "") -> Path:
    """A benchmark's rows as `csv_path` (its folder made if need be), then its table beside it; returns the table's path."""
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return write(csv_path, pick, script)


def write(csv_path: Path, pick=None, script: str = "") -> Path:
    """Write `<stem>.md` beside the CSV; returns its path."""
    csv_path = Path(csv_path)
    md = csv_path.with_suffix(".md")
    md.write_text(table(csv_path, pick, script))
    return md
