"""The GRPO model under FSDP2 on 2 gloo ranks: bf16 inputs, the head's collectives when scoring in
chunks, the reference's FSDP state, tied weights.

The model is built in each rank as torchtitan's Trainer builds it (meta init, the TrainSpec's
parallelize function, to_empty, init_weights), from the bundled config with FSDP=2.
"""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from conftest import build_model, ranks_result, run_ranks

B, T = 4, 16


def build(*overrides):
    """The model on FSDP=2; its log-probs go to each test's own loss, so the unfused policy pass (the fused one
    takes its gradients inside forward and returns detached log-probs)."""
    from torchtitan.distributed import ParallelDims

    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    model, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--parallelism.data_parallel_shard_degree",
                            "2", "--grpo.no_fused_policy_pass", *overrides, parallel_dims=pd)
    return model


def batch(rank: int, step: int = 0):
    """This rank's microbatch: completions on the last 10 positions, fp32 values that bf16 would round."""
    from plugin.data.batch import Rollouts

    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 2048, (B, T), generator=g)
    labels = torch.randint(0, 2048, (B, T), generator=g)
    labels[:, :6] = -100
    advantages = torch.tensor([0.123456789, -1.0000001, 0.7071067, -0.3333333])
    old = torch.full((B, T), float("nan"))
    old[:, 6:] = -6.3 - torch.rand(B, 10, generator=g, dtype=torch.float64).float()
    rollouts = Rollouts(advantages, torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([1.1, 0.9, 1.0000001, 0.3]), old)
    return tokens, labels, rollouts


def _rollouts_keep_fp32(rank, world_size, out):
    model = build("--training.mixed_precision_param", "bfloat16", "--grpo.beta", "0")
    assert model.tok_embeddings.weight.dtype == torch.float32  # sharded params stay fp32; compute is bf16
    tokens, labels, rollouts = batch(rank)
    pred = model(tokens, labels=labels, rollouts=rollouts)
    assert pred.logprobs.dtype == torch.float32
    for name in ("advantages", "loss_weights", "old_logprobs"):
        sent, received = getattr(rollouts, name), getattr(pred, name)
        assert received.dtype == torch.float32, name
        assert torch.equal(received.nan_to_num(), sent.nan_to_num()), name


def test_rollouts_reach_the_loss_unrounded_with_bf16_fsdp(tmp_path):
    """FSDP2 casts forward inputs to the param dtype, recursing into dataclasses; Rollouts is not one."""
    run_ranks(2, _rollouts_keep_fp32, str(tmp_path))


def test_bf16_cast_leaves_rollouts_alone():
    from torch.distributed.utils import _cast_forward_inputs

    _, _, rollouts = batch(0)
    (cast,), _ = _cast_forward_inputs(torch.bfloat16, rollouts)
    assert cast is rollouts and cast.advantages.dtype == torch.float32
    assert cast.advantages[0].item() == pytest.approx(0.123456789, abs=1e-8)


class CommCounter:
    """Counts FSDP2's all-gathers and reduce-scatters (the collectives it issues through its default comms)."""

    def __init__(self, monkeypatch):
        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        for name, cls in (("all_gather", _fsdp_collectives.DefaultAllGather),
                          ("reduce_scatter", _fsdp_collectives.DefaultReduceScatter)):
            monkeypatch.setattr(cls, "__call__", self._counting(name, cls.__call__))

    def _counting(self, name, call):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return call(*args, **kwargs)
        return counted

    def take(self) -> dict[str, int]:
        taken, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return taken


def _chunked_head_comms(rank, world_size, out):
    mp = pytest.MonkeyPatch()
    counter = CommCounter(mp)
    results = {}
    for chunk in (0, 2, 4):  # 1, 8 and 4 chunks of the 16 positions
        model = build("--grpo.logprob_chunk_size", str(chunk), "--grpo.beta", "0.04")
        model.train()
        per_microbatch = []
        for step in range(2):  # two microbatches into the same gradients (gradient accumulation)
            tokens, labels, rollouts = batch(rank, step)
            counter.take()
            pred = model(tokens, labels=labels, rollouts=rollouts)
            forward = counter.take()
            loss = -(pred.advantages[:, None] * pred.logprobs).sum() + (pred.logprobs - pred.ref_logprobs).sum()
            loss.backward()
            backward = counter.take()
            per_microbatch.append((forward, backward))
            # the reference never runs backward: its FSDP root's per-iteration records must not pile up
            assert len(model.reference.module._get_fsdp_state()._comm_ctx.post_forward_order) == 0
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results[chunk] = (per_microbatch, grads)
    mp.undo()
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def chunked_head(tmp_path_factory):
    return ranks_result(tmp_path_factory, "chunked_head", 2, _chunked_head_comms)


def test_chunked_scoring_gathers_and_reduces_the_head_once(chunked_head):
    """However many chunks, FSDP's collectives per microbatch are those of the unchunked model."""
    unchunked = chunked_head[0][0]
    for chunk in (2, 4):
        assert chunked_head[chunk][0] == unchunked, chunk
    (forward, backward) = unchunked[0]
    # groups with parameters: 6 blocks, the embedding, the head (the root holds none). Forward:
    # the policy's and the reference's; backward: the policy's, all but the head's resharded
    assert forward == {"all_gather": 2 * 8, "reduce_scatter": 0}
    assert backward == {"all_gather": 7, "reduce_scatter": 8}


def test_chunked_scoring_gradients_match_unchunked(chunked_head):
    unchunked = chunked_head[0][1]
    for chunk in (2, 4):
        for name, grad in chunked_head[chunk][1].items():
            torch.testing.assert_close(grad, unchunked[name], rtol=1e-5, atol=1e-6, msg=name)


def _tied_qwen3(rank, world_size, out):
    model = build("--model.name", "grpo_qwen3", "--grpo.beta", "0.04", "--grpo.logprob_chunk_size", "4")
    for m in (model, model.reference.module):
        assert m.output.weight is m.tok_embeddings.weight
        assert isinstance(m.output, FSDPModule)
        # the embedding shares the head's group, as FSDP2 requires for a shared parameter
        assert m.output._get_fsdp_state() is m.tok_embeddings._get_fsdp_state()
    tokens, labels, rollouts = batch(rank)
    pred = model(tokens, labels=labels, rollouts=rollouts)
    (-(pred.advantages[:, None] * pred.logprobs).sum()).backward()
    grad = model.output.weight.grad.full_tensor()
    if rank == 0:
        torch.save(grad, out)


def test_tied_weights_train_under_fsdp_without_tp(tmp_path):
    """qwen3's tied embedding/output with FSDP=2, TP=1: one parameter, one FSDP group, one gradient."""
    out = tmp_path / "grad.pt"
    run_ranks(2, _tied_qwen3, str(out))
    grad = torch.load(out)
    # both uses reach the one gradient: the embedding's rows of this batch's tokens too
    assert grad.abs().sum() > 0
