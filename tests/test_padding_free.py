"""[grpo] padding_free: a microbatch's sequences as one row of real tokens, against the padded layout.

1. The layout (plugin.data.batch): labels made per sequence (none crosses a boundary, verl#6475),
   positions restarting at 0, the row rounded up by a pad sequence of its own; microbatches
   balanced by tokens; the attention's boundaries come from the positions, not EOS ids.
2. Attention (plugin.model.attention): per-sequence SDPA, its compiled custom op (values and
   gradients), and a packed row's sequences never see each other.
3. Model level, one rank: log-probs, the loss and every parameter's gradient of a packed
   microbatch equal the padded one's, unfused and fused, in every loss_aggregation mode, with
   importance_sampling_level = "sequence", behaviour log-probs, mask_truncated_completions, on
   llama3 and qwen3. Multi-rank layouts and the training loop: tests/test_padding_free_e2e.py.
"""

import math

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from conftest import build_model
from plugin.config import GRPO
from plugin.data.batch import Collate, balanced, packed_positions
from plugin.data.rollouts import Completion
from plugin.model import attention
from plugin.model.attention import _attend_each, _attend_each_op, packed_attention, sequence_bounds

SEQ_LEN = 48
# fp32: the same math over other shapes (one row vs a padded batch): per-sequence SDPA, the matmuls' blocking
RTOL, ATOL = 1e-5, 1e-6


