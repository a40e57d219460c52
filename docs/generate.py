"""Regenerates the parts of the docs that come from the code and the benchmarks' results:

  docs/reference.md         every TOML key of plugin.config: type, default, allowed values, docstring
  benchmarks/results/*.md   each results CSV as a short table: benchmarks/results_md.py formats it as
                            the benchmark that wrote the CSV says in its `TABLES` (no benchmark runs)
  include blocks            in README.md, benchmarks/README.md and docs/*.md, the lines between
                            `<!-- include: PATH -->` and `<!-- end include -->` become PATH's text

    python docs/generate.py          # writes them
    python docs/generate.py --check  # writes nothing; exits 1 naming what is out of date

tests/test_docs.py runs the same check. The key reference reads plugin/config.py twice: the
dataclasses for the sections, types and defaults, and its source (`ast`) for what Python does not
keep at run time, the string under each field and the `_check(...)` constraints in `__post_init__`.
"""

import argparse
import ast
import dataclasses
import importlib
import re
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import results_md  # noqa: E402  benchmarks/

RESULTS = REPO / "benchmarks" / "results"
# CSV name prefix (the longest matching wins) -> the benchmark that writes it; its `TABLES` say how it is shown
OWNERS = {
    "fused_precision": "fused_precision", "generation_profile": "generation_vs_transformers",
    "generation_speed": "generation_speed", "generation_vs_transformers": "generation_vs_transformers",
    "learning_signal": "learning_signal", "logprob_memory": "logprob_memory", "memory_soak": "memory_soak",
    "memcheck_sampler": "memcheck_sampler",
    "online_learning": "learning_signal", "padding_free": "padding_free", "reference_offload": "reference_offload", "repeat_test": "repeat_test",
    "rollout_scale": "rollout_scale", "smollm2_learning": "smollm2_learning", "step_time": "step_time",
    "reward_model": "train_reward_model", "reward_model_speed": "reward_model_speed", "rm_learning": "trl_parity",
    "tool_learning": "tool_learning", "trl_parity": "trl_parity", "moe": "moe",
    "vllm_learning": "trl_parity", "vllm_rollouts": "vllm_rollouts", "vllm_sync": "vllm_sync",
    "async_rollouts": "async_rollouts", "async_learning": "trl_parity",
}
REFERENCE = REPO / "docs" / "reference.md"
CONFIG_SOURCE = REPO / "plugin" / "config.py"
INCLUDE = re.compile(r"(<!-- include: (\S+) -->\n)(.*?)(<!-- end include -->)", re.S)
# the page that explains each section; a section without one is listed all the same
GUIDES = {"grpo": "loss.md", "reference_model": "loss.md#the-reference-model", "rollout_data": "rollouts.md",
          "online": "online.md"}


@dataclasses.dataclass
class Key:
    section: str
    name: str
    kind: str  # the annotation as written
    default: object
    doc: str  # "" when the field has no docstring
    checks: list[str]  # what `_check` says the value must be


def _source_facts() -> dict[str, tuple[dict[str, str], dict[str, list[str]]]]:
    """Per class in plugin/config.py: {field: docstring} and {field: [constraint, ...]}."""
    facts = {}
    for node in ast.parse(CONFIG_SOURCE.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs, checks = {}, {}
        for stmt, nxt in zip(node.body, node.body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                is_doc = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                          and isinstance(nxt.value.value, str))
                docs[stmt.target.id] = " ".join(nxt.value.value.split()) if is_doc else ""
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__post_init__":
                for call in ast.walk(stmt):
                    # _check(section, key, value, ok, what): only a key and a `what` written as plain strings
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "_check"
                            and len(call.args) == 5 and all(isinstance(a, ast.Constant) for a in (call.args[1], call.args[4]))):
                        checks.setdefault(call.args[1].value, []).append(call.args[4].value)
        facts[node.name] = docs, checks
    return facts


