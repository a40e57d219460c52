import json
import re
from pathlib import Path

import pytest
from torchtitan.components.tokenizer import HuggingFaceTokenizer

import example_data  # data/, the script that writes the bundled files
import smollm2_data  # data/, the SmolLM2 example's prompt files
from plugin import example

REPO = Path(__file__).resolve().parents[1]
TRAIN_FILE = REPO / "data" / "arith_rollouts.jsonl"
HELDOUT_FILE = REPO / "data" / "arith_heldout.jsonl"


def read_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(str(example.TOKENIZER_DIR))


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("Q: 37+45=", " 82\n", 1.0),
        ("Q: 0+0=", " 0\n", 1.0),
        ("Q: 12-40=", " -28\n", 1.0),
        ("Q: 99+99=", " 198\n", 1.0),
        ("Q: 37+45=", " 83\n", 0.0),
        ("Q: 37+45=", " 28\n", 0.0),
        ("Q: 12-40=", " 28\n", 0.0),
        # Malformed: the right number in the wrong shape still scores 0.
        ("Q: 37+45=", " 82", 0.0),
        ("Q: 37+45=", "82\n", 0.0),
        ("Q: 37+45=", "  82\n", 0.0),
        ("Q: 37+45=", " 82 \n", 0.0),
        ("Q: 37+45=", " 82\n\n", 0.0),
        ("Q: 37+45=", "\t82\n", 0.0),
        ("Q: 37+45=", " 082\n", 0.0),
        ("Q: 0+0=", " -0\n", 0.0),
        ("Q: 37+45=", " +82\n", 0.0),
        ("Q: 37+45=", " 82 is the answer\n", 0.0),
        ("Q: 37+45=", " The answer is 82\n", 0.0),
        ("Q: 37+45=", " 82\nQ: 1+1= 2\n", 0.0),
        ("Q: 37+45=", " 82.0\n", 0.0),
        ("Q: 37+45=", "", 0.0),
    ],
)
def test_reward(prompt, completion, expected):
    assert example.reward(prompt, completion) == expected


def test_reward_rejects_foreign_prompt():
    with pytest.raises(ValueError):
        example.reward("Q: 3*4=", " 12\n")


def test_generate_rollouts_deterministic_and_grouped():
    rows = example_data.generate_rollouts(n_groups=50, group_size=5, seed=7)
    assert rows == example_data.generate_rollouts(n_groups=50, group_size=5, seed=7)
    assert rows != example_data.generate_rollouts(n_groups=50, group_size=5, seed=8)

    groups: dict[int, list[dict]] = {}
    for row in rows:
        assert set(row) == {"prompt", "completion", "reward", "group"}
        assert row["reward"] == example.reward(row["prompt"], row["completion"])
        groups.setdefault(row["group"], []).append(row)
    assert sorted(groups) == list(range(50))
    for members in groups.values():
        assert len(members) == 5
        assert len({m["prompt"] for m in members}) == 1
        assert {m["reward"] for m in members} == {0.0, 1.0}
    # Each group is a different prompt.
    assert len({members[0]["prompt"] for members in groups.values()}) == 50


def test_generate_rollouts_rejects_singleton_groups():
    with pytest.raises(ValueError):
        example_data.generate_rollouts(n_groups=4, group_size=1, seed=0)


def test_prompt_pools_partition_the_prompt_space():
    train, heldout = example.prompt_pool("train"), example.prompt_pool("heldout")
    assert len(train) + len(heldout) == 2 * 100 * 100
    assert not set(train) & set(heldout)
    assert all(example.is_heldout(p) for p in heldout)
    # crc32 % 8 should hold out roughly an eighth.
    assert 2000 < len(heldout) < 3000


@pytest.mark.parametrize("path, n_groups", [(TRAIN_FILE, 512), (HELDOUT_FILE, 64)])
def test_committed_files_are_valid(path, n_groups):
    rows = read_rows(path)
    assert len(rows) == n_groups * 4
    groups: dict[int, list[dict]] = {}
    for row in rows:
        assert row["reward"] == example.reward(row["prompt"], row["completion"])
        groups.setdefault(row["group"], []).append(row)
    assert len(groups) == n_groups
    assert all(len({m["reward"] for m in members}) >= 2 for members in groups.values())