def completions(seed: int = 0, groups: int = 3, G: int = 2, with_logprobs: bool = False) -> list[Completion]:
    """Groups of G completions of a shared prompt, lengths from 1 to ~SEQ_LEN tokens: a long tail."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = torch.randint(3, 2048, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        for m in range(G):
            n = int(torch.randint(1, SEQ_LEN + 2 - len(prompt), (1,), generator=g))
            completion = torch.randint(3, 2048, (n,), generator=g).tolist()
            logprobs = (-torch.rand(n, generator=g) * 8).tolist() if with_logprobs else None
            out.append(Completion(prompt + completion, len(prompt), float(m == i % G), logprobs))
    return out


def collate(batch, padding_free: bool, pack_multiple: int = 1, keep=None, **grpo):
    cfg = GRPO(padding_free=padding_free, **grpo)
    rewards = torch.tensor([c.reward for c in batch])
    lens = torch.tensor([len(c.tokens) - c.prompt_len for c in batch])
    return Collate(SEQ_LEN, 0, cfg, 2, pack_multiple=pack_multiple)(rewards, lens, list(range(len(batch))), batch, keep)


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["torch-2.13", "torch-2.11"])
def test_the_varlen_kernel_gets_grouped_query_heads_as_its_torch_takes_them(monkeypatch, takes_gqa):
    """CUDA's varlen kernel, stood in for by the per-sequence path: torch 2.11's has no `enable_gqa` (the first GPU
    run stopped there), so each KV head is repeated for its query heads; 2.13's is told. Both equal SDPA's GQA."""
    lens = [5, 1, 9, 3]
    q, k, v = _qkv(lens)
    bounds = sequence_bounds(torch.zeros(1, sum(lens)), torch.cat([torch.arange(n) for n in lens])[None])
    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **gqa):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and max_q == max_k == max(lens)
        calls.append((k.shape[1], gqa))
        if not takes_gqa and gqa:
            raise TypeError(f"varlen_attn() got an unexpected keyword argument {next(iter(gqa))!r}")
        return _attend_each(q, k, v, cu_q.tolist(), scale)

    monkeypatch.setattr(attention, "varlen_attn", kernel)
    monkeypatch.setattr(attention, "VARLEN_TAKES_GQA", takes_gqa)
    out = attention._varlen(q, k, v, bounds, q.shape[-1] ** -0.5)
    assert calls == ([(k.shape[1], {"enable_gqa": True})] if takes_gqa else [(q.shape[1], {})]) and q.shape[1] > k.shape[1]
    torch.testing.assert_close(out, packed_attention(q, k, v, bounds), rtol=1e-12, atol=1e-12)


def test_labels_are_made_per_sequence_and_never_cross_a_boundary():
    batch = completions()
    (packed, labels), (padded, padded_labels) = collate(batch, True, pack_multiple=4), collate(batch, False)
    lens = [len(c.tokens) - 1 for c in batch]
    assert packed["input"].shape == (1, -(-sum(lens) // 4) * 4)
    start = 0
    for b, (c, n) in enumerate(zip(batch, lens)):
        row = slice(start, start + n)
        assert packed["input"][0, row].tolist() == c.tokens[:-1] == padded["input"][b, :n].tolist()
        assert labels[0, row].tolist() == padded_labels[b, :n].tolist()
        # the sequence's last input position predicts its own last token, never the next sequence's first
        assert labels[0, start + n - 1] == c.tokens[-1]
        assert labels[0, start : start + c.prompt_len - 1].eq(-100).all()
        assert packed["positions"][0, row].tolist() == list(range(n))
        start += n
    assert labels[0, start:].eq(-100).all() and packed["positions"][0, start:].tolist() == list(range(packed["input"].shape[1] - start))
    r = packed["rollouts"]
    assert r.packed and r.seq_lens.tolist() == lens
    assert torch.equal(r.unpacked(labels.float(), -100.0).long(), padded_labels[:, : max(lens)])
    bounds = sequence_bounds(packed["input"], packed["positions"])
    assert bounds.cu_seq_q.tolist()[: len(lens) + 1] == np.cumsum([0, *lens]).tolist()


def test_boundaries_come_from_positions_not_eos_ids():
    tokens = torch.tensor([[5, 0, 7, 0, 0, 9]])  # 0 is the EOS id: it must not split anything
    assert sequence_bounds(tokens, torch.tensor([[0, 1, 2, 0, 1, 2]])).cu_seq_q.tolist() == [0, 3, 6]
    assert sequence_bounds(tokens, torch.tensor([[0, 1, 2, 3, 4, 5]])).cu_seq_q.tolist() == [0, 6]
    assert sequence_bounds(torch.zeros(3, 4, dtype=torch.long), None).cu_seq_q.tolist() == [0, 4, 8, 12]
    assert packed_positions(torch.tensor([2, 3]), 7).tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    assert packed_positions(torch.tensor([2, 3]), 5).tolist() == [[0, 1, 0, 1, 2]]


def test_balanced_bins_even_out_tokens_and_keep_every_completion():
    tokens = np.array([512, 60, 90, 300, 70, 120, 64, 80, 400, 66, 75, 110])
    bins = balanced(tokens, 4)
    assert sorted(i for b in bins for i in b) == list(range(len(tokens)))
    loads = [int(tokens[b].sum()) for b in bins]
    assert max(loads) - min(loads) <= tokens.max() and min(map(len, bins)) >= 1
    assert max(loads) < 2 * sum(loads) / 4  # far from the group-major plan's (the first bin holds 512 + 60 + 90)


def _qkv(lens, H=4, H_kv=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    return [torch.randn(n, h, hd, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, H_kv, H_kv)]


def test_per_sequence_attention_matches_each_sequence_alone_and_never_mixes():
    lens = [5, 1, 9, 3]
    q, k, v = _qkv(lens)
    cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32)
    bounds = sequence_bounds(torch.zeros(1, sum(lens)), torch.cat([torch.arange(n) for n in lens])[None])
    out = packed_attention(q, k, v, bounds)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[s:e], alone, rtol=1e-12, atol=1e-12)
    # a later sequence's keys and values change nothing of an earlier one's output
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[5:], v2[5:] = 7.0, -3.0
    torch.testing.assert_close(packed_attention(q, k2, v2, bounds)[:5], out[:5], rtol=0, atol=0)
    # the custom op that torch.compile sees: the same values and gradients
    grad = torch.randn_like(out)
    eager = torch.autograd.grad(out, (q, k, v), grad)
    op_out = _attend_each_op(q, k, v, cu, 8 ** -0.5)
    torch.testing.assert_close(op_out, _attend_each(q, k, v, cu.tolist(), 8 ** -0.5), rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(op_out, (q, k, v), grad), eager):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.library.opcheck(_attend_each_op, (q, k, v, cu, 8 ** -0.5))


def _model(padding_free: bool, *extra: str):
    model, cfg, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--training.seq_len", str(SEQ_LEN),
                                 "--grpo.entropy_coef", "0.01", "--grpo.logprob_chunk_tokens", "24",
                                 "--grpo.padding_free" if padding_free else "--grpo.no_padding_free", *extra)
    model.reference.load_once(model, torch.device("cpu"))
    with torch.no_grad():  # a reference away from the policy: KL and its gradient are not 0
        g = torch.Generator().manual_seed(1)
        for p in model.reference.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, cfg


def step(padding_free: bool, *extra: str, batch=None, keep=None):
    """The loss (divided by the microbatch's tokens, as torchtitan does), padded log-probs and every gradient."""
    from plugin.scoring.loss import build_grpo_loss

    model, cfg = _model(padding_free, *extra)
    inputs, labels = Collate(SEQ_LEN, 0, cfg.grpo, 2)(
        torch.tensor([c.reward for c in batch]), torch.tensor([len(c.tokens) - c.prompt_len for c in batch]),
        list(range(len(batch))), batch, keep)
    assert inputs["rollouts"].packed == padding_free and (inputs["input"].shape[0] == 1) == padding_free
    pred = model(inputs["input"], **{k: v for k, v in inputs.items() if k != "input"})
    loss = build_grpo_loss(cfg)(pred, labels) / max(int((labels != -100).sum()), 1)
    loss.backward()
    padded_pred, padded_labels = pred.padded(labels)
    return loss.detach(), padded_pred, padded_labels, {n: p.grad.clone() for n, p in model.named_parameters()}


CASES = {
    "unfused": ("--grpo.no_fused_policy_pass",),
    "fused": (),
    "seq_mean_token_mean": ("--grpo.loss_aggregation", "seq_mean_token_mean"),
    "seq_mean_token_sum": ("--grpo.no_fused_policy_pass", "--grpo.loss_aggregation", "seq_mean_token_sum"),
    "fixed_horizon": ("--grpo.loss_aggregation", "fixed_horizon"),
    "sequence_fused": ("--grpo.importance_sampling_level", "sequence"),
    "sequence_unfused": ("--grpo.importance_sampling_level", "sequence", "--grpo.no_fused_policy_pass"),
    "qwen3": ("--model.name", "grpo_qwen3", "--model.flavor", "debugmodel"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_packed_microbatch_trains_as_the_padded_one(case):
    batch = completions(with_logprobs=case.startswith("sequence"))  # behaviour log-probs: ratios away from 1
    keep = torch.tensor([True, True, False, True, True, True]) if case == "unfused" else None  # one truncated, masked
    padded, packed = step(False, *CASES[case], batch=batch, keep=keep), step(True, *CASES[case], batch=batch, keep=keep)
    (loss, pred, labels, grads), (p_loss, p_pred, p_labels, p_grads) = padded, packed
    width = p_labels.shape[1]
    assert torch.equal(labels[:, width:], torch.full_like(labels[:, width:], -100))
    assert torch.equal(p_labels, labels[:, :width])
    mask = labels[:, :width] != -100
    for name in ("logprobs", "ref_logprobs", "entropy"):
        a, b = getattr(pred, name)[:, :width], getattr(p_pred, name)
        torch.testing.assert_close(b[mask], a[mask], rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(p_loss, loss, rtol=1e-5, atol=1e-7)
    for name, g in grads.items():
        torch.testing.assert_close(p_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    p_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in p_grads.values()))
    assert abs(p_norm - norm) <= 1e-4 * norm


def test_length_buckets_cover_every_sequence_once_within_their_slack():
    from plugin.model.attention import BUCKET_FREE, BUCKET_SLACK, length_buckets

    lengths = [1088, 900, 60, 61, 300, 290, 5, 3, 700, 64, 1]
    buckets = length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        longest = max(lengths[i] for i in b)
        assert lengths[b[0]] == longest
        assert len(b) * longest**2 <= BUCKET_SLACK * sum(lengths[i] ** 2 for i in b) + BUCKET_FREE
    assert len(buckets) < len(lengths)  # similar lengths share a call
    assert length_buckets([16] * 12) == [list(range(12))]  # equal lengths: one call


def test_an_attention_without_a_per_sequence_path_stops_at_start_up_naming_the_key():
    with pytest.raises(ValueError, match=r"\[grpo\] padding_free = true needs the flavor's SDPA attention.*'flex'"):
        _model(True, "--model.flavor", "debugmodel_flex_attn")
    _model(False, "--model.flavor", "debugmodel_flex_attn")  # padded, the flavor's own attention
