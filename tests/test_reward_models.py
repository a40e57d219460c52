"""Reward models in `[online] reward_funcs` (plugin.model.reward_model): tiny random transformers
`Qwen3ForSequenceClassification`, `LlamaForSequenceClassification` and `Qwen3MoeForSequenceClassification` checkpoints,
saved with save_pretrained next to the bundled tokenizer, scored by the plugin on torchtitan's models.

- Their scores equal transformers' on what TRL feeds them (the chat template's render of prompt + completion, or the
  text), within 1e-5 in fp32, for chat and plain prompts; one with another tokenizer than the policy's reads the
  decoded text; one that shares the policy's reads the sampled ids, which are the round trip's.
- 1 rank, FSDP=2 and TP=2 give the same scores (one spawn per layout, every checkpoint in it; a rank with no
  completions still joins its peers' forwards), and the MoE one with its experts over FSDP=2 x EP=2.
- A function + model list is weighed as documented; bad checkpoints stop at start-up, naming the entry.

Simplifications: the checkpoints are 2 layers of 64, vocabulary 2,048 (the bundled tokenizer's); the MoE one has 4
experts of 32, top 2, on torchtitan's fp32 for-loop (the CPU's choice, plugin.model.reward_model.model_args).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, build_model, ranks_result
from plugin.data.prompts import Prompt

TOKENIZER = REPO / "plugin/assets/tokenizer"
# ChatML's shape for the bundled tokenizer: the generation prompt is what precedes a reply's content, so a policy's
# prompt ids and sampled reply are a prefix of the render of the whole conversation
TEMPLATE = ("{% for m in messages %}<|begin_of_text|>{{ m.role }}\n{{ m.content }}<|end_of_text|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|begin_of_text|>assistant\n{% endif %}")
KINDS = ("qwen3", "llama", "qwen3_moe")


def hf_config(kind: str):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, tie_word_embeddings=False, num_labels=1, pad_token_id=0)
    if kind == "llama":  # 160 is not llama3's derived width (170): the args must reproduce it
        return LlamaConfig(**common, intermediate_size=160, rope_theta=10000.0, rms_norm_eps=1e-5),\
            "LlamaForSequenceClassification"
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, intermediate_size=128, rope_theta=1e6, rms_norm_eps=1e-6),\
            "Qwen3ForSequenceClassification"
    return Qwen3MoeConfig(**common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rope_theta=1e6,
                          rms_norm_eps=1e-6), "Qwen3MoeForSequenceClassification"


def save_checkpoint(folder: Path, kind: str, template: str | None = TEMPLATE, seed: int = 0) -> Path:
    """A random checkpoint of `kind` with the bundled tokenizer (and `template`), as transformers saves it."""
    import transformers

    config, arch = hf_config(kind)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # scores of order 1, and a router that tells experts apart (test_moe_hf says why)
        model.score.weight.mul_(50)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(10)
    model.save_pretrained(folder)
    shutil.copy(TOKENIZER / "tokenizer.json", folder)
    tok_config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    if template is not None:
        tok_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward_models")
    return {kind: save_checkpoint(root / kind, kind, seed=i) for i, kind in enumerate(KINDS)}


def oracle(folder: Path, prompts: list[Prompt], completions: list) -> list[float]:
    """transformers' scores of what TRL feeds a reward model (GRPOTrainer._calculate_rewards)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
    out = []
    for p, c in zip(prompts, completions):
        if isinstance(p.text, list):
            text = tok.apply_chat_template(p.text + c, tokenize=False)
        else:
            text = p.text + c
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


CHAT = [[{"role": "user", "content": "what is 2 + 3?"}], [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "add 10 and 32"}]]
REPLIES = ["5", "it is 42, I think", "forty two", ""]
PLAIN = ["Q: 7 + 8 =", "The sum of 1 and 2 is"]


def policy_tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(TOKENIZER))


