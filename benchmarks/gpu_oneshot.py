"""One shot on one lent GPU: set-up, the suite's CUDA test cases, the log-prob benchmark, the reference-offload
benchmark, generation against transformers' generate, padding-free against padded rows (the varlen kernel), a
20-step GRPO run and a multi-turn online run with a tool (rows resumed from their KV cache on the device), and a
GRPO run on a mixture-of-experts flavor.

Run from the repo root of a copy of the work tree, on a machine with one CUDA GPU and no package
registry (the device tool's H200: Python 3.12, torch 2.11); the pure-Python packages it lacks travel
as wheels that `--prepare-wheels` saves on a machine with a registry. Every part has a share of
--budget seconds (plus what the parts before it left unused) and is killed at its end; a part that
fails or runs out of memory is recorded and the next one runs. Results, at most 8 files (what the
device tool brings back), go to $OUT if set, else benchmarks/results/gpu/:

  gpu_summary.md          the tables of all parts, for docs/
  gpu_oneshot.log         every command and its whole output
  logprob_memory.csv/.png the log-prob benchmark at B=4 T=9216 V=151936 D=1024, TP=1
  reference_offload.csv   resting and peak memory with and without [reference_model] offload
  generation_vs_transformers.csv  the sampler's tokens/s at the Qwen3-0.6B shape, B=64 and 256, bf16, against
                          transformers' generate where the machine has it; the summary names the attention kernels
  grpo_steps.csv          the GRPO run's metrics per step (from TensorBoard)
  grpo_tb.tar.gz          its TensorBoard events
  (the multi-turn and MoE runs' figures are in gpu_summary.md)

--smoke runs the same parts on CPU with tiny shapes and 2 steps, to check this script anywhere.

Not here: vLLM ([online] use_vllm). The lent machine reaches no package registry, and vLLM's CUDA wheel (hundreds of
MB, with its own compiled kernels and a torch pin of its own) is not among what travels in --prepare-wheels' folder;
the vLLM path is measured on CPU (benchmarks/vllm_rollouts.py) and its GPU settings (sleep mode,
gpu_memory_utilization, per-request seeds with chunked prefill) have not run.
Standard library only, so it runs before anything is installed.
"""