def test_committed_heldout_disjoint_from_train():
    train_prompts = {row["prompt"] for row in read_rows(TRAIN_FILE)}
    heldout_prompts = {row["prompt"] for row in read_rows(HELDOUT_FILE)}
    assert len(train_prompts) == 512
    assert len(heldout_prompts) == 64
    assert not train_prompts & heldout_prompts
    assert not any(example.is_heldout(p) for p in train_prompts)


@pytest.mark.parametrize(
    "path, split, groups, seed",
    [(TRAIN_FILE, "train", 512, 0), (HELDOUT_FILE, "heldout", 64, 1)],
)
def test_committed_files_match_cli(tmp_path, path, split, groups, seed):
    out = tmp_path / path.name
    example_data.main(
        ["rollouts", "--split", split, "--out", str(out), "--groups", str(groups),
         "--group-size", "4", "--seed", str(seed)]
    )
    assert out.read_bytes() == path.read_bytes()


def test_tokenizer_loads_in_torchtitan(tokenizer):
    assert tokenizer.get_vocab_size() == 2048
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    assert tokenizer.token_to_id(example_data.PAD_TOKEN) == 2
    # BOS/EOS only when asked for, as torchtitan's text datasets do.
    text = "Q: 37+45= 82\n"
    plain = tokenizer.encode(text)
    assert tokenizer.decode(plain) == text
    assert tokenizer.encode(text, add_bos=True, add_eos=True) == [0, *plain, 1]
    # The answer is one token after its space, so the policy learns a number, not digits.
    assert tokenizer.tokenizer.encode(" 82").tokens == ["Ġ82"]


def test_tokenizer_covers_rollout_files(tokenizer):
    longest = 0
    for path in (TRAIN_FILE, HELDOUT_FILE):
        for row in read_rows(path):
            text = row["prompt"] + row["completion"]
            ids = tokenizer.encode(text, add_bos=True, add_eos=True)
            assert max(ids) < 2048
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
            longest = max(longest, len(ids))
    assert longest == 14


def test_tokenizer_cli_is_reproducible(tmp_path):
    example_data.main(["tokenizer", "--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (example.TOKENIZER_DIR / name).read_bytes()


# The compare variant: the online example's task, its warm-up rollouts and prompts files.

COMPARE_WARMUP = REPO / "data" / "compare_warmup.jsonl"
COMPARE_PROMPTS = REPO / "data" / "compare_prompts.jsonl"
COMPARE_HELDOUT = REPO / "data" / "compare_heldout.jsonl"


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("Q: 3 7 max 4 5 =", " 4 5\n", 1.0),
        ("Q: 3 7 min 4 5 =", " 3 7\n", 1.0),
        ("Q: 0 5 max 0 3 =", " 0 5\n", 1.0),
        ("Q: 9 9 min 9 9 =", " 9 9\n", 1.0),
        ("Q: 3 7 max 4 5 =", " 3 7\n", 0.0),
        ("Q: 3 7 min 4 5 =", " 4 5\n", 0.0),
        # exactly two digits, spaced as the operands are, one end marker
        ("Q: 0 5 max 0 3 =", " 5\n", 0.0),
        ("Q: 3 7 max 4 5 =", " 45\n", 0.0),
        ("Q: 3 7 max 4 5 =", "4 5\n", 0.0),
        ("Q: 3 7 max 4 5 =", " 4 5", 0.0),
        ("Q: 3 7 max 4 5 =", " 4 5\n\n", 0.0),
        ("Q: 3 7 max 4 5 =", " 4 5 \n", 0.0),
        ("Q: 3 7 max 4 5 =", "", 0.0),
    ],
)
def test_compare_reward(prompt, completion, expected):
    assert example.reward(prompt, completion) == expected