def sampled(folder: Path, chat: bool) -> tuple[list[Prompt], list, list[list[int]], list[int]]:
    """Prompts as the policy reads them (rendered by the reward model's template, as a policy sharing it would) and
    completions as sampled: the reply's ids, then the stop id (the last one truncated, without)."""
    from plugin.data.chat import ChatTemplate

    tok = policy_tokenizer()
    stop = tok.token_to_id("<|end_of_text|>")
    chat_template = ChatTemplate.from_folder(str(folder))
    prompts, completions, ids = [], [], []
    for i, reply in enumerate(REPLIES):
        if chat:
            text = CHAT[i % 2]
            p_ids = tok.encode(chat_template.render(text), add_bos=False, add_eos=False)
        else:
            text = PLAIN[i % 2]
            p_ids = tok.encode(text, add_bos=False, add_eos=False)
        c_ids = tok.encode(reply, add_bos=False, add_eos=False) + ([] if i == 3 else [stop])
        prompts.append(Prompt(p_ids, text, {}, f"prompts.jsonl:{i + 1}"))
        completions.append([{"role": "assistant", "content": reply}] if chat else reply)
        ids.append(c_ids)
    return prompts, completions, ids, [stop]


def plugin_scores(folder: Path, prompts, completions, ids, stop_ids, *overrides: str, parallel_dims=None):
    from plugin.job import GRPOJob

    _, cfg, _, _ = build_model("--online.reward_funcs", str(folder), *overrides, parallel_dims=parallel_dims)
    model = GRPOJob.of(cfg).reward_model(str(folder), f"[online] reward_funcs[0] = {str(folder)!r}", cfg)
    return model, model.rewards(prompts, completions, ids, stop_ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_scores_equal_transformers(checkpoints, kind, chat):
    folder = checkpoints[kind]
    prompts, completions, ids, stops = sampled(folder, chat)
    model, scores = plugin_scores(folder, prompts, completions, ids, stops)
    assert not model.shares_tokenizer  # the policy's folder has no chat template: the decoded text is read
    expected = oracle(folder, prompts, completions)
    assert max(abs(a - b) for a, b in zip(scores, expected)) < 1e-5, (scores, expected)
    assert len(set(round(s, 3) for s in scores)) > 1  # the scores tell the completions apart


def test_a_tool_trajectory_is_part_of_the_completion_it_reads(checkpoints):
    """With [online] tools a completion is TRL's message list (assistant turn with its calls, the tool's answer, the
    final reply): the reward model reads all of it, rendered by its template, as transformers does."""
    folder = checkpoints["qwen3"]
    prompts, _, _, stops = sampled(folder, chat=True)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    trajectories = [[{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "add", "content": answer},
                     {"role": "assistant", "content": f"it is {answer}"}] for answer in ("5", "6", "5", "7")]
    ids = [[7, 8, stops[0], 9, 10, stops[0]]] * 4  # not read: the policy's folder is not the reward model's
    model, scores = plugin_scores(folder, prompts, trajectories, ids, stops)
    expected = oracle(folder, prompts, trajectories)
    assert max(abs(a - b) for a, b in zip(scores, expected)) < 1e-5
    assert scores[0] == pytest.approx(scores[2], abs=1e-6) and abs(scores[0] - scores[1]) > 1e-4  # the tool's answer counts


@pytest.mark.slow  # inductor compiles the blocks
def test_compiled_blocks_score_as_eager(checkpoints):
    """[compile] enable with the model component: torchtitan's parallelize compiles the reward model's blocks, as
    the reference's; the scores are eager's to fp32 rounding, and another call's lengths compile nothing new that
    fails."""
    folder = checkpoints["qwen3"]
    prompts, completions, ids, stops = sampled(folder, chat=True)
    _, eager = plugin_scores(folder, prompts, completions, ids, stops)
    compile_ = ("--compile.enable", "--compile.components", "model")
    model, compiled = plugin_scores(folder, prompts, completions, ids, stops, *compile_)
    assert type(next(iter(model.module.layers.values()))).__name__ == "OptimizedModule"
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert model.rewards(prompts[:3], completions[:3], ids[:3], stops) == pytest.approx(eager[:3], abs=1e-5)


LAYOUTS = {"fsdp2": (dict(dp_shard=2, tp=1), ("--parallelism.data_parallel_shard_degree", "2",
                                               "--parallelism.tensor_parallel_degree", "1")),
           "tp2": (dict(dp_shard=1, tp=2), ("--parallelism.data_parallel_shard_degree", "1",
                                            "--parallelism.tensor_parallel_degree", "2")),
           # the MoE checkpoint's experts split over the 2 FSDP ranks
           "fsdp2_ep2": (dict(dp_shard=2, tp=1, ep=2), ("--parallelism.data_parallel_shard_degree", "2",
                                                        "--parallelism.tensor_parallel_degree", "1",
                                                        "--parallelism.expert_parallel_degree", "2",
                                                        # EP is a layout of MoE policies
                                                        "--model.name", "grpo_qwen3",
                                                        "--model.flavor", "debugmodel_moe_small"))}
LAYOUT_KINDS = {"fsdp2": KINDS, "tp2": KINDS, "fsdp2_ep2": ("qwen3_moe",)}


def _layout_scores(rank: int, world_size: int, out: str, layout: str, folders: dict, inputs: dict):
    from torchtitan.distributed import ParallelDims

    dims, overrides = LAYOUTS[layout]
    pd = ParallelDims(**{"dp_replicate": 1, "cp": 1, "pp": 1, "ep": 1, "etp": 1, "world_size": 2, **dims})
    results = {}
    for kind, folder in folders.items():
        prompts, completions, ids, stops = inputs[kind]
        if layout.startswith("fsdp2") and rank == 1:  # a data-parallel rank with nothing to score joins the forwards
            prompts, completions, ids = [], [], []
        # 16 tokens a forward: several chunks, so the busier rank runs more forwards than its idle peer has rows for
        model, scores = plugin_scores(folder, prompts, completions, ids, stops, *overrides,
                                      "--online.reward_model_max_token_len", "16", parallel_dims=pd)
        results[kind] = scores
        if layout == "fsdp2_ep2":  # each rank holds 2 of the 4 experts
            assert model.module.layers["0"].moe.experts.w1.to_local().shape[0] == 2
        if layout == "fsdp2" and kind == "qwen3":
            # a completion past max_position_embeddings (512) on rank 0 only: both ranks stop, none waits
            from plugin.model.reward_model import RewardModelError

            long = [Prompt([1], "1 " * 600, {}, "prompts.jsonl:9")] if rank == 0 else []
            with pytest.raises(RewardModelError) as e:
                model.rewards(long, ["2"] * len(long), [[5]] * len(long), stops)
            assert ("prompts.jsonl:9 with its completion is" if rank == 0 else "another rank's completions") \
                in str(e.value), str(e.value)
        if layout.startswith("fsdp2") and rank == 1:
            assert scores == []
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_equal_across_layouts(checkpoints, tmp_path_factory, layout):
    kinds = LAYOUT_KINDS[layout]
    inputs = {kind: sampled(checkpoints[kind], chat=True) for kind in kinds}
    alone = {kind: plugin_scores(checkpoints[kind], *inputs[kind])[1] for kind in kinds}
    ranks = ranks_result(tmp_path_factory, layout, 2, _layout_scores, layout,
                         {k: checkpoints[k] for k in kinds}, inputs)
    for kind in kinds:
        assert max(abs(a - b) for a, b in zip(ranks[kind], alone[kind])) < 1e-5, (kind, ranks[kind], alone[kind])


def test_a_reward_model_with_the_policys_tokenizer_reads_the_sampled_ids(checkpoints):
    """The policy's folder is the reward model's (same tokenizer.json, same template): no decode/encode round trip,
    and on a tokenizer's own splits the ids are the round trip's, so the scores are transformers' on the text."""
    folder = checkpoints["qwen3"]
    for chat in (True, False):
        prompts, completions, ids, stops = sampled(folder, chat)
        model, scores = plugin_scores(folder, prompts, completions, ids, stops, "--model.hf_assets_path", str(folder))
        assert model.shares_tokenizer
        trip = [model.tokenizer.encode(model.chat.render(p.text + c, add_generation_prompt=False) if chat
                                       else p.text + c, add_bos=False, add_eos=False)
                for p, c in zip(prompts, completions)]
        assert model.inputs(prompts, completions, ids, stops) == trip
        expected = oracle(folder, prompts, completions)
        assert max(abs(a - b) for a, b in zip(scores, expected)) < 1e-5


def test_a_reward_model_with_another_tokenizer_reads_the_decoded_text(checkpoints, tmp_path):
    """A reward model whose tokenizer is not the policy's (a BPE of its own) encodes the text the policy's ids decode
    to, rendered with its own template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = Path(shutil.copytree(checkpoints["llama"], tmp_path / "other"))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is 2 + 3? add 10 and 32, it is 42, I think forty two be brief"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    prompts, completions, ids, stops = sampled(checkpoints["llama"], chat=True)
    model, scores = plugin_scores(folder, prompts, completions, ids, stops)
    assert not model.shares_tokenizer and model.tokenizer.get_vocab_size() <= 300
    assert max(abs(a - b) for a, b in zip(scores, oracle(folder, prompts, completions))) < 1e-5


def test_functions_and_models_are_weighed_together(checkpoints):
    """reward_funcs = [a function, a model], reward_weights = [0.5, 2]: the reward is 0.5 f + 2 m, each one's values
    under its own name (the folder's)."""
    from plugin.data.rewards import load_reward_fns, score_completions

    folder = checkpoints["qwen3"]
    prompts, completions, ids, stops = sampled(folder, chat=False)
    model, alone = plugin_scores(folder, prompts, completions, ids, stops)
    _, cfg, _, _ = build_model("--online.reward_funcs", f"reward_fns:length,{folder}")
    fns = load_reward_fns(["reward_fns:length", str(folder)], [0.5, 2.0], cfg)
    assert [f.name for f in fns] == ["length", "qwen3"] and fns[1].model is not None
    texts, totals, per_fn = score_completions(fns, None, policy_tokenizer(), stops, prompts, ids)
    assert texts == completions
    assert per_fn[0] == [float(len(c)) for c in ids]
    assert per_fn[1] == pytest.approx(alone, abs=1e-6)
    assert totals == pytest.approx([0.5 * len(c) + 2 * m for c, m in zip(ids, alone)], abs=1e-5)


def _without_score_head(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    weights = load_file(f)
    del weights["score.weight"]
    save_file(weights, f, metadata={"format": "pt"})


def _architecture(folder: Path, arch: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))


def _two_labels(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "id2label": {"0": "a", "1": "b"}}))


