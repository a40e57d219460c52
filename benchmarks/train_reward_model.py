"""Train a reward model for the SmolLM2 sums task: SmolLM2-135M-Instruct's backbone plus a score head, taught to tell
right replies from wrong ones, saved as a transformers `LlamaForSequenceClassification` folder that
`[online] reward_funcs` takes (train_configs/smollm2_rm_cpu.toml).

1. Replies: the start weights sample 8 replies at temperature 1 (16 new tokens, the GRPO example's settings) to each
   of the first --prompts prompts of data/smollm2_sum_prompts.jsonl, with the plugin's own engine; the held-out file
   data/smollm2_sum_heldout.jsonl is never trained on. Each reply is labelled by plugin.example:sum_correct
   (1 if its last integer is the sum). Written replies join them (the sampled ones hold a few hundred of the form
   "a + b = c", which marks nearly every right one, while run-on working marks the wrong ones, so a model trained
   on them alone learns the form, not the sum): each sampled "a + b = c" with the other label's sum (hard
   negatives; --no-hard-negatives leaves them out), and for each prompt "a + b = c" with the right sum and
   --contrast wrong ones, slips of a digit or a carry (0: none). The sampled replies are kept in --replies for
   re-runs.
2. Model: plugin.model.reward_model's llama3 ScoreModel (what the plugin scores with), its trunk loaded from
   outputs/smollm2_135m, its score head from zero. The top --train-layers blocks, the final norm and the head
   train; the rest stays frozen (a 135M backbone on 2 cores: the forward of the frozen part dominates).
3. Input: what the plugin feeds it at GRPO time: the chat template's render of prompt + reply, no generation
   prompt, the score at its last token (ChatML's "\\n" after <|im_end|>).
4. Loss: binary cross-entropy of the score as a logit, right replies weighed up to balance the classes; AdamW,
   --epochs over the replies in shuffled padding-free batches of --batch replies, autocast bf16 on the CPU.
5. Judged on replies the start weights sample to the held-out prompts: ROC AUC, the AUC among the replies of the
   form "a + b = c" alone (does it read the sum or the form?), balanced accuracy and accuracy at the 0 logit;
   also on the training replies.
Writes --out (config.json, model.safetensors, the tokenizer and template), and benchmarks/results/reward_model.csv
and .md (its figures and times).

Usage (about 17 minutes on 2 cores; 14 once the replies are kept):
    python -m plugin.convert_gguf --out outputs/smollm2_135m && python data/smollm2_data.py
    python benchmarks/train_reward_model.py --out outputs/smollm2_sums_rm
"""

import argparse
import json
import random
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import results_md

REPO = Path(__file__).resolve().parents[1]
HF = REPO / "outputs" / "smollm2_135m"
PROMPTS, HELDOUT = REPO / "data" / "smollm2_sum_prompts.jsonl", REPO / "data" / "smollm2_sum_heldout.jsonl"
RESULTS = REPO / "benchmarks" / "results"
STOP, G, NEW_TOKENS = 2, 8, 16  # <|im_end|>; the example's group size and reply budget
SUM_FORM = re.compile(r"\d+ \+ \d+ = \d+\.?")
def table(rows: list[dict]) -> list[dict]:
    """The figures the docs show: data, held-out discrimination, time."""
    pct = lambda v: f"{float(v):.1%}" if v not in ("", None) else "—"  # noqa: E731
    num = lambda v: f"{float(v):.3f}" if v not in ("", None) else "—"  # noqa: E731
    return [{"training replies (written)": f"{r['train_replies']} ({r.get('written_replies') or 0})",
             "held-out replies (right)": f"{r['heldout_replies']} ({pct(r['heldout_right_share'])})",
             "held-out AUC": num(r["heldout_auc"]),
             "AUC among \"a + b = c\" replies": num(r.get("heldout_same_form_auc")),
             "balanced accuracy": pct(r.get("heldout_balanced_accuracy")), "accuracy at 0": pct(r["heldout_accuracy"]),
             "sampling s": r["sample_s"], "training s": r["train_s"], "total s": r["total_s"]} for r in rows]