@pytest.mark.parametrize("prompt", ["Q: 3 7 max 4 5", "Q: 37 max 45 =", "Q: 3 7 mid 4 5 =", "Q: 3 7 max 4 5 6 ="])
def test_compare_reward_rejects_foreign_prompt(prompt):
    with pytest.raises(ValueError):
        example.reward(prompt, " 4 5\n")


def test_arith_reward_has_trls_signature():
    prompts = ["Q: 37+45=", "Q: 37+45=", "Q: 3 7 max 4 5 =", "Q: 3 7 min 4 5 ="]
    completions = [" 82\n", " 83\n", " 4 5\n", " 4 5\n"]
    # TRL passes the token ids and the prompts file's other columns as keywords
    rewards = example.arith_reward(prompts=prompts, completions=completions, completion_ids=[[1]] * 4,
                                   answer=[82, 82, 45, 37])
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        example.arith_reward(prompts[:3], completions, None)


def test_compare_pools_partition_the_prompt_space(tokenizer):
    train, heldout = example.prompt_pool("train", compare=True), example.prompt_pool("heldout", compare=True)
    assert len(train) + len(heldout) == len(set(train) | set(heldout)) == 2 * 100 * 100
    assert 2000 < len(heldout) < 3000 and all(example.is_heldout(p) for p in heldout)
    # one digit per token, and every prompt the same length: max and min are two tokens each
    assert tokenizer.tokenizer.encode("Q: 3 7 max 4 5 = 4 5\n").tokens == [
        "Q", ":", "Ġ3", "Ġ7", "Ġma", "x", "Ġ4", "Ġ5", "Ġ", "=", "Ġ4", "Ġ5", "Ċ"]
    assert {len(tokenizer.encode(p)) for p in train[::97] + heldout[::13]} == {10}


def test_warmup_rollouts_pair_each_answer_with_an_inert_companion(tokenizer):
    rows = example_data.warmup_rollouts(n_groups=50, seed=7)
    assert rows == example_data.warmup_rollouts(n_groups=50, seed=7)
    assert len(rows) == 100 and len({r["prompt"] for r in rows}) == 50
    for right, companion in zip(rows[::2], rows[1::2]):
        assert right["group"] == companion["group"] and right["prompt"] == companion["prompt"]
        assert not example.is_heldout(right["prompt"])
        assert right["reward"] == example.reward(right["prompt"], right["completion"]) == 1.0
        assert companion == {"prompt": right["prompt"], "completion_ids": [tokenizer.eos_id], "reward": 0.0,
                             "group": right["group"], "logprobs": [0.0]}
    with pytest.raises(ValueError):
        example_data.warmup_rollouts(n_groups=17_501, seed=0)


def test_warmup_companion_gets_no_gradient(tokenizer):
    """The committed warm-up file through the plugin's data path and GRPO loss is SFT on the answers."""
    from functools import partial
    from types import SimpleNamespace

    import torch

    from plugin.config import GRPO
    from plugin.data.batch import Collate
    from plugin.model.policy import PolicyOutput
    from plugin.scoring.logprobs import compute_logprobs
    from plugin.scoring.loss import grpo_loss, grpo_token_terms
    from plugin.data.rollouts import Encoder, index_rollouts

    seq_len = 16  # train_configs/online_warmup_cpu.toml
    index = index_rollouts(str(COMPARE_WARMUP), Encoder(tokenizer, 2048, seq_len))
    assert (index.num_groups, index.group_size) == (1024, 2)
    items = list(range(16))
    rewards = torch.from_numpy(index.rewards[items])
    batch, labels = Collate(seq_len, tokenizer.eos_id, GRPO(padding_free=False), 2)(
        rewards, torch.from_numpy(index.lengths[items]).long(), items, index.read(items))
    rollouts = batch["rollouts"]
    logits = torch.randn(16, seq_len, 2048, dtype=torch.float64, requires_grad=True)  # p(EOS) ~ 1/2048
    logprobs = compute_logprobs(logits, labels)
    pred = PolicyOutput(logprobs, torch.zeros_like(logprobs), None, rollouts.old_logprobs, rollouts.advantages,
                        rollouts.rewards, rollouts.loss_weights)
    grpo_loss(pred, labels, token_terms_fn=partial(grpo_token_terms, clip_low=0.2, clip_high=0.2, beta=0.0,
                                                    kl_estimator="k3")).backward()
    right = rewards == 1
    assert torch.allclose(rollouts.advantages[right], torch.tensor(2**-0.5), atol=1e-3)
    assert logits.grad[~right].abs().max() == 0
    # the answers' gradient is that of advantage-weighted log-likelihood: supervised fine-tuning
    sft = logits.detach().requires_grad_()
    (-(compute_logprobs(sft, labels)[right].sum(1) * rollouts.advantages[right])).sum().backward()
    torch.testing.assert_close(logits.grad[right], sft.grad[right])


