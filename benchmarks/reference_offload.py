"""Device memory with and without `[reference_model] offload`: the resting memory should drop by the reference's weights.

Each setting runs in a fresh process on one GPU: the GRPO model built as torchtitan's Trainer
builds it (meta init, the plugin's parallelize function, to_empty, init_weights), torchtitan's
optimizer, and a few training steps on random tokens.

Simplifications:
1. One process, no parallelism: the reference's weights are whole (with TP/FSDP each rank
   saves its shard's size instead).
2. The loss is -mean(log-probs) of the policy; the reference pass runs as in training (its
   log-probs feed no loss here, which changes no memory figure).
3. fp32 weights; "resting" is the allocated memory between steps (weights, optimizer state),
   "peak" the highest allocated memory within a step.

A setting that runs out of memory (or fails otherwise) is recorded with that status and no figures.

Usage: python benchmarks/reference_offload.py [--model grpo_qwen3 --flavor 0.6B --batch 4 --seq 1024]
On a machine without CUDA it prints why it cannot measure and exits 0: offload is a no-op when
training on CPU, where the reference's weights already live in host memory. `--device cpu` runs
the same code there anyway, as a check of the benchmark itself (figures are RSS, offload does nothing).
"""

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import ONE_RANK, Memory, build_model
import results_md
from job_status import OK, OOM, OOM_EXIT, SIMULATE_ENV, TIMEOUT, classify, fake_oom, read_reports, run_job, simulated_oom, \
    write_report

GiB = 2**30
REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("offload", "status", "ref_weights_gib", "resting_gib", "step_peak_gib", "ref_pass_growth_gib",
           "step_time_s", "detail")
SETTINGS = {False: "baseline", True: "offload"}  # names for --simulate-oom
# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"reference_offload": dict(script="reference_offload.py", pick=None)}  # the CSV as it is


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="grpo_qwen3", help="a GRPO TrainSpec: grpo_qwen3 or grpo_llama3")
    p.add_argument("--flavor", default="0.6B", help="a flavor of that model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4, help="training steps; the first is warm-up")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: check the benchmark itself where there is no GPU (RSS figures; offload does nothing)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per setting")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # set by the launcher
    # for tests: baseline and/or offload[:kill], comma-separated, fails that setting as an OOM would
    p.add_argument("--simulate-oom", default=os.environ.get(SIMULATE_ENV), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args, offload: bool, device: torch.device):
    """Model (policy + reference) and optimizers, as torchtitan's Trainer builds them, on one device."""
    overrides = ["--model.name", args.model, "--model.flavor", args.flavor, "--training.seq_len", str(args.seq), *ONE_RANK]
    if offload:
        overrides.append("--reference_model.offload")
    model, cfg, pd, spec = build_model(*overrides, device=device)
    model.train()
    return model, spec.build_optimizers_fn([model], cfg.optimizer, pd), model.model_args.vocab_size


def worker(args, offload: bool) -> dict:
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    memory = Memory(device)
    model, optimizers, vocab = build(args, offload, device)
    ref_bytes = sum(p.numel() * p.element_size() for p in model.reference.module.parameters())
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=g)  # [B, T]
    labels = torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=g)  # [B, T]

    fake = simulated_oom(args.simulate_oom, SETTINGS[offload])
    times, peaks, resting = [], [], []
    for _ in range(args.steps):
        optimizers.zero_grad()  # frees the grads: what stays is weights and optimizer state
        resting.append(memory.reset())
        if fake:
            fake_oom(fake, f"the {SETTINGS[offload]} setting's first step")
        start = time.perf_counter()
        out = model(tokens, labels=labels)
        (-out.logprobs.mean()).backward()
        optimizers.step()
        peaks.append(memory.peak())  # synchronizes on CUDA
        times.append(time.perf_counter() - start)
    # step 1 allocates the optimizer state: measure from step 2 on
    return {
        "offload": offload,
        "ref_weights_gib": ref_bytes / GiB,
        "resting_gib": max(resting[1:]) / GiB,
        "step_peak_gib": max(peaks[1:]) / GiB,
        "ref_pass_growth_gib": model.stats.peaks["ref_peak_growth"],
        "step_time_s": statistics.median(times[1:]),
    }


def launch(args, offload: bool) -> dict:
    """One setting in a fresh process, so the other's allocations cannot show in its figures.

    A setting that fails gets its status ('OOM', 'timeout', 'error: ...') and no figures.
    """
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", str(result), "--model", args.model, "--flavor", args.flavor,
               "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
               "--device", args.device]
        if args.simulate_oom:
            cmd += ["--simulate-oom", args.simulate_oom]
        if offload:
            cmd.append("--offload")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        returncode, output = run_job(cmd, cwd=REPO, env=env, timeout=args.timeout)
        status, detail = classify(returncode, output, read_reports([f"{result}.failed"]))
        if status == TIMEOUT:
            detail = f"ran past {args.timeout} s"
        if status == OK and not result.exists():
            status, detail = "error: no result written", "no result written"
        if status != OK:
            if status != OOM:
                sys.stderr.write(output[-8000:])
            print(f"{SETTINGS[offload]}: {status}{f' ({detail})' if status == OOM else ''}", file=sys.stderr)
            return dict(dict.fromkeys(COLUMNS, ""), offload=offload, status=status, detail=detail)
        return dict(json.loads(result.read_text()), status=OK, detail="")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        offload = "--offload" in argv
        args = parse_args([a for a in argv if a != "--offload"])
        try:
            Path(args.worker).write_text(json.dumps(worker(args, offload)))
        except BaseException as e:
            if write_report(f"{args.worker}.failed", e):
                print(f"{SETTINGS[offload]}: out of memory: {e}", file=sys.stderr, flush=True)
                return OOM_EXIT
            raise
        return 0
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("reference_offload: cannot measure device memory, there is no CUDA device here. "
              "[reference_model] offload is a no-op when training on CPU: the reference's weights "
              "already live in host memory, so there is nothing to move and nothing to save.")
        return 0
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2: the first step is warm-up")

    rows = [launch(args, offload) for offload in (False, True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "reference_offload.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    results_md.write(path, **TABLES["reference_offload"])

    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (RSS; offload does nothing)"
    print(f"{args.model} {args.flavor}, batch {args.batch} x seq {args.seq}, {where}")
    shown = COLUMNS[:-1]
    print(" | ".join(f"{c:>19}" for c in shown))
    for r in rows:
        print(" | ".join(f"{r[c]:>19.3f}" if isinstance(r[c], float) else f"{str(r[c]).split(':')[0]:>19}"
                         for c in shown))
    off, on = rows
    if off["status"] == on["status"] == OK:
        print(f"resting memory drop: {off['resting_gib'] - on['resting_gib']:.3f} GiB "
              f"(reference weights: {off['ref_weights_gib']:.3f} GiB); "
              f"step peak drop: {off['step_peak_gib'] - on['step_peak_gib']:.3f} GiB; "
              f"step time: {on['step_time_s'] / off['step_time_s']:.2f}x; CSV: {path}")
    else:
        for r in rows:
            if r["status"] != OK:
                print(f"{SETTINGS[r['offload']]}: {r['status'].split(':')[0]}: {r['detail']}")
        print(f"no comparison: a setting did not finish; CSV: {path}")
    # an OOM is a result; an error means the benchmark itself is broken
    return 1 if any(r["status"].startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