TABLES = {"reward_model": dict(script="train_reward_model.py --out outputs/smollm2_sums_rm", pick=table),
          "reward_model_v1": dict(script="train_reward_model.py --no-hard-negatives --contrast 0", pick=table)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "outputs" / "smollm2_sums_rm"), help="the reward model's folder")
    p.add_argument("--prompts", type=int, default=1024, help="training prompts (the file's first), 8 replies each")
    p.add_argument("--heldout", type=int, default=256, help="held-out prompts judged (the file's first)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=32, help="replies per optimizer step")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--train-layers", type=int, default=8, help="top transformer blocks trained (of 30)")
    p.add_argument("--no-hard-negatives", dest="hard_negatives", action="store_false",
                   help="train on the sampled replies only (the RM then pays the form \"a + b = c\", right or not)")
    p.add_argument("--contrast", type=int, default=2,
                   help="written wrong replies \"a + b = c\" per training prompt, with its right one (0: none)")
    p.add_argument("--replies", default=str(REPO / "outputs" / "smollm2_sums_rm_replies.json"),
                   help="the sampled, labelled replies, kept for re-runs with the same --prompts, --heldout, --seed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=str(RESULTS / "reward_model.csv"))
    return p.parse_args(argv)


def rows(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def sample_replies(prompts: list[dict], chat, tokenizer, seed: int) -> list[dict]:
    """G replies per prompt from the start weights, each with the ids the plugin scores and its label."""
    from engine_speed import load_model

    from plugin.data.online import sample_key
    from plugin.example import sum_correct
    from plugin.generation.engine import build_sampler

    policy = load_model()
    sampler = build_sampler(policy, kv_cache=True, max_new_tokens=NEW_TOKENS, stop_ids=[STOP], temperature=1.0,
                            pad_id=STOP, max_num_seqs=256)
    prompt_ids = [tokenizer.encode(chat.render(p["prompt"]), add_bos=False, add_eos=False) for p in prompts]
    ids = [p for p in prompt_ids for _ in range(G)]
    keys = [sample_key(seed, 0, i, m) for i in range(len(prompts)) for m in range(G)]
    out = []
    for start in range(0, len(ids), 512):
        samples = sampler.generate(ids[start:start + 512], keys[start:start + 512])
        out += samples.completions
    del policy, sampler
    return [labelled(prompts[i // G], tokenizer.decode(c[:-1] if c and c[-1] == STOP else c), chat, tokenizer,
                     sum_correct) for i, c in enumerate(out)]


def hard_negatives(replies: list[dict], prompts: list[dict], chat, tokenizer, seed: int) -> list[dict]:
    """For each sampled reply of the form "a + b = c", its twin with the other label: a right one gets a wrong sum
    (c + d, 1 <= |d| <= 10), a wrong one the right sum. The sampled replies alone teach the form, not the sum: right
    replies are nearly all "a + b = c" and wrong ones mostly run on (docs/reward_models.md)."""
    from plugin.example import sum_correct

    by_question = {p["prompt"][-1]["content"]: p for p in prompts}
    rng, out = random.Random(seed), []
    for r in replies:
        m = SUM_FORM.fullmatch(r["reply"].strip())
        if not m:
            continue
        p = by_question[r["prompt"]]
        a, b = (int(x) for x in re.findall(r"\d+", r["reply"])[:2])
        c = a + b + rng.choice([d for d in range(-10, 11) if d]) if r["label"] else p["answer"]
        twin = f"{a} + {b} = {c}"
        out.append(labelled(p, twin, chat, tokenizer, sum_correct))
    return out


# the slips of a model that adds two 2-digit numbers: a digit off, a carry lost or added
SLIPS = (-11, -10, -9, -1, 1, 9, 10, 11)


def contrast(prompts: list[dict], chat, tokenizer, seed: int, per_prompt: int) -> list[dict]:
    """Written replies of the form "a + b = c" for each training prompt: the right sum once, and `per_prompt` wrong
    ones, each a slip (SLIPS) or another sum off by 2..20. The sampled replies hold a few hundred of that form;
    these teach the model to read the sum, not the form."""
    from plugin.example import sum_correct

    rng, out = random.Random(seed + 1), []
    for p in prompts:
        a, b = (int(x) for x in re.findall(r"\d+", p["prompt"][-1]["content"])[:2])
        wrong = set()
        while len(wrong) < per_prompt:
            d = rng.choice(SLIPS) if rng.random() < 0.7 else rng.choice([d for d in range(-20, 21) if abs(d) > 1])
            if a + b + d >= 0:
                wrong.add(a + b + d)
        for c in [a + b, *sorted(wrong)]:
            out.append(labelled(p, f"{a} + {b} = {c}", chat, tokenizer, sum_correct))
    return out


def labelled(p: dict, text: str, chat, tokenizer, sum_correct) -> dict:
    """A reply to prompt row `p` with its label and the ids the plugin scores (the render of prompt + reply)."""
    messages = [{"role": "assistant", "content": text}]
    label = sum_correct([p["prompt"]], [messages], answer=[p["answer"]])[0]
    rendered = chat.render(p["prompt"] + messages, add_generation_prompt=False)
    return dict(prompt=p["prompt"][-1]["content"], reply=text, label=label,
                ids=tokenizer.encode(rendered, add_bos=False, add_eos=False))


def build_reward_model(train_layers: int):
    """The plugin's llama3 ScoreModel at SmolLM2's shape, its trunk SmolLM2's weights, the head zero."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torchtitan.protocols.train_spec import get_train_spec

    from plugin.model.reward_model import HEAD, model_args, score_model_cls
    from plugin.scoring.logprobs import Scoring

    config = json.loads((HF / "config.json").read_text())
    args = model_args(config, "llama3", "SmolLM2")
    with torch.device("meta"):
        model = score_model_cls(get_train_spec("llama3").model_cls, "llama3")(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    adapter = get_train_spec("grpo_llama3").state_dict_adapter(args, str(HF))
    trunk = {k: v for k, v in get_model_state_dict(model).items() if k != HEAD}
    hf = adapter.to_hf(trunk)
    dcp.load(hf, storage_reader=adapter.get_hf_storage_reader(str(HF)))
    set_model_state_dict(model, adapter.from_hf(hf), options=StateDictOptions(strict=False))
    model.configure(Scoring(), padding_free=True)
    model.requires_grad_(False)
    layers = list(model.layers.values())
    for module in [*layers[len(layers) - train_layers:], model.norm, model.reward_head]:
        module.requires_grad_(True)
    return model, args, adapter


@torch.no_grad()
def scores(model, replies: list[dict], batch: int = 64) -> list[float]:
    from plugin.model.reward_model import packed_row

    model.eval()
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for s in range(0, len(replies), batch):
            out += model(*packed_row([r["ids"] for r in replies[s:s + batch]])).tolist()
    return out


def auc(scores_: list[float], labels: list[float]) -> float:
    """ROC AUC: the chance that a right reply outscores a wrong one (ties half)."""
    pos = [a for a, b in zip(scores_, labels) if b == 1]
    neg = [a for a, b in zip(scores_, labels) if b == 0]
    if not pos or not neg:  # undefined (a small smoke run)
        return float("nan")
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def judge(model, replies: list[dict]) -> dict:
    """Accuracy at the 0 logit, balanced accuracy (the mean of the right and the wrong replies' hit rates), ROC AUC,
    the AUC among replies of the start model's usual form "a + b = c" alone (does it check the sum, or the form?),
    and the share of right replies."""
    s, y = scores(model, replies), [r["label"] for r in replies]
    def hit(label):  # the hit rate of the replies with this label; NaN where there are none (a small smoke run)
        picked = [(a > 0) == (label == 1) for a, b in zip(s, y) if b == label]
        return statistics.mean(picked) if picked else float("nan")

    form = [i for i, r in enumerate(replies) if SUM_FORM.fullmatch(r["reply"].strip())]
    return dict(accuracy=sum((a > 0) == (b == 1) for a, b in zip(s, y)) / len(y), auc=auc(s, y),
                balanced_accuracy=(hit(1) + hit(0)) / 2, same_form_auc=auc([s[i] for i in form], [y[i] for i in form]),
                same_form_share=len(form) / len(y), right_share=sum(y) / len(y), scores=s)


def train(model, replies: list[dict], args) -> list[float]:
    from plugin.model.reward_model import packed_row

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    right = sum(r["label"] for r in replies)
    pos_weight = torch.tensor((len(replies) - right) / max(1, right))  # balance the classes
    rng, losses = random.Random(args.seed), []
    steps = args.epochs * (len(replies) // args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / steps)
    model.train()
    for epoch in range(args.epochs):
        order = list(range(len(replies)))
        rng.shuffle(order)
        for s in range(0, len(order) - args.batch + 1, args.batch):
            batch = [replies[i] for i in order[s:s + args.batch]]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(*packed_row([r["ids"] for r in batch]))
            labels = torch.tensor([r["label"] for r in batch])
            loss = F.binary_cross_entropy_with_logits(logits, labels, pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if len(losses) % 10 == 0:
                print(f"  epoch {epoch + 1}, step {len(losses)}/{steps}: loss {sum(losses[-10:]) / 10:.4f}",
                      file=sys.stderr, flush=True)
    return losses


def save(model, adapter, out: Path) -> None:
    """A transformers LlamaForSequenceClassification folder: SmolLM2's config and tokenizer, the trunk's weights under
    HF names, `score.weight`."""
    from safetensors.torch import save_file

    from plugin.model.reward_model import HEAD, SCORE

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach() for k, v in model.state_dict().items() if k != HEAD and "freqs_cis" not in k}
    hf = {**adapter.to_hf(state), SCORE: model.reward_head.weight.detach()}
    save_file({k: v.contiguous().float() for k, v in hf.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((HF / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0}, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (HF / name).is_file():
            shutil.copy(HF / name, out / name)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    import plugin  # noqa: F401  registers the GRPO models
    from plugin.data.chat import ChatTemplate

    if not (HF / "config.json").is_file():
        sys.exit(f"{HF} is missing: python -m plugin.convert_gguf --out outputs/smollm2_135m")
    chat, tokenizer = ChatTemplate.from_folder(str(HF)), HuggingFaceTokenizer(str(HF))
    t0 = time.perf_counter()
    train_prompts = rows(PROMPTS, args.prompts)
    cache, key = Path(args.replies), dict(prompts=args.prompts, heldout=args.heldout, seed=args.seed)
    saved = json.loads(cache.read_text()) if cache.is_file() else {}
    if saved.get("key") == key:
        train_replies, heldout_replies, t_sample = saved["train"], saved["heldout"], saved["sample_s"]
        print(f"replies read from {cache} (sampled in {t_sample:.0f} s)", file=sys.stderr, flush=True)
    else:
        train_replies = sample_replies(train_prompts, chat, tokenizer, args.seed)
        heldout_replies = sample_replies(rows(HELDOUT, args.heldout), chat, tokenizer, args.seed + 1000)
        t_sample = time.perf_counter() - t0
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(dict(key=key, train=train_replies, heldout=heldout_replies, sample_s=t_sample)))
    sampled = len(train_replies)
    if args.hard_negatives:
        train_replies = train_replies + hard_negatives(train_replies, train_prompts, chat, tokenizer, args.seed)
    if args.contrast:
        train_replies = train_replies + contrast(train_prompts, chat, tokenizer, args.seed, args.contrast)
    print(f"{sampled} sampled training replies ({sum(r['label'] for r in train_replies[:sampled]) / sampled:.1%} "
          f"right), {len(train_replies) - sampled} written ones, {len(heldout_replies)} held-out replies",
          file=sys.stderr, flush=True)
    model, model_args_, adapter = build_reward_model(args.train_layers)
    before = judge(model, heldout_replies)
    t1 = time.perf_counter()
    losses = train(model, train_replies, args)
    t_train = time.perf_counter() - t1
    on_train, on_heldout = judge(model, train_replies), judge(model, heldout_replies)
    save(model, adapter, Path(args.out))
    row = dict(written_replies=len(train_replies) - sampled, train_replies=len(train_replies),
               train_right_share=round(on_train["right_share"], 4),
               heldout_replies=len(heldout_replies), heldout_right_share=round(on_heldout["right_share"], 4),
               train_accuracy=round(on_train["accuracy"], 4), train_auc=round(on_train["auc"], 4),
               heldout_accuracy=round(on_heldout["accuracy"], 4), heldout_auc=round(on_heldout["auc"], 4),
               heldout_balanced_accuracy=round(on_heldout["balanced_accuracy"], 4),
               heldout_same_form_share=round(on_heldout["same_form_share"], 4),
               heldout_same_form_auc=round(on_heldout["same_form_auc"], 4),
               heldout_auc_untrained=round(before["auc"], 4), epochs=args.epochs, batch=args.batch, lr=args.lr,
               train_layers=args.train_layers, first_loss=round(sum(losses[:10]) / 10, 4),
               last_loss=round(sum(losses[-10:]) / 10, 4), sample_s=round(t_sample), train_s=round(t_train),
               total_s=round(time.perf_counter() - t0), threads=args.threads)
    results_md.write_csv(Path(args.results), [row], list(row), **TABLES["reward_model"])
    # the wrong held-out replies it pays most: what GRPO could learn to exploit
    paid = sorted((s, r["prompt"], r["reply"])
                  for s, r in zip(on_heldout["scores"], heldout_replies) if r["label"] == 0)
    print("wrong held-out replies it scores highest:", *[f"  {s:+.2f}  {p!r} -> {r!r}" for s, p, r in paid[-8:]],
          sep="\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
