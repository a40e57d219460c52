"""Multi-turn rollouts with tool calls, one process: what is trained on, the tool turns, multi-turn rollout files.

1. Tool tokens are never trained on: the loss and every gradient of a multi-turn microbatch equal a hand-built
   computation (plain forwards of policy and reference, the formulas of docs/loss.md) over the model's own
   tokens; a tool token's behaviour log-prob changes nothing; padded and padding-free agree.
2. ToolTurns (plugin.data.turns) with SmolLM2's tokenizer and plugin/assets/chat_templates/chatml_tools.jinja:
   the appended ids are a full re-render's, the messages are TRL's, failures are counted, a tool answer
   that overflows the budget is rolled back, max_tool_calling_iterations holds.
3. Rollout files whose completions are message lists: rendered, their tool turns masked, errors by file:line.
The sampler's rounds: tests/test_sampler.py; torchrun layouts: tests/test_tools_e2e.py.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO, build_model
from plugin.data.batch import Collate
from plugin.data.chat import ChatTemplate
from plugin.data.prompts import Prompt
from plugin.data.rollouts import Completion, Encoder, RolloutError, index_rollouts
from plugin.data.turns import ToolSetup
from plugin.generation.tools import load_tools
from test_tools import smollm2  # noqa: F401  (a fixture: SmolLM2's tokenizer folder)

SEQ_LEN = 48
TEMPLATE = REPO / "plugin/assets/chat_templates/chatml_tools.jinja"


# --- 1. what is trained on -------------------------------------------------------------------------

def multi_turn_batch(seed: int = 0) -> list[Completion]:
    """2 groups of 2: completions with tool turns inside (tool mask 0) and behaviour log-probs on every token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(2):
        prompt = torch.randint(3, 2048, (5 + i,), generator=g).tolist()
        for m in range(2):
            n = 14 + 5 * m + i
            completion = torch.randint(3, 2048, (n,), generator=g).tolist()
            mask = [1] * n
            for start in (3, 9 + m):  # two tool turns of 3 tokens
                mask[start:start + 3] = [0, 0, 0]
            logprobs = (-torch.rand(n, generator=g) * 3).tolist()
            out.append(Completion(prompt + completion, len(prompt), float(m == i), logprobs, tool_mask=mask))
    return out


def with_tool_logprobs(batch, value: float) -> list[Completion]:
    """The batch, every tool token's behaviour log-prob set to `value`."""
    return [Completion(c.tokens, c.prompt_len, c.reward, [value if k == 0 else lp for lp, k in zip(c.logprobs, c.tool_mask)],
                       tool_mask=c.tool_mask) for c in batch]


MODELS = {}


def _model(*extra: str):
    """One model per set of flags, its gradients cleared: every build holds the same weights (the seed)."""
    if extra in MODELS:
        model, cfg = MODELS[extra]
        model.zero_grad(set_to_none=True)
        return model, cfg
    model, cfg, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--training.seq_len", str(SEQ_LEN),
                                 "--grpo.entropy_coef", "0.01", "--grpo.beta", "0.1", *extra)
    model.reference.load_once(model, torch.device("cpu"))
    with torch.no_grad():  # a reference away from the policy: KL and its gradient are not 0
        g = torch.Generator().manual_seed(1)
        for p in model.reference.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    MODELS[extra] = model, cfg
    return model, cfg