def test_prompt_rows():
    rows = example_data.prompt_rows("heldout", count=20, seed=5)
    assert rows == example_data.prompt_rows("heldout", count=20, seed=5)
    assert len({r["prompt"] for r in rows}) == 20
    assert all(example.is_heldout(r["prompt"]) and r["answer"] == example.answer(r["prompt"]) for r in rows)
    assert len(example_data.prompt_rows("train", count=None, seed=0)) == 17_500
    with pytest.raises(ValueError):
        example_data.prompt_rows("heldout", count=0, seed=0)


@pytest.mark.parametrize(
    "path, args",
    [
        (COMPARE_WARMUP, ["warmup", "--groups", "1024", "--seed", "2"]),
        (COMPARE_PROMPTS, ["prompts", "--split", "train", "--count", "4096"]),
        (COMPARE_HELDOUT, ["prompts", "--split", "heldout", "--count", "256", "--seed", "3"]),
    ],
)
def test_committed_compare_files_match_cli(tmp_path, path, args):
    out = tmp_path / path.name
    example_data.main([*args, "--out", str(out)])
    assert out.read_bytes() == path.read_bytes()


def test_compare_heldout_disjoint_from_training():
    heldout = {row["prompt"] for row in read_rows(COMPARE_HELDOUT)}
    trained = {row["prompt"] for path in (COMPARE_WARMUP, COMPARE_PROMPTS) for row in read_rows(path)}
    assert len(heldout) == 256 and all(example.is_heldout(p) for p in heldout)
    assert not heldout & trained and not any(example.is_heldout(p) for p in trained)


# The SmolLM2 example's rewards (train_configs/smollm2_online_cpu.toml), on TRL's conversational completions
def _said(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "reply, correct",
    [
        ("33", 1.0),
        (" 33.", 1.0),
        ("20 + 13 = 33", 1.0),  # working shown
        ("20 + 13 = 33\n\nThis is a classic example of 2", 0.0),  # ran on: the last number counts
        ("32", 0.0),  # a bare wrong number earns nothing
        ("The answer is 33, not 32", 0.0),
        ("thirty-three", 0.0),
        ("", 0.0),
    ],
)
def test_sum_correct_pays_the_right_last_number_only(reply, correct):
    prompts = [example.sum_question(20, 13)]
    assert example.sum_correct(prompts, [_said(reply)], [[1237, 2]], answer=[33]) == [correct]
    assert example.sum_correct([prompts[0][0]["content"]], [reply], [[1237, 2]], answer=[33]) == [correct]  # text too


def test_committed_sum_prompts_are_disjoint_and_match_the_script(tmp_path):
    smollm2_data.main(["--out-dir", str(tmp_path)])
    for name in ("smollm2_sum_prompts.jsonl", "smollm2_sum_heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "data" / name).read_bytes(), name
    train, heldout = (read_rows(REPO / "data" / n) for n in ("smollm2_sum_prompts.jsonl", "smollm2_sum_heldout.jsonl"))
    pair = lambda r: frozenset(map(int, re.findall(r"\d+", r["prompt"][0]["content"])))  # noqa: E731
    assert len(train) == 2048 and len(heldout) == 256
    assert not {pair(r) for r in train} & {pair(r) for r in heldout}  # not even as b + a
    assert all(r["answer"] == sum(map(int, re.findall(r"\d+", r["prompt"][0]["content"]))) for r in train + heldout)


def test_smollm2_online_config_names_the_sum_rewards_and_files():
    from torchtitan.config import ConfigManager

    from plugin.data.rewards import load_reward_fns

    job = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs/smollm2_online_cpu.toml")])
    fns = load_reward_fns(job.online.reward_funcs, job.online.reward_weights)
    assert [(f.fn, f.weight) for f in fns] == [(example.sum_correct, 1.0)]
    assert job.online.stop_token_ids == [example.SMOLLM2_EOS]
    assert (REPO / job.training.dataset_path).is_file() and (REPO / job.validation.dataset_path).is_file()


# The SmolLM2 tool example's rewards (train_configs/smollm2_tools_cpu.toml), on TRL's tool trajectories
def _call(a, b) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]}