import argparse
import csv
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from job_status import OK, OOM, TIMEOUT, classify, read_scalars, run_job

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "benchmarks" / "wheels"
# What torchtitan 0.2.2 and this package import that the H200 image lacks (its package list is in
# the device tool's KINDS.md), at the versions this project's CPU venv runs. typing_extensions
# travels too: tyro needs >= 4.13, and the image's version was never read.
CARRIED = ("torchtitan==0.2.2", "torchdata==0.11.0", "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1",
           "typing-extensions==4.16.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# Share of --budget per part; a part may also use what the parts before it left unused.
# Set from the first GPU calls (benchmarks/results/gpu/): set-up took 26 s, the log-prob part's compiled variants
# need about 25 s each, the offload part 45 s a setting, GRPO 91 s, MoE 70 s, multi-turn 70 s, generation 73 s.
SHARES = {"setup": 0.05, "tests": 0.08, "logprob": 0.20, "offload": 0.14, "generation": 0.12, "padding_free": 0.04,
          "grpo": 0.17, "multi_turn": 0.10, "moe": 0.10}
# gather first: the baseline of the diff column, and likely a quick OOM; then the unchunked compiled
# pass that the fused pass's targets are ratios to, and the fused pass (policy) / blocked pass
# (reference) that issue 10 built; should the part's time run out, the older chunked ones are left out
VARIANTS = "gather,loss_parallel_compiled,fused_compiled,chunked_compiled,loss_parallel,chunked"

# Per mode: the log-prob shape (the originating change's, on one GPU), the offload benchmark's
# model, and the GRPO run's shape.
MODES = {
    "gpu": dict(
        device="cuda", budget=560,
        logprob=["--batch", "4", "--seq", "9216", "--vocab", "151936", "--dim", "1024", "--chunk", "1024",
                 "--repeats", "3"],
        offload=["--flavor", "0.6B", "--batch", "4", "--seq", "1024", "--steps", "4"],
        flavor="0.6B", steps=20, seq_len=1024, batch=8, chunk=256, groups=64, group_size=8,
        prompt=(128, 256), completion=(512, 768), grpo_extra=[],
        multi_turn=dict(steps=3, prompts=8, new_tokens=128, seq_len=256),
        # train_configs/qwen3_30b_a3b_gpu.toml's settings on 1 GPU with torchtitan's debugmodel_moe (64 experts,
        # top 8): online sampling, R3 routing replay, full activation checkpointing, compile, bf16; the MoE path of
        # CUDA (grouped_mm, Triton's permute-index kernel, no plugin.cpu patch)
        moe=dict(flavor="debugmodel_moe", steps=8, batch=64, new_tokens=64, extra=[]),
        # the whole 0.6B model (28 layers), bf16 as the trainer computes, 32-token prompts, 128 new tokens
        # the engine's decode step compiled; --bandwidth-gbs: the H100's 3,350 GB/s (an H200 has 4,800: the limit
        # is then 1.4x this, and the fraction 0.7x what the CSV says)
        generation=["--device", "cuda", "--dtype", "bfloat16", "--layers", "28", "--uniform", "64x128,256x128",
                    "--no-grpo", "--profile", "", "--attention-check", "--no-plot", "--compile-decode",
                    "--bandwidth-gbs", "3350"],
    ),
    "smoke": dict(
        device="cpu", budget=1500,
        logprob=["--batch", "1", "--seq", "256", "--vocab", "2048", "--dim", "64", "--chunk", "64", "--repeats", "1"],
        offload=["--flavor", "debugmodel", "--batch", "2", "--seq", "64", "--steps", "2"],
        flavor="debugmodel", steps=2, seq_len=128, batch=8, chunk=32, groups=8, group_size=8,
        prompt=(16, 32), completion=(64, 96),
        generation=["--device", "cpu", "--layers", "1", "--uniform", "4x8", "--no-grpo", "--profile", "", "--no-plot"],
        multi_turn=dict(steps=2, prompts=2, new_tokens=24, seq_len=80),
        moe=dict(flavor="debugmodel_moe_small", steps=2, batch=16, new_tokens=6,
                 extra=["--compile.no-enable", "--reference_model.no-compile"]),
        # compiling on a 2-core CPU takes minutes, and the smoke checks the plumbing, not the speed
        grpo_extra=["--compile.no-enable", "--reference_model.no-compile"],
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, 2 GRPO steps: check this script anywhere")
    wheels = WHEELS.relative_to(REPO)
    p.add_argument("--prepare-wheels", action="store_true",
                   help=f"on a machine with a package registry: download the carried wheels into {wheels}/")
    p.add_argument("--python-version", default="3.12", help="--prepare-wheels: the GPU machine's Python")
    p.add_argument("--wheels", help=f"wheels to install first (default: {wheels}/; none with --smoke)")
    p.add_argument("--site", default="/tmp/site", help="where the wheels are installed (put first on PYTHONPATH)")
    p.add_argument("--budget", type=float, help="seconds for all parts (default: 560; --smoke: 1500)")
    p.add_argument("--parts", default=",".join(SHARES), help=f"comma list of {', '.join(SHARES)}")
    p.add_argument("--logprob-variants", default=VARIANTS,
                   help="the log-prob part's variants, in order (gather first: the others' diffs are against it)")
    p.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results/gpu/; "
                                 "--smoke: benchmarks/results/tmp/gpu_smoke/)")
    args = p.parse_args(argv)
    args.mode = MODES["smoke" if args.smoke else "gpu"]
    args.budget = args.budget or args.mode["budget"]
    args.part_list = args.parts.split(",")
    for part in args.part_list:
        if part not in SHARES:
            p.error(f"unknown part {part!r}; choose from {', '.join(SHARES)}")
    if args.wheels is None:
        args.wheels = "" if args.smoke else str(WHEELS)
    if args.out is None:
        default = REPO / "benchmarks" / "results" / ("tmp/gpu_smoke" if args.smoke else "gpu")
        args.out = os.environ.get("OUT") or str(default)
    return args


def prepare_wheels(args) -> int:
    """Download CARRIED for the GPU machine's Python into benchmarks/wheels/ (one version of each)."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           args.python_version, "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "-d", str(WHEELS),
           *CARRIED]
    print(" ".join(cmd))
    rc = subprocess.call(cmd)
    size = sum(f.stat().st_size for f in WHEELS.glob("*.whl"))
    print(f"{len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {WHEELS}")
    return rc


class Run:
    """The parts' shared state: time left, environment, log, and the summary's sections."""

    def __init__(self, args):
        self.args, self.mode = args, args.mode
        self.start = time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_oneshot_"))
        self.log = open(self.out / "gpu_oneshot.log", "w")
        self.sections: list[str] = []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(self.scratch / "inductor"))
        # the carried wheels first, then the repo (its plugin package), then what was there
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.site if args.wheels else "", str(REPO),
                                                               os.environ.get("PYTHONPATH")]))

    def timeout(self, part: str) -> float:
        """This part's share plus what earlier parts left: the time left minus the later parts' shares."""
        later = self.args.part_list[self.args.part_list.index(part) + 1:]
        left = self.args.budget - (time.perf_counter() - self.start)
        return left - sum(SHARES[p] for p in later) * self.args.budget

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def job(self, name: str, cmd: list[str], timeout: float, cwd=REPO, env: dict | None = None) -> tuple[str, str, str]:
        """Run one command of a part, logged whole, `env` added to the run's; (status, detail, output)."""
        self.say(f"\n## {name}: {' '.join(cmd)}  (timeout {timeout:.0f} s)")
        start = time.perf_counter()
        if env and "PYTHONPATH" in env and self.env.get("PYTHONPATH"):  # the carried wheels stay first
            env = {**env, "PYTHONPATH": os.pathsep.join([self.env["PYTHONPATH"], env["PYTHONPATH"]])}
        returncode, output = run_job(cmd, env={**self.env, **(env or {})}, cwd=cwd, timeout=max(timeout, 1))
        status, detail = classify(returncode, output)
        self.log.write(output)
        tail = "" if status == OK else "\n" + "\n".join(output.splitlines()[-25:])
        self.say(f"-> {name}: {status} (exit {returncode}) in {time.perf_counter() - start:.0f} s{tail}")
        return status, detail, output


def part_setup(run: Run, timeout: float) -> None:
    """Install the carried wheels and the project, check that everything imports; log the machine."""
    args, deadline = run.args, time.perf_counter() + timeout
    lines = []
    if shutil.which("nvidia-smi"):
        _, _, output = run.job("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                              "--format=csv,noheader"], 20)
        lines += [f"nvidia-smi: {line.strip()}" for line in output.splitlines() if line.strip()][:1]
    wheels = sorted(Path(args.wheels).glob("*.whl")) if args.wheels else []
    if args.wheels and not wheels:
        lines.append(f"no wheels in {args.wheels}: run `python benchmarks/gpu_oneshot.py --prepare-wheels` here first")
    if wheels:
        # the device tool's README's way: no index there, and no dependency resolution against the image
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", args.site, *map(str, wheels)]
        status, _, _ = run.job("install wheels", install, deadline - time.perf_counter())
        lines.append(f"carried wheels ({len(wheels)}) into {args.site}: {status}")
        # the project itself; PYTHONPATH has the repo anyway, so a failure here costs nothing
        status, _, _ = run.job("install project", [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                                   "--no-build-isolation", "--no-index", "-e", "."],
                               deadline - time.perf_counter())
        lines.append(f"`pip install --no-deps -e .`: {status}")
        check = "from datasets import Dataset, load_dataset; from datasets.distributed import split_dataset_by_node"
        status, detail, _ = run.job("import datasets", [sys.executable, "-c", check], deadline - time.perf_counter())
        if status != OK:
            write_datasets_stub(Path(args.site))
            lines.append(f"`datasets` did not import ({detail}); a stand-in was written: torchtitan imports it "
                         "for text datasets that GRPO never builds")
    probe = ("import json, sys, torch, torchtitan, plugin, plugin.config, torchtitan.train; "
             "print(json.dumps(dict(python=sys.version.split()[0], torch=torch.__version__, "
             "cuda=torch.cuda.is_available(), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else '')))")
    status, detail, output = run.job("import check", [sys.executable, "-c", probe],
                                     max(deadline - time.perf_counter(), 30))
    found = [line for line in output.splitlines() if line.startswith("{")]
    if status == OK and found:
        info = json.loads(found[-1])
        lines.append(f"Python {info['python']}, torch {info['torch']}, "
                     f"{'GPU: ' + info['gpu'] if info['cuda'] else 'no CUDA device'}; torchtitan and plugin import")
    else:
        lines.append(f"import check: {status}")
    run.sections.append("### Set-up\n\n" + "\n".join(f"- {line}" for line in lines))


def write_datasets_stub(site: Path) -> None:
    """A `datasets` with the three names torchtitan imports, for a machine where the real one cannot import."""
    shutil.rmtree(site / "datasets", ignore_errors=True)
    (site / "datasets").mkdir(parents=True)
    msg = "a stand-in written by benchmarks/gpu_oneshot.py: the real datasets package did not import here"
    (site / "datasets" / "__init__.py").write_text(
        f'"""{msg}."""\n\n\nclass Dataset:\n    pass\n\n\ndef load_dataset(*args, **kwargs):\n'
        f'    raise ImportError("{msg}")\n')
    (site / "datasets" / "distributed.py").write_text(
        f'def split_dataset_by_node(*args, **kwargs):\n    raise ImportError("{msg}")\n')


def part_tests(run: Run, timeout: float) -> None:
    """The suite's CUDA cases (`-m "not slow" -k cuda`: the fused and blocked log-prob passes, bf16 gradients against
    fp64, the sampler against its oracle and the CPU, the offloaded reference, the metrics' no-sync check)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider", "-o", "addopts=", "-n", "0",
           "-m", "not slow", "-k", "cuda", "tests"]
    status, detail, output = run.job("CUDA tests", cmd, timeout)
    lines = output.splitlines()
    said = [line for line in lines if line.startswith(("cuda", "PASSED", "FAILED", "ERROR", "SKIPPED"))]
    counts = [line.strip("= ") for line in lines if re.search(r"\d+ (passed|failed|skipped|error)", line)][-1:]
    run.sections.append("### The suite's CUDA cases (`pytest -m 'not slow' -k cuda`)\n\n"
                        + "\n".join([f"status: {status if not detail else f'{status}: {detail}'}", *counts, "", "```",
                                     *said, "```"]))


def part_logprob(run: Run, timeout: float) -> None:
    """benchmarks/logprob_memory.py, TP=1; gather may run out of memory, which is a result."""
    cmd = [sys.executable, "benchmarks/logprob_memory.py", "--device", run.mode["device"], "--tp", "1",
           *run.mode["logprob"], "--variants", run.args.logprob_variants, "--out", str(run.out),
           # the benchmark's own budget ends first, so it writes what it measured before the kill
           "--time-budget", str(int(max(timeout - 20, 1))), "--timeout", str(int(max(timeout - 20, 1)))]
    status, detail, _ = run.job("log-prob benchmark", cmd, timeout)
    path = run.out / "logprob_memory.csv"
    if not path.exists():
        run.sections.append(f"### Log-prob memory\n\nno results: {status} {detail}")
        return
    rows = list(csv.DictReader(open(path)))
    r0 = rows[0]
    lines = [
        f"### Log-prob memory, {r0['device']}: B={r0['batch']} T={r0['seq']} V={r0['vocab']} D={r0['dim']} "
        f"TP={r0['tp']} {r0['dtype']}, chunk {run.mode['logprob'][run.mode['logprob'].index('--chunk') + 1]}, "
        f"{r0['repeats']} repeats; bf16 logits shard {float(r0['logits_shard_gib']):.2f} GiB",
        "",
        "| variant | pass | status | peak (GiB) | growth (GiB) | growth / logits shard | time (ms) "
        "| max abs diff vs gather |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] == OK:
            diff = f"{float(r['max_abs_diff_vs_gather']):.1e}" if r["max_abs_diff_vs_gather"] else ""
            cells = [f"{float(r['peak_gib']):.2f}", f"{float(r['growth_gib']):.2f}",
                     f"{float(r['growth_vs_shard']):.1%}", f"{float(r['time_s']) * 1000:.1f}", diff]
        else:
            cells = ["–"] * 5
        lines.append(f"| {r['variant']} | {r['pass']} | {r['status'].split(':')[0]} | " + " | ".join(cells) + " |")
    notes = [f"- {r['variant']} / {r['pass']}: {r['detail']}" for r in rows if r["status"] != OK and r["detail"]]
    run.sections.append("\n".join(lines + ([""] + notes if notes else [])))


def part_offload(run: Run, timeout: float) -> None:
    """benchmarks/reference_offload.py: the resting memory with and without the reference offloaded."""
    cmd = [sys.executable, "benchmarks/reference_offload.py", "--device", run.mode["device"], *run.mode["offload"],
           "--out", str(run.out), "--timeout", str(int(max(timeout / 2 - 5, 1)))]
    status, detail, _ = run.job("reference offload", cmd, timeout)
    path = run.out / "reference_offload.csv"
    if not path.exists():
        run.sections.append(f"### Reference offload\n\nno results: {status} {detail}")
        return
    rows = list(csv.DictReader(open(path)))
    o = dict(zip(run.mode["offload"][::2], run.mode["offload"][1::2]))
    where = "CPU (smoke: RSS, offload does nothing)" if run.args.smoke else "CUDA"
    lines = [f"### Reference offload, {where}: grpo_qwen3 {o['--flavor']}, fp32, batch {o['--batch']} x seq "
             f"{o['--seq']}, {int(o['--steps']) - 1} measured steps",
             "", "| offload | status | reference weights (GiB) | resting (GiB) | step peak (GiB) | "
             "reference pass growth (GiB) | step time (s) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        nums = [f"{float(r[c]):.3f}" if r[c] else "–" for c in
                ("ref_weights_gib", "resting_gib", "step_peak_gib", "ref_pass_growth_gib", "step_time_s")]
        lines.append(f"| {r['offload']} | {r['status'].split(':')[0]} | " + " | ".join(nums) + " |")
    run.sections.append("\n".join(lines))


def part_generation(run: Run, timeout: float) -> None:
    """benchmarks/generation_vs_transformers.py: the sampler's tokens/s next to transformers' generate, if installed."""
    cmd = [sys.executable, "benchmarks/generation_vs_transformers.py", *run.mode["generation"], "--out", str(run.out)]
    status, detail, output = run.job("generation", cmd, timeout)
    said = [line for line in output.splitlines()
            if line.startswith(("attention:", "max |logits", "transformers is not importable"))]
    path = run.out / "generation_vs_transformers.csv"
    if not path.exists():
        run.sections.append("### Generation\n\n" + "\n".join([f"no results: {status} {detail}", *said]))
        return
    rows = list(csv.DictReader(open(path)))
    r0 = rows[0]
    lines = [f"### Generation, {r0['device']}: Qwen3-0.6B shape, {r0['layers']} layers, {r0['dtype']}, "
             f"{r0['prompt_len']}-token prompts, no stop", "", *[f"- {line}" for line in said], "",
             "| engine | B | new tokens | tokens/s | ours / transformers |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['ours_vs_transformers']}x" if r["ours_vs_transformers"] else ""
        lines.append(f"| {r['engine']} | {r['batch']} | {r['new_tokens']} | {r['tokens_per_s']} | {ratio} |")
    run.sections.append("\n".join(lines))


def part_padding_free(run: Run, timeout: float) -> None:
    """benchmarks/padding_free.py --check: padding-free against padded rows on the device (CUDA: the varlen kernel)."""
    cmd = [sys.executable, "benchmarks/padding_free.py", "--check", run.mode["device"]]
    status, detail, output = run.job("padding-free check", cmd, timeout)
    section = [line for line in output.splitlines() if line.startswith(("###", "|")) or not line.strip()]
    run.sections.append("\n".join(section).strip() if any(x.startswith("|") for x in section)
                        else f"### Padding-free check\n\nno results: {status} {detail}")


def write_rollouts(path: Path, mode: dict, seed: int = 0) -> None:
    """Grouped, pre-tokenized rollouts; ids below the bundled tokenizer's 2048, so valid for Qwen3's vocab too."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(mode["groups"]):
            prompt = [rng.randrange(3, 2048) for _ in range(rng.randint(*mode["prompt"]))]
            completions = [[rng.randrange(3, 2048) for _ in range(rng.randint(*mode["completion"]))]
                           for _ in range(mode["group_size"])]
            rewards = [float(rng.random() < 0.5) for _ in completions]
            f.write(json.dumps({"prompt_ids": prompt, "completions_ids": completions, "rewards": rewards}) + "\n")


def grpo_cmd(run: Run, dump: Path, rollouts: Path, extra: list[str]) -> list[str]:
    m = run.mode
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "torchtitan.train", "--job.config_file", "train_configs/qwen3_0.6b_gpu.toml",
        "--job.dump_folder", str(dump), "--model.flavor", m["flavor"],
        "--parallelism.tensor_parallel_degree", "1", "--training.steps", str(m["steps"]),
        "--checkpoint.no-enable", "--checkpoint.no-initial-load-in-hf",
        "--model.hf_assets_path", "plugin/assets/tokenizer", "--training.dataset_path", str(rollouts),
        "--training.seq_len", str(m["seq_len"]), "--training.local_batch_size", str(m["batch"]),
        # the config samples online; this part trains on synthetic rollouts, chunk positions of each sequence
        "--online.no-enable", "--validation.no-enable", "--grpo.logprob_chunk_tokens", str(m["chunk"] * m["batch"]),
        "--metrics.enable_tensorboard", "--metrics.log_freq", "1",
        *m["grpo_extra"], *extra,
    ]


def part_grpo(run: Run, timeout: float) -> None:
    """torchtitan.train on train_configs/qwen3_0.6b_gpu.toml, 1 GPU, random weights, synthetic rollouts."""
    train(run, timeout, "GRPO run", files=True)


def part_moe(run: Run, timeout: float) -> None:
    """train_configs/qwen3_30b_a3b_gpu.toml on 1 device with a small MoE flavor (EP and FSDP 1): online sampling of the
    bundled compare prompts, R3 routing replay, full activation checkpointing; its figures go to the summary."""
    moe = run.mode["moe"]
    dump = run.scratch / "moe"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "torchtitan.train", "--job.config_file", "train_configs/qwen3_30b_a3b_gpu.toml",
        "--job.dump_folder", str(dump), "--model.flavor", moe["flavor"], "--model.hf_assets_path",
        "plugin/assets/tokenizer", "--checkpoint.no-enable", "--checkpoint.no-initial-load-in-hf",
        "--parallelism.data_parallel_shard_degree", "1", "--parallelism.expert_parallel_degree", "1",
        "--training.dataset_path", "data/compare_prompts.jsonl", "--training.seq_len", str(32 + moe["new_tokens"]),
        "--training.local_batch_size", str(moe["batch"]), "--training.steps", str(moe["steps"]),
        # a random policy never writes a right sum (all rewards 0, so loss and gradients 0, as on the H100 on
        # 2026-12-05); tests/reward_fns.py's even-token reward spreads its completions' rewards
        "--online.reward_funcs", "reward_fns:even_ids", "--online.max_new_tokens", str(moe["new_tokens"]),
        "--online.stop_token_ids", "1", "--validation.no-enable", "--metrics.log_freq", "1", *moe["extra"],
    ]
    status, detail, output = run.job("MoE online run", cmd, timeout, env={"PYTHONPATH": str(REPO / "tests")})
    steps = max(read_scalars(dump), parse_log(output), key=len)
    compiled = "--compile.no-enable" not in moe["extra"]
    tags = ("moe/routing_agreement", "online/logprob_mismatch", "moe/load_max", "moe/router_entropy", "grpo/reward_std",
            "online/generated_tokens_per_s", "time_metrics/end_to_end(s)")
    lines = [f"### MoE, qwen3_30b_a3b_gpu.toml's settings with grpo_qwen3 {moe['flavor']} on 1 device (EP and FSDP 1): "
             f"online, R3, full AC, {'compiled' if compiled else 'eager'}, bf16; {moe['batch'] // 8} prompts x 8, "
             f"up to {moe['new_tokens']} new tokens", "",
             grpo_summary(steps, status if status.startswith("error") or not detail else f"{status}: {detail}",
                          compiled), "", "| step | " + " | ".join(tags) + " |", "|---:|" + "---:|" * len(tags)]
    for step in sorted(steps):
        lines.append(f"| {step} | " + " | ".join(f"{steps[step][t]:.4g}" if t in steps[step] else "" for t in tags)
                     + " |")
    run.sections.append("\n".join(lines))


def train(run: Run, timeout: float, name: str, files: bool) -> None:
    """One GRPO run of grpo_cmd's; eager again if the compiled one fails; its figures into the summary."""
    deadline = time.perf_counter() + timeout
    m = run.mode
    rollouts = run.scratch / "rollouts.jsonl"
    write_rollouts(rollouts, run.mode)
    dump = run.scratch / name.lower().replace(" ", "_")
    status, detail, output = run.job(name, grpo_cmd(run, dump, rollouts, []), timeout)
    compiled = "--compile.no-enable" not in run.mode["grpo_extra"]
    if status not in (OK, OOM, TIMEOUT) and compiled and deadline - time.perf_counter() > 90:
        # the GPU path never ran before this; an eager run still says whether the rest of it works
        run.say(f"compiled {name} failed ({detail}); again without torch.compile")
        shutil.rmtree(dump, ignore_errors=True)
        first = f"compiled run: {status}; then "
        eager = grpo_cmd(run, dump, rollouts, ["--compile.no-enable", "--reference_model.no-compile"])
        status, detail, output = run.job(f"{name}, eager", eager, deadline - time.perf_counter())
        compiled = False
    else:
        first = ""
    # TensorBoard flushes every 2 minutes: after a kill the console log may hold more steps
    steps = max(read_scalars(dump), parse_log(output), key=len)
    if steps and files:
        tags = sorted({t for s in steps.values() for t in s})
        with open(run.out / "grpo_steps.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", *tags])
            for step in sorted(steps):
                w.writerow([step, *(f"{steps[step][t]:.6g}" if t in steps[step] else "" for t in tags)])
    if (dump / "tb").exists() and files:
        with tarfile.open(run.out / "grpo_tb.tar.gz", "w:gz") as tar:
            tar.add(dump / "tb", arcname="grpo_tb")
    head = (f"### {name.removesuffix(' run')}, grpo_qwen3 {m['flavor']}, random weights, 1 process, TP=1, "
            f"{'compiled (model, loss, reference)' if compiled else 'eager'}, bf16; {m['steps']} steps of "
            f"{m['batch']} completions ({m['batch'] // m['group_size']} group) x seq {m['seq_len']}, "
            f"logprob_chunk_tokens {m['chunk'] * m['batch']}, the default (fused) policy pass")
    # an error's status already ends with its detail
    said = status if status.startswith("error") or not detail else f"{status}: {detail}"
    run.sections.append(head + "\n\n" + grpo_summary(steps, first + said, compiled))