def plugin_step(batch, *extra: str):
    """The plugin's loss (over the microbatch's tokens in the loss, as torchtitan divides) and every gradient."""
    from plugin.scoring.loss import build_grpo_loss

    model, cfg = _model(*extra)
    lens = torch.tensor([c.loss_length for c in batch])
    inputs, labels = Collate(SEQ_LEN, 0, cfg.grpo, 2)(torch.tensor([c.reward for c in batch]), lens,
                                                      list(range(len(batch))), batch)
    pred = model(inputs["input"], **{k: v for k, v in inputs.items() if k != "input"})
    loss = build_grpo_loss(cfg)(pred, labels) / int((labels != IGNORE_INDEX).sum())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def hand_built_step(batch, aggregation: str = "token_mean"):
    """Each completion alone through plain forwards; token terms from docs/loss.md (k3 KL, clipped ratio to the
    behaviour log-probs, entropy bonus) summed over the model's own tokens only."""
    from plugin.data.batch import advantages

    model, cfg = _model("--grpo.loss_aggregation", aggregation)
    g = cfg.grpo
    adv = advantages(torch.tensor([c.reward for c in batch]), 2, g.advantage_norm, g.advantage_eps)
    own = [torch.tensor(c.tool_mask, dtype=torch.bool) for c in batch]
    total = sum(int(m.sum()) for m in own)
    loss = 0.0
    for b, c in enumerate(batch):
        seq = torch.tensor(c.tokens)
        positions = torch.arange(len(seq) - 1)[None]
        logits = model.output(model.norm(model.hidden_states(seq[None, :-1], positions=positions)))[0].float()
        with torch.no_grad():
            ref_logits = model.reference.module(seq[None, :-1])[0].float()
        targets = seq[c.prompt_len:]
        rows = torch.arange(c.prompt_len - 1, len(seq) - 1)
        logp_all = torch.log_softmax(logits[rows], -1)
        lp = logp_all.gather(1, targets[:, None])[:, 0]
        ref = torch.log_softmax(ref_logits[rows], -1).gather(1, targets[:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        ratio = torch.exp(lp - torch.tensor(c.logprobs))
        pg = -torch.minimum(ratio * adv[b], ratio.clamp(1 - g.clip_low, 1 + g.clip_high) * adv[b])
        d = (ref - lp).clamp(-g.kl_log_ratio_clamp, g.kl_log_ratio_clamp)
        kl = (torch.exp(d) - d - 1).clamp(max=g.kl_max)
        terms = (pg + g.beta * kl - g.entropy_coef * entropy)[own[b]]
        if aggregation == "token_mean":
            loss = loss + terms.sum() / total
        else:  # seq_mean_token_mean: each completion's mean over its own tokens, averaged over completions
            loss = loss + terms.mean() / len(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


CASES = {  # (loss_aggregation, flags)
    "padding-free fused": ("token_mean",),
    "padding-free unfused": ("seq_mean_token_mean", "--grpo.no_fused_policy_pass"),
    "padded fused": ("seq_mean_token_mean", "--grpo.no_padding_free"),
    "padded unfused": ("token_mean", "--grpo.no_padding_free", "--grpo.no_fused_policy_pass"),
}


@pytest.fixture(scope="module")
def hand_built():
    batch = multi_turn_batch()
    return {agg: hand_built_step(batch, agg) for agg in ("token_mean", "seq_mean_token_mean")}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("padded") else c for c in CASES])
def test_tool_tokens_are_never_trained_on(hand_built, case):
    aggregation, *flags = CASES[case]
    batch = multi_turn_batch()
    loss, grads = plugin_step(batch, "--grpo.loss_aggregation", aggregation, *flags)
    want_loss, want_grads = hand_built[aggregation]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # a tool token's behaviour log-prob is no input of the loss
    other_loss, other_grads = plugin_step(with_tool_logprobs(batch, -30.0), "--grpo.loss_aggregation", aggregation,
                                          *flags)
    assert torch.equal(other_loss, loss)
    assert all(torch.equal(other_grads[n], g) for n, g in grads.items())


def test_collate_leaves_tool_tokens_without_labels():
    batch = multi_turn_batch()
    cfg = SimpleNamespace(**{**vars(_model()[1].grpo)})
    for padding_free in (True, False):
        cfg.padding_free = padding_free
        inputs, labels = Collate(SEQ_LEN, 0, cfg, 2)(torch.zeros(4), torch.tensor([c.loss_length for c in batch]),
                                                     [0, 1, 2, 3], batch)
        r = inputs["rollouts"]
        labels = r.unpacked(labels.float(), IGNORE_INDEX).long() if padding_free else labels
        for b, c in enumerate(batch):
            targets = labels[b, c.prompt_len - 1:len(c.tokens) - 1].tolist()
            completion = c.tokens[c.prompt_len:]
            assert targets == [t if k else IGNORE_INDEX for t, k in zip(completion, c.tool_mask)]
            # the model reads the tool tokens: they are inputs
            assert inputs["input"].flatten().tolist().count(completion[3]) >= 1


# --- 2. the tool turns -------------------------------------------------------------------------------

def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


@pytest.fixture(scope="module")
def setup(smollm2):  # noqa: F811
    tokenizer = HuggingFaceTokenizer(str(smollm2))
    chat = ChatTemplate.from_folder(str(smollm2), str(TEMPLATE))
    encoder = Encoder(tokenizer, 49152, 512, chat=chat, tools=load_tools(["test_multi_turn:multiply"]),
                      stop_text="<|im_end|>")
    online = SimpleNamespace(tool_call_format="hermes", max_tool_calling_iterations=-1, tool_timeout=5.0)
    return ToolSetup(online, chat, encoder, tokenizer, [2]), encoder, tokenizer


QUESTION = [{"role": "user", "content": "What is 312 * 47?"}]
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 312, "b": 47}}}]}