BAD = {
    "two labels": (_two_labels, "has 2 labels; a reward model has one"),
    "no score head": (_without_score_head, "no score head ('score.weight')"),
    "a causal LM": (lambda f: _architecture(f, "Qwen3ForCausalLM"), "architecture Qwen3ForCausalLM is not one"),
    "another family": (lambda f: _architecture(f, "MistralForSequenceClassification"),
                       "architecture MistralForSequenceClassification is not one"),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer.json"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_checkpoints_stop_at_start_up_naming_the_entry(checkpoints, tmp_path, bad):
    from plugin.data.rewards import load_reward_fns
    from plugin.model.reward_model import RewardModelError

    folder = Path(shutil.copytree(checkpoints["qwen3"], tmp_path / "rm"))
    spoil, message = BAD[bad]
    spoil(folder)
    _, cfg, _, _ = build_model("--online.reward_funcs", str(folder))
    with pytest.raises(RewardModelError) as e:
        load_reward_fns([str(folder)], [], cfg)
    assert f"[online] reward_funcs[0] = {str(folder)!r}" in str(e.value) and message in str(e.value), str(e.value)


def test_chat_prompts_need_the_reward_models_template(tmp_path):
    from plugin.data.rewards import load_reward_fns
    from plugin.model.reward_model import RewardModelError

    folder = save_checkpoint(tmp_path / "rm", "qwen3", template=None)
    _, cfg, _, _ = build_model("--online.reward_funcs", str(folder))
    (fn,) = load_reward_fns([str(folder)], [], cfg)
    fn.model.check_prompts([Prompt([1], "plain", {}, "p.jsonl:1")], "[training] dataset_path")  # text needs none
    with pytest.raises(RewardModelError, match=r"reward_funcs\[0\].*\[training\] dataset_path has conversational "
                                               r"prompts.*has none"):
        fn.model.check_prompts([Prompt([1], CHAT[0], {}, "p.jsonl:1")], "[training] dataset_path")


def test_an_entry_that_is_neither_a_function_nor_a_folder_is_refused(checkpoints):
    from plugin import config

    config.Online(reward_funcs=["m:f", str(checkpoints["qwen3"])])
    with pytest.raises(ValueError, match=r"\[online\] reward_funcs\[1\] = 'outputs/no_rm' must be .* or an existing "
                                         r"folder holding a reward model"):
        config.Online(reward_funcs=["m:f", "outputs/no_rm"])