def part_multi_turn(run: Run, timeout: float) -> None:
    """Online GRPO with a tool on 1 device, random weights: tests/toy_tools.py's format, which a random policy writes
    in about half its turns, and its echo tool (as tests/test_tools_e2e.py on CPU). Rows pause, their tools run, and
    they resume from their KV cache on the device; the figures are the run's tools/* and online/* tags."""
    m, mt = run.mode, run.mode["multi_turn"]
    prompts = run.scratch / "tool_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Q: {i} + {i + 1} ="}]}) + "\n"
                               for i in range(mt["prompts"])))
    dump = run.scratch / "multi_turn"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        "-m", "torchtitan.train", "--job.config_file", "train_configs/qwen3_0.6b_gpu.toml",
        "--job.dump_folder", str(dump), "--model.flavor", m["flavor"], "--parallelism.tensor_parallel_degree", "1",
        "--training.steps", str(mt["steps"]), "--checkpoint.no-enable", "--checkpoint.no-initial-load-in-hf",
        "--model.hf_assets_path", "plugin/assets/tokenizer", "--training.dataset_path", str(prompts),
        "--training.seq_len", str(mt["seq_len"]), "--training.local_batch_size", str(8 * mt["prompts"]),
        "--validation.no-enable", "--compile.no-enable", "--reference_model.no-compile",
        "--experimental.custom_import", "toy_tools", "--online.tools", "toy_tools:echo",
        "--online.tool_call_format", "toy", "--online.max_tool_calling_iterations", "2",
        "--rollout_data.chat_template_path", "tests/fixtures/toy_chat.jinja",
        "--online.reward_funcs", "toy_tools:tool_turns", "--online.reward_weights", "1.0",
        "--online.max_new_tokens", str(mt["new_tokens"]),
        "--online.stop_token_ids", "1", *map(str, range(1000, 1400)),
        "--metrics.enable_tensorboard", "--metrics.log_freq", "1",
    ]
    env = {"PYTHONPATH": str(REPO / "tests"), "TOY_TOOL_LOG": str(run.scratch)}
    status, detail, output = run.job("multi-turn run", cmd, timeout, env=env)
    steps = max(read_scalars(dump), parse_log(output), key=len)
    tags = ("tools/call_frequency", "tools/failure_frequency", "tools/turns_mean", "online/completion_length_mean",
            "online/generation_time(s)", "online/generated_tokens_per_s", "loss_metrics/global_avg_loss")
    lines = [f"### Multi-turn online GRPO with a tool, grpo_qwen3 {m['flavor']}, random weights, 1 device, eager; "
             f"{mt['prompts']} prompts x 8, up to {mt['new_tokens']} new tokens, 2 tool turns at most", "",
             f"status: {status if status.startswith('error') or not detail else f'{status}: {detail}'}", "",
             "| step | " + " | ".join(tags) + " |", "|---:|" + "---:|" * len(tags)]
    for step in sorted(steps):
        lines.append(f"| {step} | " + " | ".join(f"{steps[step][t]:.4g}" if t in steps[step] else ""
                                                 for t in tags) + " |")
    run.sections.append("\n".join(lines))