def turn_ids(encoder, messages_before, message) -> list[int]:
    """The ids a model writes for `message`: the template's text of that turn, up to and including <|im_end|>."""
    chat = encoder.chat
    before = chat.render(messages_before, tools=encoder.schemas)
    full = chat.render(messages_before + [message], tools=encoder.schemas, add_generation_prompt=False)
    text = full[len(before):]
    return encoder._text_ids(text[:text.rindex("<|im_end|>") + len("<|im_end|>")])


def test_a_tool_turn_appends_what_a_full_render_tokenizes(setup):
    tools, encoder, tokenizer = setup
    prompt_ids = encoder.prompt({"prompt": QUESTION})
    prompt = Prompt(prompt_ids, QUESTION, {}, "q.jsonl:1")
    turns = tools.turns([prompt], None)
    first = turn_ids(encoder, QUESTION, CALL)
    (suffix,) = turns.resume([0], [first], [400])
    tool = {"role": "tool", "name": "multiply", "content": "14664"}
    # the appended ids are what tokenizing the full re-render gives after the generated ones
    whole = encoder._text_ids(encoder.chat.render(QUESTION + [CALL, tool], tools=encoder.schemas))
    assert prompt_ids + first + suffix == whole
    answer = turn_ids(encoder, QUESTION + [CALL, tool], {"role": "assistant", "content": "14664"})
    assert turns.resume([0], [first + suffix + answer], [400 - len(suffix) - len(answer)]) == [None]
    messages, figures = turns.finish([first + suffix + answer])
    assert messages == [[{"role": "assistant", "content": "", "tool_calls": CALL["tool_calls"]}, tool,
                         {"role": "assistant", "content": "14664"}]]
    assert (figures[0].calls, figures[0].failures, figures[0].turns) == (1, 0, 2)


def test_failed_calls_are_answered_with_errors_and_counted(setup):
    tools, encoder, _ = setup
    prompt = Prompt(encoder.prompt({"prompt": QUESTION}), QUESTION, {}, "q.jsonl:1")
    turns = tools.turns([prompt, prompt], None)
    bad = encoder._text_ids('<tool_call>\n{"name": "divide", "arguments": {"a": 1}}\n</tool_call>'
                            '<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "c": 2}}\n</tool_call><|im_end|>')
    plain = encoder._text_ids("It is 14664.<|im_end|>")
    out = turns.resume([0, 1], [bad, plain], [400, 400])
    assert out[1] is None and out[0]
    text = encoder.tokenizer.decode(out[0])
    assert "unknown tool 'divide'" in text and '"error"' in text
    messages, figures = turns.finish([bad + out[0], plain])
    assert (figures[0].calls, figures[0].failures) == (2, 2) and (figures[1].calls, figures[1].turns) == (0, 1)
    assert [m["role"] for m in messages[0]] == ["assistant", "tool", "tool", "assistant"]
    assert messages[1] == [{"role": "assistant", "content": "It is 14664."}]


def test_an_answer_that_overflows_the_budget_is_rolled_back(setup):
    tools, encoder, _ = setup
    prompt = Prompt(encoder.prompt({"prompt": QUESTION}), QUESTION, {}, "q.jsonl:1")
    turns = tools.turns([prompt], None)
    first = turn_ids(encoder, QUESTION, CALL)
    (suffix,) = turns.resume([0], [first], [3])
    assert len(suffix) > 3  # the sampler ends the row as truncated, without these ids
    messages, figures = turns.finish([first])
    assert messages == [[{"role": "assistant", "content": "", "tool_calls": CALL["tool_calls"]}]]
    assert figures[0].turns == 1 and figures[0].calls == 1