def keys() -> list[Key]:
    """Every key of every section that plugin.config adds, in the order the code declares them."""
    from plugin.config import JobConfig

    facts = _source_facts()
    out = []
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        docs, checks = facts.get(cls.__name__, ({}, {}))
        defaults = cls()
        for f in dataclasses.fields(cls):
            out.append(Key(section.name, f.name, _kind(cls, f.name), getattr(defaults, f.name), docs.get(f.name, ""),
                           checks.get(f.name, [])))
    return out


def _kind(cls, name: str) -> str:
    kind = typing.get_type_hints(cls)[name]
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(f"`{_toml(v)}`" for v in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return "list of " + {"int": "integers", "float": "numbers", "str": "strings"}[typing.get_args(kind)[0].__name__]
    return {"bool": "boolean", "str": "string", "int": "integer", "float": "number"}.get(kind.__name__, kind.__name__)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    """Text as one Markdown table cell: `|` ends a cell, `*` starts emphasis, `<name>` reads as an HTML tag."""
    return re.sub(r"<(?=[A-Za-z/])", "&lt;", text.replace("|", "\\|").replace("*", "\\*"))


def reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python docs/generate.py` from plugin/config.py; edit the docstrings there, not this page. -->",
        "",
        "Every key this package adds to torchtitan's TOML, with its default. A TOML file turns the sections on with",
        '`[job] custom_config_module = "plugin.config"`; on the command line a key is `--section.key value`',
        "(e.g. `--grpo.beta 0`), a boolean `--section.key` or `--section.no-key`. A bad value stops the run",
        "while the config is parsed, with an error naming the key; [configuration.md](configuration.md) says",
        "how, and which checks span sections.",
    ]
    by_section: dict[str, list[Key]] = {}
    for k in keys():
        by_section.setdefault(k.section, []).append(k)
    for section, ks in by_section.items():
        lines += ["", f"## `[{section}]`", ""]
        if section in GUIDES:
            lines += [f"Explained in [{GUIDES[section].split('#')[0]}]({GUIDES[section]}).", ""]
        lines += ["| key | default | values | meaning |", "|---|---|---|---|"]
        for k in ks:
            values = k.kind + "".join(f"; {c}" for c in k.checks)
            lines.append(f"| `{k.name}` | `{_cell(_toml(k.default))}` | {_cell(values)} | {_cell(k.doc)} |")
    return "\n".join(lines) + "\n"


def _longest(prefixes, stem: str) -> str | None:
    return max((p for p in prefixes if stem.startswith(p)), key=len, default=None)


def results_table(csv: Path) -> str:
    """A results CSV's Markdown table as the benchmark that wrote it shows it; one no benchmark owns, whole."""
    owner = _longest(OWNERS, csv.stem)
    if owner is None:
        return results_md.table(csv)
    # imported when a CSV asks for it: a benchmark brings torch and its helpers
    tables = importlib.import_module(OWNERS[owner]).TABLES
    return results_md.table(csv, **tables[_longest(tables, csv.stem)])


def outputs() -> dict[Path, str]:
    """Every generated file and what it should hold; a page includes the results tables as they will be."""
    out = {csv.with_suffix(".md"): results_table(csv) for csv in sorted(RESULTS.glob("*.csv"))}
    out[REFERENCE] = reference()

    def fill(m: re.Match) -> str:
        path = REPO / m.group(2)
        return m.group(1) + (out[path] if path in out else path.read_text()) + m.group(4)

    for page in [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        if page != REFERENCE and INCLUDE.search(text):
            out[page] = INCLUDE.sub(fill, text)
    return out


def stale() -> list[Path]:
    """The generated files whose content on disk differs from what the code and results give."""
    return [p for p, text in outputs().items() if not p.exists() or p.read_text() != text]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is out of date")
    args = p.parse_args(argv)
    if args.check:
        old = stale()
        for path in old:
            print(f"out of date: {path.relative_to(REPO)}")
        if old:
            print("run: python docs/generate.py")
        return 1 if old else 0
    missing = [f"[{k.section}] {k.name}" for k in keys() if not k.doc]
    for path, text in outputs().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if missing:
        print("keys without a docstring in plugin/config.py: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