def parse_log(output: str) -> dict[int, dict[str, float]]:
    """torchtitan's console line per step, where TensorBoard left nothing: loss, memory, tps."""
    pat = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.eE+na]+)\s+grad_norm:\s*([-\d.eE+na]+)\s+"
                     r"memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
    steps = {}
    for m in pat.finditer(re.sub(r"\x1b\[[0-9;]*m", "", output)):
        steps[int(m[1])] = {"loss_metrics/global_avg_loss": float(m[2]), "grad_norm": float(m[3]),
                            "memory/max_reserved(GiB)": float(m[4]), "throughput(tps)": float(m[5].replace(",", ""))}
    return steps


def grpo_summary(steps: dict, status: str, compiled: bool) -> str:
    """The run's status and a few figures: step time, loss, memory, KL."""
    if not steps:
        return f"status: {status}; no step was logged"
    ordered = [steps[s] for s in sorted(steps)]

    def series(tag):
        return [s[tag] for s in ordered if tag in s]

    def fmt(values, how, spec):
        return format(how(values), spec) if values else "–"

    times, loss = series("time_metrics/end_to_end(s)"), series("loss_metrics/global_avg_loss")
    rows = [
        ("status", status),
        ("steps logged", str(len(ordered))),
        (f"step 1 time (s){', compiles included' if compiled else ''}", fmt(times[:1], lambda v: v[0], ".1f")),
        (f"median step time, steps {'3' if len(times) > 2 else '2'}+ (s)",
         fmt(times[2:] or times[1:], statistics.median, ".3f")),
        ("median throughput (tokens/s)", fmt(series("throughput(tps)")[2:] or series("throughput(tps)"),
                                             statistics.median, ",.0f")),
        ("loss, first / last", f"{fmt(loss, lambda v: v[0], '.4f')} / {fmt(loss, lambda v: v[-1], '.4f')}"),
        ("memory/max_active (GiB), max", fmt(series("memory/max_active(GiB)"), max, ".2f")),
        ("memory/max_reserved (GiB), max", fmt(series("memory/max_reserved(GiB)"), max, ".2f")),
        ("grpo/kl, step 1 / last", f"{fmt(series('grpo/kl'), lambda v: v[0], '.2e')} / "
                                   f"{fmt(series('grpo/kl'), lambda v: v[-1], '.2e')}"),
        ("grpo/ref_time (s), median", fmt(series("grpo/ref_time(s)"), statistics.median, ".3f")),
        ("grpo/ref_peak_memory (GiB), max", fmt(series("grpo/ref_peak_memory(GiB)"), max, ".2f")),
        ("memory/num_ooms, max", fmt(series("memory/num_ooms"), max, ".0f")),
    ]
    return "| figure | value |\n|---|---:|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


