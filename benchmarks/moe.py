"""The MoE policy on CPU: its online GRPO step against a dense model of equal active parameters, and how far the
sampler's routing and log-probs are from the trainer's with and without routing replay ([moe] router_replay).

Pairs (grpo_qwen3 flavors; the dense twin is the MoE flavor's args with moe_enabled off and hidden_dim =
top_k x moe_inter_dim, so its FFN holds exactly the parameters a token's experts use; the MoE model's only extra
active parameters are its routers, dim x num_experts per layer):
    small   debugmodel_moe_small (8 experts of 64, top 2, 4 layers of dim 128) against its twin (hidden_dim 128)
    debug   torchtitan's debugmodel_moe (64 experts of 768, top 8, 8 layers of dim 256) against its twin
            (hidden_dim 6,144): 6x the total parameters for the same active ones, where memory follows the total
Variants: dense (the twin), moe (router_replay none), moe_r3 (router_replay R3: the training passes route each token
to the experts the sampler chose when it drew it).

Each job is train_configs/online_cpu.toml (4 prompts x 8 completions, 6 new tokens, 1 update per batch) on
grpo_qwen3, FSDP over 2 gloo ranks (one OpenMP thread each), random init, checkpoint off. Its custom_import is this
file: it registers the twins and a reward that moves a random policy (`even_tokens`: the share of even token ids in
a completion; the compare task's exact match is 0 for every random completion, so no gradient would flow).

Simplifications:
1. bf16 parameters (FSDP's MixedPrecisionPolicy, fp32 reduce) by default: the sampler's decode steps and the
   trainer's full-sequence pass then round differently, as they do in real runs, and near-tied routers pick other
   experts. In fp32 on these layouts both passes route alike (mismatch ~1e-7, agreement 1.0): --precision float32.
2. Step time is torchtitan's time_metrics/end_to_end(s) (generation included; the plugin's
   online/generation_time(s) is the generation's part) and rank 0's CPU seconds per step (step_time.py's clock:
   it moves much less than wall time with other jobs on the machine); memory is memory/max_active(GiB), on CPU rank
   0's peak RSS during the training step, the process's own ~0.6 GiB of libraries included. The first --warmup
   steps of each job are left out.
3. A shared CPU is noisy: variants run interleaved, rounds in rotated order, each round with its own seed
   ([debug] seed = round); a ratio to dense is taken within a round and the table gives the median over rounds.
4. online/logprob_mismatch is the mean |sampler log-prob - trainer log-prob| per completion token at the batch's
   first training pass; moe/routing_agreement (R3 only) the share of replayed (token, layer, slot) experts that
   the trainer's router would have chosen itself, so 1 - agreement is also how often the unreplayed run's trainer
   routes otherwise at step 1. Means over all steps and rounds; at step 1 moe and moe_r3 score the same
   completions of the same weights, so their step-1 ratio is replay's effect, paired.

Usage: python benchmarks/moe.py [--pairs small,debug] [--rounds 3] [--steps 10] [--debug-rounds 2] [--debug-steps 4]
About 6 minutes on 2 quiet cores (10 with other jobs running); --smoke (the small pair, one round of 3 steps) ~40 s.
Writes <out>/moe.csv (one row per job and step), .png and .md (default benchmarks/results/) and prints the table.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_md
from harness import REPO
from job_status import read_scalars, run_job
from step_time import CPU_TAG

CONFIG = "train_configs/online_cpu.toml"
RANKS = 2
PAIRS = {"small": "debugmodel_moe_small", "debug": "debugmodel_moe"}
VARIANTS = ("dense", "moe", "moe_r3")
REPLAY = {"dense": "none", "moe": "none", "moe_r3": "R3"}
COLUMNS = ("pair", "variant", "flavor", "router_replay", "precision", "round", "step", "timed", "total_params",
           "active_params", "step_s", "cpu_s", "generation_s", "train_s", "max_active_gib", "generation_peak_gib",
           "logprob_mismatch", "routing_agreement", "router_entropy", "reward_mean")


def twin(moe_flavor: str) -> str:
    return f"{moe_flavor}_dense_twin"


def register_twins() -> None:
    """Each PAIRS flavor's dense twin, in grpo_qwen3's flavors of this process."""
    import plugin  # noqa: F401  registers grpo_qwen3 (and is what the config's own custom_import would give)
    from torchtitan.protocols.train_spec import get_train_spec

    flavors = get_train_spec("grpo_qwen3").model_args
    for name in PAIRS.values():
        # the rest as the MoE flavor has it: debugmodel_moe(_small) leave the output untied from the embedding,
        # unlike the dense debug flavors (262,144 more parameters on the small pair)
        args = flavors[name]
        flavors[twin(name)] = dataclasses.replace(args, moe_enabled=False,
                                                  hidden_dim=args.moe_args.top_k * args.moe_inter_dim)


def even_tokens(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """The share of even token ids in each completion: a reward that differs within a group of random draws."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def param_counts(flavor: str) -> tuple[int, int]:
    """(total, active) parameters of a grpo_qwen3 flavor: active counts top_k / num_experts of the experts' weights."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("grpo_qwen3")
    args = spec.model_args[flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    share = args.moe_args.top_k / args.moe_args.num_experts if args.moe_enabled else 0.0
    return total, total - experts + round(experts * share)


def run_variant(args, pair: str, variant: str, precision: str, rnd: int, steps: int, dump: Path, env: dict) -> list[dict]:
    """One online job; its per-step rows (the warm-up steps too, `timed` False)."""
    flavor = PAIRS[pair] if variant != "dense" else twin(PAIRS[pair])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0", "-m", "torchtitan.train",
           "--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--experimental.custom_import", "moe",
           "--model.name", "grpo_qwen3", "--model.flavor", flavor, "--parallelism.tensor_parallel_degree", "1",
           "--parallelism.data_parallel_shard_degree", str(RANKS), "--training.mixed_precision_param", precision,
           "--training.steps", str(steps), "--checkpoint.no-enable", "--debug.seed", str(rnd),
           "--online.reward_funcs", "moe:even_tokens", "--moe.router_replay", REPLAY[variant]]
    code, out = run_job(cmd, env=env, cwd=REPO, timeout=args.timeout)
    if code != 0:
        sys.stderr.write(out[-6000:])
        raise RuntimeError(f"{pair} {variant} {precision}: the job {'timed out' if code is None else f'exited {code}'}")
    total, active = param_counts(flavor)
    rows = []
    for step, tags in sorted(read_scalars(dump).items()):
        get = lambda key: round(tags[key], 9) if key in tags else ""  # noqa: E731
        end_to_end, gen = tags["time_metrics/end_to_end(s)"], tags["online/generation_time(s)"]
        rows.append(dict(pair=pair, variant=variant, flavor=flavor, router_replay=REPLAY[variant], precision=precision,
                         round=rnd, step=step, timed=step > args.warmup, total_params=total, active_params=active,
                         step_s=round(end_to_end, 4), cpu_s=round(tags[CPU_TAG], 4), generation_s=round(gen, 4),
                         train_s=round(end_to_end - gen, 4),
                         max_active_gib=round(tags["memory/max_active(GiB)"], 4),
                         generation_peak_gib=round(tags["online/generation_peak_memory(GiB)"], 4),
                         logprob_mismatch=get("online/logprob_mismatch"),
                         routing_agreement=get("moe/routing_agreement"), router_entropy=get("moe/router_entropy"),
                         reward_mean=get("grpo/reward_mean")))
    return rows


def plan(args) -> list[tuple[str, int, int]]:
    """(pair, rounds, steps) in the order they run."""
    out = []
    for pair in args.pairs.split(","):
        if pair not in PAIRS:
            raise SystemExit(f"--pairs: unknown pair {pair!r} (known: {', '.join(PAIRS)})")
        big = pair == "debug"
        out.append((pair, args.debug_rounds if big else args.rounds, args.debug_steps if big else args.steps))
    return out


def run(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe_bench_") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or RANKS) // RANKS)),
               "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO / "benchmarks"), str(REPO),
                                                           os.environ.get("PYTHONPATH"))))}
        for pair, rounds, steps in plan(args):
            for r in range(rounds):
                for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:  # rotated order
                    start = time.perf_counter()
                    got = run_variant(args, pair, variant, args.precision, r, steps,
                                      Path(tmp) / f"{pair}_{variant}_{r}", env)
                    rows += got
                    timed = [x for x in got if x["timed"]]
                    mismatch = [x["logprob_mismatch"] for x in got if x["logprob_mismatch"] != ""]
                    print(f"{pair} {args.precision} round {r} {variant}: median step "
                          f"{statistics.median(x['step_s'] for x in timed):.3f} s, "
                          f"peak {max(x['max_active_gib'] for x in timed):.3f} GiB, "
                          f"mismatch {statistics.mean(mismatch):.2e}, job {time.perf_counter() - start:.0f} s", flush=True)
    return rows


NUMBERS = COLUMNS[COLUMNS.index("total_params"):]


def _ratio(key: str, mine: dict, base: dict) -> dict:
    """Per round mine / base: the median over rounds and the range."""
    ratios = [mine[k] / base[k] for k in mine if k in base]
    return {key + "_ratio": statistics.median(ratios) if ratios else None,
            key + "_range": f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""}


def summary(rows: list[dict]) -> list[dict]:
    """Per pair, precision and variant: medians over the timed steps, ratios to dense within each round (median over
    rounds), mismatch and agreement over all steps. Rows as written to, or read from, the CSV."""
    num = lambda v: float(v) if v not in ("", None) else None  # noqa: E731
    rows = [{**r, **{k: num(r[k]) for k in NUMBERS}, "round": int(r["round"]), "step": int(r["step"]),
             "timed": r["timed"] in (True, "True")} for r in rows]
    out = []
    keys = dict.fromkeys((r["pair"], r["precision"], r["variant"]) for r in rows)
    for pair, precision, variant in keys:
        sel = [r for r in rows if (r["pair"], r["precision"], r["variant"]) == (pair, precision, variant)]
        dense = [r for r in rows if (r["pair"], r["precision"], r["variant"]) == (pair, precision, "dense")]
        rounds = sorted({r["round"] for r in sel})

        def per_round(rs, key, how=statistics.median):
            return {k: how([r[key] for r in rs if r["round"] == k and r["timed"]]) for k in rounds}

        figures = {}
        for key, how in (("step_s", statistics.median), ("cpu_s", statistics.median), ("train_s", statistics.median),
                         ("generation_s", statistics.median), ("max_active_gib", max)):
            mine, base = per_round(sel, key, how), per_round(dense, key, how) if dense else {}
            figures[key] = statistics.median(mine.values())
            figures.update(_ratio(key, mine, base))
        mismatch = [r["logprob_mismatch"] for r in sel if r["logprob_mismatch"] is not None]
        # step 1 of a round: the pair's variants share its seed, so moe and moe_r3 score the same weights' same
        # completions there (later steps follow differently routed updates): replay's effect, paired
        first = {r["round"]: r["logprob_mismatch"] for r in sel if r["step"] == 1}
        unreplayed = {r["round"]: r["logprob_mismatch"] for r in rows if r["step"] == 1
                      and (r["pair"], r["precision"], r["variant"]) == (pair, precision, "moe")}
        figures.update(_ratio("first", first, unreplayed if variant == "moe_r3" else {}))
        agreement = [r["routing_agreement"] for r in sel if r["routing_agreement"] is not None]
        out.append(dict(pair=pair, precision=precision, variant=variant, flavor=sel[0]["flavor"],
                        replay=sel[0]["router_replay"], total=int(sel[0]["total_params"]),
                        active=int(sel[0]["active_params"]), rounds=len(rounds), **figures,
                        mismatch=statistics.mean(mismatch) if mismatch else None,
                        mismatch_max=max(mismatch) if mismatch else None,
                        mismatch_first=statistics.mean(first.values()),
                        agreement=statistics.mean(agreement) if agreement else None,
                        agreement_min=min(agreement) if agreement else None))
    return out


def table_rows(rows: list[dict]) -> list[dict]:
    """The Markdown table: one line per pair, precision and variant."""
    out = []
    for t in summary(rows):
        dense = t["variant"] == "dense"
        ratio = lambda key: f"{t[key + '_ratio']:.2f} ({t[key + '_range']})" if t[key + "_ratio"] is not None else "-"  # noqa: E731
        out.append({"pair": t["pair"], "precision": t["precision"],
                    "model (router_replay)": t["flavor"] if dense else f"{t['flavor']} ({t['replay']})",
                    "params total / active (M)": f"{t['total'] / 1e6:.2f} / {t['active'] / 1e6:.2f}",
                    "step (s)": f"{t['step_s']:.3f}", "step / dense": "-" if dense else ratio("step_s"),
                    "CPU s / dense": "-" if dense else ratio("cpu_s"),
                    "generation / dense": "-" if dense else ratio("generation_s"),
                    "peak memory (GiB)": f"{t['max_active_gib']:.3f}",
                    "memory / dense": "-" if dense else ratio("max_active_gib"),
                    "log-prob mismatch (max)": f"{t['mismatch']:.2e} ({t['mismatch_max']:.2e})",
                    "at step 1": f"{t['mismatch_first']:.3e}",
                    "at step 1, R3 / none": ratio("first"),
                    "routing agreement (min)": f"{t['agreement']:.4f} ({t['agreement_min']:.4f})"
                    if t["agreement"] is not None else "-"})
    return out


# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {"moe": dict(script="moe.py", pick=table_rows)}


def plot(rows: list[dict], table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ratio, ax_mis, ax_agree) = plt.subplots(1, 3, figsize=(15, 4.2))
    moe = [t for t in table if t["variant"] == "moe"]
    x = range(len(moe))
    bars = (("step_s", "step, wall"), ("cpu_s", "step, rank 0 CPU s"), ("generation_s", "generation, wall"),
            ("max_active_gib", "peak memory"))
    for i, (key, label) in enumerate(bars):
        ax_ratio.bar([j + 0.2 * (i - 1.5) for j in x], [t[key + "_ratio"] for t in moe], width=0.2, label=label)
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_xticks(list(x), [f"{t['pair']} {t['precision']}\n{t['total'] / t['active']:.1f}x total params"
                                  for t in moe], fontsize=8)
    ax_ratio.set_ylabel("MoE / dense twin (equal active params)")
    ax_ratio.set_title("time and memory, median over rounds", fontsize=10)
    ax_ratio.legend(fontsize=8)
    for t in table:  # per step, mean over rounds; the dense twins' mismatch is bf16's rounding alone
        sel = [r for r in rows if (r["pair"], r["precision"], r["variant"]) == (t["pair"], t["precision"], t["variant"])]
        steps = sorted({int(r["step"]) for r in sel})
        label = f"{t['pair']} {t['precision']} {t['variant']}"
        for ax, key in ((ax_mis, "logprob_mismatch"), (ax_agree, "routing_agreement")):
            values = [[float(r[key]) for r in sel if int(r["step"]) == s and r[key] != ""] for s in steps]
            if any(values):
                ax.plot(steps, [statistics.mean(v) for v in values], marker=".", label=label)
    ax_mis.set_yscale("log")
    ax_mis.set_ylabel("mean |sampler - trainer| log-prob per token")
    ax_agree.set_ylabel("share of the sampler's experts the trainer's router picks")
    for ax, title in ((ax_mis, "log-prob mismatch"), (ax_agree, "routing agreement (router_replay R3)")):
        ax.set_xlabel("step")
        ax.set_title(title + ", mean over rounds", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle("grpo_qwen3 online GRPO on CPU, FSDP over 2 ranks, random init", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", default="small,debug", help=f"comma list of {', '.join(PAIRS)}")
    p.add_argument("--precision", default="bfloat16", choices=("bfloat16", "float32"),
                   help="[training] mixed_precision_param of every job")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the small pair's variants")
    p.add_argument("--steps", type=int, default=10, help="online steps per job of the small pair")
    p.add_argument("--debug-rounds", type=int, default=2, help="rounds of the debug pair (its MoE jobs take ~1 min)")
    p.add_argument("--debug-steps", type=int, default=4, help="online steps per job of the debug pair")
    p.add_argument("--warmup", type=int, default=1, help="first steps of each job left out of time and memory")
    p.add_argument("--smoke", action="store_true", help="the small pair, one round of 3 steps: checks that it runs")
    p.add_argument("--timeout", type=int, default=600, help="seconds per job")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    if args.smoke:
        args.pairs, args.rounds, args.steps = "small", 1, 3
    if min(args.steps, args.debug_steps) <= args.warmup:
        p.error(f"--steps and --debug-steps must exceed --warmup {args.warmup}")
    register_twins()
    start = time.perf_counter()
    rows = run(args)
    out = Path(args.out)
    md = results_md.write_csv(out / "moe.csv", rows, COLUMNS, **TABLES["moe"])
    plot(rows, summary(rows), out / "moe.png")
    print(md.read_text())
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
else:  # imported by torchtitan as the jobs' custom_import, and by their reward loader (benchmarks/ is on PYTHONPATH);
    # importing step_time has added rank 0's CPU seconds per logged step (CPU_TAG) to the jobs' metrics
    register_twins()