def _tool(result) -> dict:
    return {"role": "tool", "name": "multiply", "content": str(result)}


@pytest.mark.parametrize(
    "trajectory, correct, call_right",
    [
        ([_call(523, 86), _tool(44978), _said("44978")[0]], 1.0, 1.0),
        ([_call(523, 86), _tool(44978), _said("The answer is 44978.")[0]], 1.0, 1.0),
        ([_call(523, 86), _tool(44978), _said("44987")[0]], 0.0, 1.0),  # misreported
        ([_call(312, 47), _tool(14664), _said("44978")[0]], 1.0, 0.0),  # the worked example's numbers, a right copy
        (_said("44978"), 0.0, 0.0),  # right without the tool: no pay
        ([_call(523, 86)], 0.0, 0.0),  # cut before the tool answered
        ([_call(523, 86), _tool(44978), _call(523, 86)], 0.0, 1.0),  # the last turn calls again
        ([{"role": "assistant", "content": "", "tool_calls": []}, _tool('{"error": "bad"}'), _said("44978")[0]],
         1.0, 0.0),
    ],
)
def test_tool_rewards(trajectory, correct, call_right):
    prompts = [example.product_question(523, 86)]
    assert example.tool_correct(prompts, [trajectory], [[2]], answer=[44978]) == [correct]
    assert example.tool_call_right(prompts, [trajectory], [[2]], answer=[44978]) == [call_right]


def test_multiply_is_a_tool_with_a_schema():
    from plugin.generation.tools import load_tools

    (tool,) = load_tools(["plugin.example:multiply"])
    assert tool.schema["function"]["parameters"]["required"] == ["a", "b"]
    assert example.multiply(523, 86) == example.multiply("523", "86") == 44978


def test_committed_tool_prompts_are_disjoint_and_match_the_script(tmp_path):
    import tool_data  # data/, the tool example's prompt files

    tool_data.main(["--out-dir", str(tmp_path)])
    names = ("smollm2_tool_prompts.jsonl", "smollm2_tool_heldout.jsonl", "smollm2_tool_bigger.jsonl")
    for name in names:
        assert (tmp_path / name).read_bytes() == (REPO / "data" / name).read_bytes(), name
    train, heldout, bigger = (read_rows(REPO / "data" / n) for n in names)
    question = lambda r: r["prompt"][-1]["content"]  # noqa: E731
    assert len(train) == 2048 and len(heldout) == len(bigger) == 128
    assert not {question(r) for r in train} & {question(r) for r in heldout}
    for r in train + heldout + bigger:
        a, b = map(int, re.findall(r"\d+", question(r)))
        assert r["answer"] == a * b and r["prompt"][:-1] == example.product_question(a, b)[:-1]


def test_smollm2_tools_config_names_the_tool_rewards_and_template():
    from torchtitan.config import ConfigManager

    from plugin.data.rewards import load_reward_fns

    job = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs/smollm2_tools_cpu.toml")])
    fns = load_reward_fns(job.online.reward_funcs, job.online.reward_weights)
    assert [(f.fn, f.weight) for f in fns] == [(example.tool_correct, 1.0), (example.tool_call_right, 0.25)]
    assert job.online.tools == ["plugin.example:multiply"]
    assert (REPO / job.rollout_data.chat_template_path).is_file()
    assert (REPO / job.training.dataset_path).is_file() and (REPO / job.validation.dataset_path).is_file()
