"""[grpo] fused_policy_pass: each chunk's forward and backward inside the policy's forward, against today's path and fp64.

1. Model-level checks build the debug GRPO model on one rank and compare the fused loss and every
   parameter's gradient with today's path (log-probs to the loss, chunks recomputed in backward).
2. fused_chunked_loss in vocab blocks (an uneven last one) against autograd through log_softmax
   on one rank; at TP=2 on a vocab-parallel head (uneven vocab, 1271 over 2 ranks) inside
   loss_parallel, against an fp64 reference of the same per-token loss and against one block.
3. FSDP=2 (model level, 2 gloo ranks): every aggregation mode with gradient accumulation, tied
   weights, the head resharded after forward, and bf16 parameters, against today's path.
4. blocked_logprobs, the reference's pass in the same vocab blocks: log-probs and entropies against
   chunked_logprobs on one rank (eager and compiled) and against fp64 at TP=2.
5. torchtitan's own train.py on 1, 2 and 4 ranks (TP, FSDP, HSDP), fused against unfused: the runs on
   as many ranks share one torchrun launch.
The 2-rank checks of 2-4 (spawned gloo ranks) share one spawned group.
"""

import contextlib
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from conftest import DEVICES, build_model, run, run_ranks, scalars, train_runs
from plugin.data.batch import Rollouts, loss_weights
from plugin.scoring.logprobs import Scoring, blocked_logprobs, chunked_logprobs, compute_logprobs_and_entropy, fused_chunked_loss
from test_logprobs import (
    SAME_TOL,
    TOL,
    Checks,
    Head,
    _tp_head,
    assert_check_passed,
    close,
    graphs_compiled,
    load_checks,
    make_hidden,
    make_labels,
    make_weights,
    ref_entropy,
    ref_head,
    ref_logprobs,
)

B, T = 4, 16
# fp32, the same math in another order: the fused pass's closed-form d loss / d logits against
# log_softmax's backward (seen: < 3e-6 relative; 3e-7 of the largest entry on near-zero ones)
RTOL, ATOL = 2e-5, 1e-6


def batch(seed: int, mode: str):
    g = torch.Generator().manual_seed(seed)
    tokens, labels = torch.randint(0, 2048, (B, T), generator=g), torch.randint(0, 2048, (B, T), generator=g)
    labels[:, :5] = -100
    labels[1, -4:] = -100  # a shorter completion: the seq modes weight it differently
    lens = (labels != -100).sum(1)
    old = torch.full((B, T), float("nan"))
    old[0, 6:10] = -7.5  # behaviour log-probs on a few tokens: ratios away from 1, some clipped
    rollouts = Rollouts(torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([1.0, 0.0, 1.0, 0.0]),
                        loss_weights(lens, mode, T), old)
    return tokens, labels, rollouts


def train(fused: bool, mode: str, *extra: str, microbatches: int = 1, parallel_dims=None, rank: int = 0,
          replay: bool = False):
    """Loss per microbatch and the accumulated gradients of every parameter, from one seed.

    `replay`: behaviour log-probs on every completion token, the policy's own moved by noise (as in a
    replay, mu > 1), so every completion's ratio differs from 1."""
    model, cfg, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--grpo.loss_aggregation", mode,
                                 "--grpo.entropy_coef", "0.01", "--grpo.logprob_chunk_tokens", "12",
                                 "--grpo.dual_clip", "3", "--grpo.fused_policy_pass" if fused else "--grpo.no_fused_policy_pass", *extra,
                                 parallel_dims=parallel_dims)
    from plugin.scoring.loss import build_grpo_loss

    loss_fn = build_grpo_loss(cfg)
    model.reference.load_once(model, torch.device("cpu"))
    with torch.no_grad():  # a reference away from the policy: KL and its gradient are not 0
        g = torch.Generator().manual_seed(1)
        for p in model.reference.module.parameters():
            noise = 0.05 * torch.randn(p.shape, generator=g)
            p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)
    losses = []
    for j in range(microbatches):
        tokens, labels, rollouts = batch(100 * rank + j, mode)  # data parallel ranks score different batches
        if replay:
            noise = torch.randn(labels.shape, generator=torch.Generator().manual_seed(7 + j)) * 0.1
            noise += torch.linspace(-0.3, 0.3, labels.shape[0])[:, None]  # sequence ratios from 0.74 to 1.35
            rollouts.old_logprobs = model.logprobs(tokens, labels) + noise
        pred = model(tokens, labels=labels, rollouts=rollouts)
        assert (pred.fused_loss is not None) == fused
        loss = loss_fn(pred, labels)
        loss.backward()
        losses.append(loss.detach())
    stats = model.stats.device_sums.clone()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.clone()  # noqa: E731
    return losses, {n: full(p.grad) for n, p in model.named_parameters()}, stats


