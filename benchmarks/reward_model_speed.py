"""What a reward model costs: seconds and memory to score 1,000 completions, at SmolLM2-135M's and Qwen3-0.6B's
shapes, against the function reward of the same work (plugin.example:sum_correct), on this machine's CPU.

Each shape is a random LlamaForSequenceClassification / Qwen3ForSequenceClassification folder written here (bf16
safetensors; only the time and memory matter, not what it pays), with SmolLM2's tokenizer and template. The work:
sums prompts of data/smollm2_sum_prompts.jsonl through the chat template, each with a reply of the start model's
kind ("20 + 13 = 33", a number, or working that runs on), about 50 tokens in all; scored through
plugin.model.reward_model.RewardModel.rewards on one rank, as a run scores a sampled batch (the first call, which
builds and loads the model, is not timed). Memory: the weights this rank holds, and the peak RSS above them while
scoring. fp32, and bf16 as a run with mixed_precision_param = "bfloat16" computes (autocast, fp32 weights).
The step's reward share of a real run is train_configs/smollm2_rm_cpu.toml's online/reward_share
(benchmarks/trl_parity.py's rm_learning_train.csv; docs/reward_models.md).

Usage (about 7 minutes on 2 cores):
    python -m plugin.convert_gguf --out outputs/smollm2_135m
    python benchmarks/reward_model_speed.py
Writes benchmarks/results/reward_model_speed.csv and .md.
"""

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import results_md
from harness import Memory, parse_config

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "outputs" / "smollm2_135m"
RESULTS = REPO / "benchmarks" / "results"
COLUMNS = ["shape", "dtype", "completions", "tokens_mean", "model_s_per_1000", "function_s_per_1000",
           "model_over_function", "weights_MiB", "scoring_peak_MiB", "threads"]
TABLES = {"reward_model_speed": dict(script="reward_model_speed.py", pick=None)}
QWEN3_06B = dict(architectures=["Qwen3ForSequenceClassification"], model_type="qwen3", hidden_size=1024,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu", id2label={"0": "LABEL_0"})
REPLIES = ["{a} + {b} = {s}", "{s}", "The answer is {s}.", "{a} + {b} = {s}. Now, {s} + 1 = {t}", "{t}"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="smollm2_135m,qwen3_0.6b")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--completions", type=int, default=128, help="completions per timed call (figures per 1,000)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", default=str(RESULTS / "reward_model_speed.csv"))
    return p.parse_args(argv)


def random_checkpoint(folder: Path, config: dict, names_and_shapes: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weights = {k: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)).to(torch.bfloat16)
               for k, s in names_and_shapes.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF / name, folder / name)
    return folder


def hf_shapes(c: dict) -> dict:
    """The tensor names and shapes of a dense llama/qwen3 sequence-classification checkpoint."""
    d, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, f = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    out = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,), "score.weight": (1, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                    p + "post_attention_layernorm.weight": (d,)})
        if c["model_type"] == "qwen3":
            out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return out


def workload(n: int, tokenizer, chat):
    from plugin.data.prompts import Prompt

    rows = [json.loads(line) for line in (REPO / "data" / "smollm2_sum_prompts.jsonl").read_text().splitlines()[:n]]
    rng = random.Random(0)
    prompts, completions, ids = [], [], []
    for i, r in enumerate(rows):
        a, b = (int(x) for x in r["prompt"][-1]["content"].split("?")[0].split()[2::2])
        reply = rng.choice(REPLIES).format(a=a, b=b, s=a + b, t=a + b + 1)
        p_ids = tokenizer.encode(chat.render(r["prompt"]), add_bos=False, add_eos=False)
        prompts.append(Prompt(p_ids, r["prompt"], {"answer": r["answer"]}, f"prompts:{i + 1}"))
        completions.append([{"role": "assistant", "content": reply}])
        ids.append(tokenizer.encode(reply, add_bos=False, add_eos=False) + [2])
    return prompts, completions, ids


def run(args) -> list[dict]:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.distributed import ParallelDims

    from plugin.data.chat import ChatTemplate
    from plugin.example import sum_correct
    from plugin.job import GRPOJob

    torch.set_num_threads(args.threads)
    tokenizer, chat = HuggingFaceTokenizer(str(HF)), ChatTemplate.from_folder(str(HF))
    prompts, completions, ids = workload(args.completions, tokenizer, chat)
    tokens = statistics.mean(len(p.ids) + len(c) + 1 for p, c in zip(prompts, ids))
    smollm2 = {**json.loads((HF / "config.json").read_text()), "architectures": ["LlamaForSequenceClassification"],
               "id2label": {"0": "LABEL_0"}, "tie_word_embeddings": False}
    configs = {"smollm2_135m": smollm2, "qwen3_0.6b": QWEN3_06B}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            folder = random_checkpoint(Path(tmp) / shape, configs[shape], hf_shapes(configs[shape]))
            for dtype in args.dtypes.split(","):
                cfg = parse_config("--model.hf_assets_path", str(HF), "--parallelism.tensor_parallel_degree", "1",
                                   "--training.mixed_precision_param", dtype, "--online.reward_funcs", str(folder))
                job = GRPOJob.of(cfg)
                job.policy = torch.nn.Linear(1, 1)  # only its device is read
                job.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                                 world_size=1)
                model = job.reward_model(str(folder), "[online] reward_funcs[0]", cfg)
                model.rewards(prompts[:8], completions[:8], ids[:8], [2])  # builds and loads it
                times, fn_times, peaks = [], [], []
                memory = Memory(torch.device("cpu"))
                for _ in range(args.rounds):
                    base = memory.reset()
                    t = time.perf_counter()
                    model.rewards(prompts, completions, ids, [2])
                    times.append(time.perf_counter() - t)
                    peaks.append(memory.peak() - base)
                    t = time.perf_counter()
                    sum_correct([p.text for p in prompts], completions, ids,
                                answer=[p.columns["answer"] for p in prompts])
                    fn_times.append(time.perf_counter() - t)
                per = 1000 / len(prompts)
                row = dict(shape=shape, dtype=dtype, completions=len(prompts), tokens_mean=round(tokens, 1),
                           model_s_per_1000=round(min(times) * per, 2),
                           function_s_per_1000=round(min(fn_times) * per, 4),
                           model_over_function=round(min(times) / min(fn_times)),
                           weights_MiB=round(model.weights_bytes / 2**20, 1),
                           scoring_peak_MiB=round(min(peaks) / 2**20, 1), threads=args.threads)
                print(row, flush=True)
                out.append(row)
                del job, model
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    import plugin  # noqa: F401

    rows = run(args)
    results_md.write_csv(Path(args.results), rows, COLUMNS, **TABLES["reward_model_speed"])
    print(Path(args.results).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
