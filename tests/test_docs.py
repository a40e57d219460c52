"""The README and docs/ say what the code does: generated parts are current, commands and keys exist.

A shell block whose fence reads ```bash runnable is a command a user can paste as it is: every
file, script, module, flag and `--section.key` override it names must exist (docs/architecture.md,
"Writing docs"). TOML blocks may be fragments; each key they set must exist.
"""

import importlib.util
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
# linked before they exist: written on another branch; drop a name here once its page is merged
PENDING = {"docs/padding_free.md"}
README_LINES = 250


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(info: str) -> list[tuple[str, str]]:
    """(page name, block text) of every fenced block whose info string is `info`."""
    return [(p.relative_to(REPO).as_posix(), m.group(2)) for p in PAGES
            for m in FENCE.finditer(p.read_text()) if m.group(1).strip() == info]


def commands(block: str) -> list[list[str]]:
    """A shell block as simple commands (argv lists): continuations joined, comments dropped, split at && ; |."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        cmd = []
        for token in lexer:
            if token in (";", "&&", "||", "|", "&"):
                out.append(cmd)
                cmd = []
            else:
                cmd.append(token)
        out.append(cmd)
    return [c for c in out if c]


@cache
def job_config(*overrides: str, config: str = "train_configs/debug_cpu.toml"):
    """torchtitan's parser on a TOML file and overrides, as `-m torchtitan.train` runs it."""
    from torchtitan.config import ConfigManager

    import plugin  # noqa: F401  registers the GRPO models

    return ConfigManager().parse_args(["--job.config_file", str(REPO / config), *overrides])


def check_torchtitan_args(args: list[str], what: str) -> None:
    if "--job.config_file" in args:
        i = args.index("--job.config_file")
        config, args = args[i + 1], args[:i] + args[i + 2:]
        assert (REPO / config).is_file(), f"{what}: {config} does not exist"
    else:
        config = "train_configs/debug_cpu.toml"
    try:
        job_config(*args, config=config)
    except SystemExit as e:  # tyro's answer to an unknown flag or a bad value
        pytest.fail(f"{what}: torchtitan's parser refused {args}: exit {e.code}")


def check_script_flags(source: Path, args: list[str], what: str) -> None:
    text = source.read_text()
    if "--" in args:  # after `--`: torchtitan flags that the script hands to the job
        check_torchtitan_args(args[args.index("--") + 1:], what)
        args = args[:args.index("--")]
    for a in args:
        if a.startswith("--"):
            flag = a.split("=")[0]
            assert f'"{flag}"' in text or f"'{flag}'" in text, f"{what}: {source.name} has no {flag}"
        elif a.endswith((".py", ".toml")):
            assert (REPO / a).is_file(), f"{what}: {a} does not exist"


def check_command(cmd: list[str], what: str) -> None:
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cmd[0]):  # VAR=value before the command
        cmd = cmd[1:]
    name, args = cmd[0], cmd[1:]
    if name == "pip":
        extras = re.findall(r'\.\[(\w+)\]', " ".join(args))
        pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
        for extra in extras:
            assert extra in pyproject["project"]["optional-dependencies"], f"{what}: no extra [{extra}]"
    elif name == "torchrun":
        assert "-m" in args and args[args.index("-m") + 1] == "torchtitan.train", f"{what}: {cmd}"
        check_torchtitan_args(args[args.index("-m") + 2:], what)
    elif name == "python":
        if args[0] == "-m":
            spec = importlib.util.find_spec(args[1])
            assert spec and spec.origin, f"{what}: no module {args[1]}"
            check_script_flags(Path(spec.origin), args[2:], what)
        else:
            assert (REPO / args[0]).is_file(), f"{what}: {args[0]} does not exist"
            check_script_flags(REPO / args[0], args[1:], what)
    elif name == "tensorboard":
        assert args[:1] == ["--logdir"], f"{what}: {cmd}"
    else:
        pytest.fail(f"{what}: a runnable block runs {name!r}, which this test does not know how to check")


def test_generated_docs_are_current():
    stale = [p.relative_to(REPO).as_posix() for p in _generate().stale()]
    assert not stale, f"out of date: {stale}; regenerate with: python docs/generate.py"


def test_every_key_has_a_docstring():
    missing = [f"[{k.section}] {k.name}" for k in _generate().keys() if not k.doc]
    assert not missing, f"keys without a docstring (the string under the field in plugin/config.py): {missing}"


def test_reference_lists_every_section():
    text = (REPO / "docs" / "reference.md").read_text()
    for k in _generate().keys():
        assert f"## `[{k.section}]`" in text and f"| `{k.name}` |" in text


RUNNABLE = blocks("bash runnable")


def test_readme_has_runnable_setup_commands():
    readme = [b for page, b in RUNNABLE if page == "README.md"]
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert any(ci in b for b in readme), f"README's test command is not .ci/run's: {ci}"
    main = "torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file train_configs/debug_cpu.toml"
    assert any(main in b for b in readme), "README's main command is gone"


@pytest.mark.parametrize("page, block", RUNNABLE, ids=[f"{p}:{i}" for i, (p, _) in enumerate(RUNNABLE)])
def test_runnable_block_names_what_exists(page, block):
    for cmd in commands(block):
        check_command(cmd, f"{page}: {shlex.join(cmd)}")


TOML = blocks("toml")


@pytest.mark.parametrize("page, block", TOML, ids=[f"{p}:{i}" for i, (p, _) in enumerate(TOML)])
def test_toml_block_sets_keys_that_exist(page, block):
    config = job_config()
    for section, values in tomllib.loads(block).items():
        assert hasattr(config, section), f"{page}: no section [{section}]"
        for key in values:
            assert hasattr(getattr(config, section), key), f"{page}: no key [{section}] {key}"


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_between_pages_exist():
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
            if name in PENDING and not path.exists():
                continue
            assert path.exists(), f"{page.name} links to {target}, which does not exist"
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path), f"{page.name} links to {target}: no such heading in {name}"


def test_readme_stays_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; details belong in docs/ (at most {README_LINES})"


def test_readme_config_parses(tmp_path):
    """The README's TOML for one's own model is a whole config: torchtitan's parser takes it as written."""
    whole = [b for page, b in TOML if page == "README.md" and "[job]" in b]
    assert len(whole) == 1
    (tmp_path / "my_grpo.toml").write_text(whole[0])
    config = job_config(config=str(tmp_path / "my_grpo.toml"))
    assert config.online.enable and config.model.name == "grpo_qwen3"