def assert_same(got, want):
    (losses, grads, stats), (want_losses, want_grads, want_stats) = got, want
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=RTOL, atol=ATOL)
    # the metrics (KL, ratio, clip fractions, entropy) are the same too
    torch.testing.assert_close(stats, want_stats, rtol=RTOL, atol=1e-6)
    for name, grad in want_grads.items():
        # absolute roundoff grows with the tensor's scale (qwen3's tied weight reaches ~10)
        atol = ATOL * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(grads[name], grad, rtol=RTOL, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"])
def test_fused_matches_todays_path(mode):
    """Every aggregation mode, with an entropy bonus, dual clip, behaviour log-probs and KL: same loss and gradients."""
    assert_same(train(True, mode), train(False, mode))


SEQUENCE = ("--grpo.importance_sampling_level", "sequence")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"])
def test_fused_sequence_ratio_matches_todays_path(mode):
    """GSPO's ratio needs each completion's mean log-ratio before the first chunk: same loss, gradients and metrics."""
    fused = train(True, mode, *SEQUENCE, replay=True)
    assert_same(fused, train(False, mode, *SEQUENCE, replay=True))
    assert not torch.allclose(fused[0][0], train(False, mode, replay=True)[0][0])  # not the token-level loss


def test_fused_tied_weights():
    """qwen3's output layer shares the embedding's weight: its two gradients add up as today."""
    qwen3 = ("--model.name", "grpo_qwen3")
    assert_same(train(True, "token_mean", *qwen3), train(False, "token_mean", *qwen3))


def test_fused_gradient_accumulation():
    """Two microbatches' gradients accumulate in .grad as today's do."""
    assert_same(train(True, "seq_mean_token_mean", microbatches=2), train(False, "seq_mean_token_mean", microbatches=2))


@pytest.mark.slow  # inductor compiles on CPU: tens of seconds
def test_fused_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compiled = ("--compile.enable", "--compile.components", "loss", "--grpo.use_bias_correction_kl")
    with graphs_compiled() as graphs:
        fused = train(True, "token_mean", *compiled)
    assert_same(fused, train(False, "token_mean", "--grpo.use_bias_correction_kl"))
    # the block statistics, the block gradients, and the loss's terms with and without grad (the metrics'):
    # each once, whatever a chunk's or a batch's tokens (7 graphs when the first call's sizes were specialized)
    assert graphs == [4]


def test_fused_head_runs_once_per_chunk():
    """Nothing is recomputed in backward: the final norm runs in forward only, once per chunk."""
    Tn, V = 47, 1271
    head, hidden, labels, w = Head(16, V), make_hidden(Tn), make_labels(Tn, V), make_weights(Tn)
    calls = []
    head.norm.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
    h = hidden.clone().requires_grad_()
    loss, logprobs, _ = fused_chunked_loss(h, labels, head.norm, head.output.weight, lambda lp, ent, index: (lp * w.view(-1)[index]).sum(), Scoring(chunk_tokens=10))
    assert len(calls) == 10 and sum(calls) == 2 * Tn
    loss.backward()
    assert len(calls) == 10
    assert not logprobs.requires_grad


def _autograd_loss(head, hidden, labels, token_loss, temperature):
    """The per-token loss through autograd on the whole batch's logits: log_softmax, its entropy and their backward."""
    logprobs, entropy = compute_logprobs_and_entropy(head(hidden), labels, temperature, entropy_grad=True)
    return token_loss(logprobs.view(-1), entropy.view(-1), torch.arange(labels.numel()))


def _nonlinear_loss(w, u, mask):
    """A per-token loss nonlinear in the log-probs, with an entropy term; on a chunk's tokens at `index`."""
    def token_loss(lp, ent, index):
        wi, ui, m = w.view(-1)[index].to(lp.dtype), u.view(-1)[index].to(lp.dtype), mask.view(-1)[index]
        return ((wi * lp + ui * ent + 0.3 * lp.exp() * wi) * m).sum()
    return token_loss


# blocks of the 1271-row vocabulary: 13 (the last of 71 rows), 2 (1024 + 247), 1 (the whole vocabulary)
VOCAB_BLOCKS = [100, 1024, 4096]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_block", VOCAB_BLOCKS)
@pytest.mark.parametrize("chunk_tokens", [0, 13])
def test_fused_vocab_blocks(vocab_block, chunk_tokens, device):
    """The online log-sum-exp over vocab blocks: loss, log-probs, entropies and every gradient match autograd's."""
    Tn, V, temperature = 47, 1271, 0.7
    head, hidden, labels = Head(16, V).to(device), make_hidden(Tn).to(device), make_labels(Tn, V).to(device)
    token_loss = _nonlinear_loss(make_weights(Tn).to(device), make_weights(Tn, seed=5).to(device), labels != -100)
    h = hidden.clone().requires_grad_()
    want_loss = _autograd_loss(head, h, labels, token_loss, temperature)
    want_h, *want_grads = torch.autograd.grad(want_loss, [h, *head.parameters()])
    with torch.no_grad():
        want_lp, want_ent = chunked_logprobs(hidden, labels, head, Scoring(temperature=temperature))
    h = hidden.clone().requires_grad_()
    loss, logprobs, entropy = fused_chunked_loss(h, labels, head.norm, head.output.weight, token_loss, Scoring(temperature=temperature, chunk_tokens=chunk_tokens, entropy_grad=True, vocab_block=vocab_block))
    loss.backward()
    # fp32, the same math in another summation order
    torch.testing.assert_close(loss, want_loss, **SAME_TOL["value"])
    torch.testing.assert_close(logprobs, want_lp, **SAME_TOL["value"])
    torch.testing.assert_close(entropy, want_ent, **SAME_TOL["value"])
    torch.testing.assert_close(h.grad, want_h, **SAME_TOL["grad"])
    for (name, p), want in zip(head.named_parameters(), want_grads):
        torch.testing.assert_close(p.grad, want, **SAME_TOL["grad"], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab_block", VOCAB_BLOCKS)
@pytest.mark.parametrize("chunk_tokens", [0, 13])
def test_blocked_logprobs(vocab_block, chunk_tokens, device):
    """The reference's pass in vocab blocks: chunked_logprobs' log-probs (0 at ignored labels) and entropies."""
    Tn, V, temperature = 47, 1271, 0.7
    head, hidden, labels = Head(16, V).to(device), make_hidden(Tn).to(device), make_labels(Tn, V).to(device)
    with torch.no_grad():
        want_lp, want_ent = chunked_logprobs(hidden, labels, head, Scoring(temperature=temperature))
    logprobs, entropy = blocked_logprobs(hidden, labels, head.norm, head.output.weight, Scoring(temperature=temperature, chunk_tokens=chunk_tokens, vocab_block=vocab_block))
    assert not logprobs.requires_grad and (logprobs[labels == -100] == 0).all()
    torch.testing.assert_close(logprobs, want_lp, **SAME_TOL["value"])
    torch.testing.assert_close(entropy, want_ent, **SAME_TOL["value"])
    only_logprobs, none = blocked_logprobs(hidden, labels, head.norm, head.output.weight, Scoring(temperature=temperature, chunk_tokens=chunk_tokens, vocab_block=vocab_block, with_entropy=False))
    assert none is None and torch.equal(only_logprobs, logprobs)


@pytest.mark.slow  # inductor compiles two block shapes on CPU
def test_blocked_logprobs_compiled(tmp_path, monkeypatch):
    """Compiled (an uneven last block, so two block shapes), the same values as eager."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    Tn, V = 47, 1271
    head, hidden, labels = Head(16, V), make_hidden(Tn), make_labels(Tn, V)
    args = (hidden, labels, head.norm, head.output.weight)
    want = blocked_logprobs(*args, Scoring(chunk_tokens=13, vocab_block=100))
    with graphs_compiled() as graphs:
        got = blocked_logprobs(*args, Scoring(chunk_tokens=13, vocab_block=100, compiled=True))
    assert graphs == [2]  # one per block shape; chunks of 13 tokens and the last, shorter one share them
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **SAME_TOL["value"])


FSDP_CASES = {  # every case accumulates two microbatches, with an entropy bonus
    **{mode: (mode,) for mode in ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"]},
    "tied": ("token_mean", "--model.name", "grpo_qwen3"),
    "reshard_always": ("token_mean", "--parallelism.fsdp_reshard_after_forward", "always"),
    "bf16": ("token_mean", "--training.mixed_precision_param", "bfloat16"),
}


def _fsdp_fused(rank):
    """FSDP=2: the fused pass against today's path, each case from the same seed on both."""
    from torchtitan.distributed import ParallelDims

    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    fsdp = ("--parallelism.data_parallel_shard_degree", "2")
    return {name: [train(fused, *case, *fsdp, microbatches=2, parallel_dims=pd, rank=rank)
                   for fused in (True, False)] for name, case in FSDP_CASES.items()}


def _two_ranks(rank, world_size, out_dir):
    """Every 2-rank check of this file in one spawned group (a spawn's start-up and imports cost as much as one of
    the two groups' work): the vocab-parallel head's cases, then the model-level comparisons, the FSDP cases and
    GSPO's sequence ratio. Each pair (fused, today's path) is built from the same seed, so what ran before in the
    process is the same for both."""
    _tp_fused(rank, world_size, out_dir)
    results = {"fsdp": _fsdp_fused(rank), "sequence": _sequence_ranks(rank)}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "models.pt"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    run_ranks(2, _two_ranks, str(out))
    return out


@pytest.fixture(scope="module")
def model_ranks(two_ranks):
    return torch.load(two_ranks / "models.pt")


@pytest.fixture(scope="module")
def fsdp_fused(model_ranks):
    return model_ranks["fsdp"]


@pytest.mark.parametrize("case", [c for c in FSDP_CASES if c != "bf16"])
def test_fused_fsdp2(fsdp_fused, case):
    """The head's gradient computed in forward is reduce-scattered like any other: same losses, gradients, metrics."""
    assert_same(*fsdp_fused[case])


def test_fused_fsdp2_bf16(fsdp_fused):
    """bf16 parameters, fp32 reduce: the same losses and gradients up to bf16 roundoff."""
    (losses, grads, _), (want_losses, want_grads, _) = fsdp_fused["bf16"]
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-2, atol=1e-3)
    for name, grad in want_grads.items():
        # bf16 compute both ways; the rounding of the chunk sums differs
        assert (grads[name] - grad).norm() <= 2e-2 * grad.norm() + 1e-6, name


TP_CASES = [(0, 4096), (10, 4096), (30, 4096), (0, 100), (10, 100), (30, 256)]  # (chunk_tokens, vocab_block)


def _tp_fused(rank, world_size, out_dir):
    """Fused at TP=2 on a vocab-parallel head (V = 1271: shards of 636 and 635) against fp64, chunked and
    not; in vocab blocks (of 100 rows: the last of 36 and 35; of 256: 124 and 123) against one block."""
    mesh = init_device_mesh("cpu", (world_size,))
    checks = Checks(out_dir, rank)
    Tn, V, temperature = 46, 1271, 0.7
    hidden, labels = make_hidden(Tn), make_labels(Tn, V)
    token_loss = _nonlinear_loss(make_weights(Tn), make_weights(Tn, seed=5), labels != -100)
    local = slice(rank * Tn // 2, (rank + 1) * Tn // 2)
    results = {}

    def check(chunk_tokens, vocab_block):
        head = _tp_head(mesh, V)
        h = hidden[:, local].clone().requires_grad_()
        with loss_parallel():
            loss, logprobs, entropy = fused_chunked_loss(h, labels, head.norm, head.output.weight, token_loss, Scoring(temperature=temperature, chunk_tokens=chunk_tokens, seq_shards=2, entropy_grad=True, vocab_block=vocab_block))
            loss.backward()
        got = [loss, logprobs, entropy, h.grad, head.norm.weight.grad.full_tensor(),
               head.output.weight.grad.full_tensor()]
        results[chunk_tokens, vocab_block] = got
        what = f"TP=2 fused chunk_tokens={chunk_tokens} vocab_block={vocab_block}"
        if vocab_block < 636:  # against the same chunks in one block each
            for name, a, b in zip(["loss", "log-probs", "entropy", "d/d hidden", "d/d norm", "d/d output"], got,
                                  results[chunk_tokens, 4096]):
                close(a, b, SAME_TOL["value" if name[0] != "d" else "grad"], f"{what}: {name} vs one block")
            return
        full = lambda p: p.full_tensor().detach().double().requires_grad_()  # noqa: E731
        h64, n64, o64 = hidden.double().requires_grad_(), full(head.norm.weight), full(head.output.weight)
        logits = ref_head(h64, n64, o64, head.norm.eps)
        ref_loss = token_loss(ref_logprobs(logits, labels, temperature).view(-1),
                              ref_entropy(logits, temperature).view(-1), torch.arange(labels.numel()))
        ref_loss.backward()
        close(loss, ref_loss, TOL[torch.float32]["value"], f"{what}: loss")
        close(h.grad, h64.grad[:, local], TOL[torch.float32]["grad"], f"{what}: d/d hidden")
        for name, p, ref in (("norm", head.norm.weight, n64), ("output", head.output.weight, o64)):
            assert isinstance(p.grad, DTensor), name
            close(p.grad.full_tensor(), ref.grad, TOL[torch.float32]["grad"], f"{what}: d/d {name}.weight")

    def check_blocked(chunk_tokens, vocab_block):
        head = _tp_head(mesh, V)
        logprobs, entropy = blocked_logprobs(hidden[:, local], labels, head.norm, head.output.weight, Scoring(temperature=temperature, chunk_tokens=chunk_tokens, seq_shards=2, vocab_block=vocab_block))
        full = lambda p: p.full_tensor().double()  # noqa: E731
        logits = ref_head(hidden.double(), full(head.norm.weight), full(head.output.weight), head.norm.eps)
        what = f"TP=2 blocked chunk_tokens={chunk_tokens} vocab_block={vocab_block}"
        close(logprobs, ref_logprobs(logits, labels, temperature), TOL[torch.float32]["value"], f"{what}: log-probs")
        close(entropy, ref_entropy(logits, temperature), TOL[torch.float32]["value"], f"{what}: entropy")
        only_logprobs, none = blocked_logprobs(hidden[:, local], labels, head.norm, head.output.weight, Scoring(temperature=temperature, chunk_tokens=chunk_tokens, seq_shards=2, vocab_block=vocab_block, with_entropy=False))
        assert none is None and torch.equal(only_logprobs, logprobs), f"{what}: log-probs without the entropy"

    for chunk_tokens, vocab_block in TP_CASES:
        checks.run(f"fused_{chunk_tokens}_{vocab_block}", check, chunk_tokens, vocab_block)
        checks.run(f"blocked_{chunk_tokens}_{vocab_block}", check_blocked, chunk_tokens, vocab_block)
    checks.save()


@pytest.fixture(scope="module")
def tp_fused(two_ranks):
    return load_checks(two_ranks)


@pytest.mark.parametrize("chunk_tokens, vocab_block", TP_CASES)
def test_fused_tp2(tp_fused, chunk_tokens, vocab_block):
    """Vocab-sharded weight under loss_parallel, uneven vocab: loss and gradients (hidden, norm, output) match
    fp64 in one block; in several (an uneven last one), log-probs, entropies and gradients match one block's."""
    assert_check_passed(tp_fused, f"fused_{chunk_tokens}_{vocab_block}")


@pytest.mark.parametrize("chunk_tokens, vocab_block", TP_CASES)
def test_blocked_tp2(tp_fused, chunk_tokens, vocab_block):
    """The reference's pass on the vocab-parallel head, uneven vocab and blocks: log-probs and entropies match fp64."""
    assert_check_passed(tp_fused, f"blocked_{chunk_tokens}_{vocab_block}")


def _sequence_ranks(rank):
    """GSPO's sequence-level ratio on 2 ranks, replayed batches: TP=2 (same batch on both ranks) and FSDP=2."""
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.distributed import ParallelDims

    results = {}
    for name, (tp, dp) in {"tp2": (2, 1), "fsdp2": (1, 2)}.items():
        pd = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=2)
        flags = (*SEQUENCE, "--parallelism.tensor_parallel_degree", str(tp), "--parallelism.data_parallel_shard_degree",
                 str(dp))
        with loss_parallel() if tp > 1 else contextlib.nullcontext():  # as torchtitan's train_context under TP
            results[name] = [train(fused, "seq_mean_token_mean", *flags, microbatches=2, parallel_dims=pd,
                                   rank=rank if dp > 1 else 0, replay=True) for fused in (True, False)]
    return results


@pytest.fixture(scope="module")
def sequence_ranks(model_ranks):
    return model_ranks["sequence"]


@pytest.mark.parametrize("layout", ["tp2", "fsdp2"])
def test_fused_sequence_ratio_tp2_fsdp2(sequence_ranks, layout):
    """Under TP each rank's chunks hold its sequence shard; under FSDP the head's pre-pass runs inside its gather."""
    assert_same(*sequence_ranks[layout])


# (nproc, tp, replicate): the ranks TP and `replicate` (HSDP's replicas) leave over shard the model (FSDP)
RUN_LAYOUTS = {"1rank": (1, 1, 1), "tp2": (2, 2, 1), "fsdp2": (2, 1, 1), "tp2_fsdp2": (4, 2, 1), "hsdp2x2": (4, 1, 2)}


@pytest.fixture(scope="module")
def fused_runs(seed_checkpoint, tmp_path_factory):
    """torchtitan's own train.py, 2 steps with an entropy bonus and chunks, fused and unfused on every layout:
    the runs on as many ranks share a launch (3 in all)."""
    runs = {}
    for layout, (nproc, tp, replicate) in RUN_LAYOUTS.items():
        flags = ["--parallelism.tensor_parallel_degree", str(tp), "--parallelism.data_parallel_replicate_degree",
                 str(replicate), "--grpo.entropy_coef", "0.01", "--grpo.logprob_chunk_tokens", "64"]
        runs[f"unfused_{layout}"] = run(seed_checkpoint, nproc, *flags, "--grpo.no_fused_policy_pass", steps=2)
        runs[f"fused_{layout}"] = run(seed_checkpoint, nproc, *flags, "--grpo.fused_policy_pass", steps=2)
    return {name: scalars(dump) for name, dump in train_runs(tmp_path_factory, runs).items()}


@pytest.mark.parametrize("layout", list(RUN_LAYOUTS))
def test_fused_run_matches_todays_path(fused_runs, layout):
    """The fused and the unfused run: the same losses, grad norms, entropies and KL at both steps."""
    want, got = fused_runs[f"unfused_{layout}"], fused_runs[f"fused_{layout}"]
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/entropy", "grpo/kl"):
        assert len(want[tag]) == len(got[tag]) == 2, tag
        assert got[tag] == pytest.approx(want[tag], rel=1e-4, abs=1e-7), tag


def _grad_errors(head_dtype, hidden, labels, weight, norm_weight, adv, fused_scoring=None):
    """Max error of d loss / d hidden and d loss / d output weight, relative to the largest fp64 entry, of the
    GRPO-like loss -sum(A * logprobs) / N: plain logits in `head_dtype`, or the fused pass with `fused_scoring`."""
    def grads(dtype, scoring):
        h = hidden.detach().to(dtype).clone().requires_grad_()
        w = weight.detach().to(dtype).clone().requires_grad_()
        norm = torch.nn.RMSNorm(hidden.shape[-1], eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(norm_weight)
        if scoring is None:  # the plain path: the whole batch's logits, log_softmax in fp32
            logits = norm(h) @ w.T
            lp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
            loss = -(adv * lp).sum() / labels.numel()
        else:
            loss, _, _ = fused_chunked_loss(h, labels, norm, w, lambda lp, ent, index: -(adv.view(-1)[index] * lp).sum() / labels.numel(), scoring)
        loss.backward()
        return h.grad.double(), w.grad.double()

    want = grads(torch.float64, None)
    got = grads(head_dtype, fused_scoring)
    return [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_bf16_gradients_as_precise_as_plain(device):
    """In bf16 the fused pass's gradients are as close to fp64 as the plain path's (within 25%): each vocab block's
    products come out in fp32 and sum in fp32, so the hidden states' and the output weight's gradients are
    rounded to bf16 once, as a single matmul over the whole vocabulary or batch rounds them.

    The labels repeat (64 distinct ids over 1,024 tokens), so an output row collects gradient from every chunk. When
    each chunk's and each block's product was rounded to bf16 before the sum, the errors here were 1.6x (hidden)
    and 2.6x (output weight) the plain path's; now they are equal to it. On CUDA the block products take bf16 operands
    (mm's out_dtype) and plain bf16 is cuBLAS's; the fp64 reference is computed there too."""
    g = torch.Generator().manual_seed(0)
    N, V, D = 1024, 16384, 64
    hidden = torch.randn(2, N // 2, D, generator=g).bfloat16().to(device)
    weight = (0.25 * torch.randn(V, D, generator=g)).bfloat16().to(device)  # logits of std ~2: a peaked softmax
    norm_weight = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16().to(device)
    labels = torch.randint(0, 64, (2, N // 2), generator=g).to(device)
    adv = torch.randn(2, N // 2, generator=g).to(device)
    plain = _grad_errors(torch.bfloat16, hidden, labels, weight, norm_weight, adv)
    fused = _grad_errors(torch.bfloat16, hidden, labels, weight, norm_weight, adv, Scoring(chunk_tokens=64, vocab_block=256))
    print(f"{device}: bf16 gradient errors against fp64 (hidden, output weight): plain {plain}, fused {fused}")
    for what, p, f in zip(["d loss / d hidden", "d loss / d output weight"], plain, fused):
        assert f <= 1.25 * p, f"{what}: fused {f:.2e} against plain bf16 {p:.2e}"