PARTS = {"setup": part_setup, "tests": part_tests, "logprob": part_logprob, "offload": part_offload,
         "generation": part_generation, "padding_free": part_padding_free, "grpo": part_grpo,
         "multi_turn": part_multi_turn, "moe": part_moe}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(args)
    run = Run(args)
    run.say(f"gpu_oneshot{' --smoke' if args.smoke else ''}: parts {args.parts}, budget {args.budget:.0f} s, "
            f"results in {run.out}, scratch {run.scratch}")
    for part in args.part_list:
        timeout = run.timeout(part)
        if timeout < 15:
            run.say(f"\n## {part}: skipped, {timeout:.0f} s left for it")
            run.sections.append(f"### {part}\n\nskipped: the time budget was spent")
            continue
        try:
            PARTS[part](run, timeout)
        except Exception as e:  # a broken part must not cost the others their turn
            run.say(f"\n## {part}: {type(e).__name__}: {e}")
            run.sections.append(f"### {part}\n\nfailed in gpu_oneshot.py: {type(e).__name__}: {e}")
    took = time.perf_counter() - run.start
    header = (f"## One-shot {'smoke run (CPU)' if args.smoke else 'GPU run'}: "
              f"{time.strftime('%Y-%m-%d')}, {took:.0f} s\n\n"
              "Written by `benchmarks/gpu_oneshot.py`; an OOM is a measurement that ran out of device memory.")
    # the benchmarks' own tables repeat gpu_summary.md's, and the device tool brings back 8 files at most
    for md in run.out.glob("*.md"):
        md.unlink()
    (run.out / "gpu_summary.md").write_text("\n\n".join([header, *run.sections]) + "\n")
    run.say("\n" + (run.out / "gpu_summary.md").read_text())
    run.say(f"results in {run.out}: {', '.join(sorted(p.name for p in run.out.iterdir()))}")
    run.log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