def test_max_tool_calling_iterations(setup):
    tools, encoder, tokenizer = setup
    limited = ToolSetup(SimpleNamespace(tool_call_format="hermes", max_tool_calling_iterations=0, tool_timeout=5.0),
                        encoder.chat, encoder, tokenizer, [2])
    prompt = Prompt(encoder.prompt({"prompt": QUESTION}), QUESTION, {}, "q.jsonl:1")
    turns = limited.turns([prompt], None)
    first = turn_ids(encoder, QUESTION, CALL)
    assert turns.resume([0], [first], [400]) == [None]
    messages, figures = turns.finish([first])
    assert messages[0][0]["tool_calls"] == CALL["tool_calls"] and figures[0].calls == 0


def test_a_text_prompt_with_tools_is_refused_by_file_and_line(setup):
    tools, _, _ = setup
    with pytest.raises(ValueError, match=r"p.jsonl:3: with \[online\] tools a prompt is a list of messages"):
        tools.check_prompts([Prompt([1], "text", {}, "p.jsonl:3")], "[training] dataset_path")


# --- 3. rollout files with multi-turn trajectories -----------------------------------------------------

def test_a_multi_turn_rollout_row_is_rendered_and_its_tool_turns_masked(setup, tmp_path):
    _, encoder, _ = setup
    tool = {"role": "tool", "name": "multiply", "content": "14664"}
    trajectory = [CALL, tool, {"role": "assistant", "content": "14664"}]
    rows = [{"prompt": QUESTION, "completion": trajectory, "reward": 1.0, "group": 0},
            {"prompt": QUESTION, "completion": [{"role": "assistant", "content": "15000"}], "reward": 0.0, "group": 0}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = index_rollouts(str(path), encoder)
    a, b = index.read(torch.arange(2).numpy())
    prompt_ids = encoder.prompt(rows[0])
    whole = encoder._text_ids(encoder.chat.render(QUESTION + trajectory, tools=encoder.schemas,
                                                  add_generation_prompt=False))
    assert a.tokens == whole[:len(whole) - 1]  # up to the last <|im_end|>: the template's newline after it is not
    assert a.tokens[:len(prompt_ids)] == prompt_ids and a.tokens[-1] == 2
    first = turn_ids(encoder, QUESTION, CALL)
    answer = turn_ids(encoder, QUESTION + [CALL, tool], trajectory[2])
    suffix = len(a.tokens) - len(prompt_ids) - len(first) - len(answer)
    assert a.tool_mask == [1] * len(first) + [0] * suffix + [1] * len(answer)
    assert index.loss_lengths.tolist() == [len(first) + len(answer), len(b.tokens) - b.prompt_len]
    assert b.tool_mask == [1] * (len(b.tokens) - b.prompt_len)


@pytest.mark.parametrize("completion, message", [
    ([{"role": "tool", "name": "multiply", "content": "1"}], r"completion\[0\]' has role 'tool'"),
    ([CALL], None),  # ends on a call: the tool turns ran out; a valid trajectory
    ([CALL, {"role": "tool", "name": "multiply", "content": "1"}], r"completion\[1\]' is a tool message and the last"),
    ([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}], r"completion\[1\]' follows"),
])
def test_malformed_trajectories_name_the_file_line_and_message(setup, tmp_path, completion, message):
    _, encoder, _ = setup
    rows = [{"prompt": QUESTION, "completion": completion, "reward": 1.0, "group": 0},
            {"prompt": QUESTION, "completion": [{"role": "assistant", "content": "1"}], "reward": 0.0, "group": 0}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if message is None:
        assert index_rollouts(str(path), encoder).num_groups == 1
        return
    with pytest.raises(RolloutError, match=rf"{path}:1: .*{message}"):
        index_rollouts(str(path), encoder)


def test_a_trajectory_after_a_text_prompt_is_refused(setup, tmp_path):
    _, encoder, _ = setup
    rows = [{"prompt": "What is 312 * 47?", "completion": [CALL], "reward": 1.0, "group": 0}] * 2
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RolloutError, match=rf"{path}:1: field 'completion' is a list of messages .* the prompt as a list"):
        index_rollouts(str(path), encoder)
