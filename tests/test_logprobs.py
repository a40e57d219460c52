"""plugin/logprobs.py against an fp64 pure-torch reference: plain, vocab-sharded (TP=2), chunked, compiled.

1. The reference below is written from logsumexp, not from the cross_entropy /
   log_softmax calls the code under test makes.
2. Multi-rank checks run on 2 gloo ranks on CPU. Every spawn re-imports torchtitan (~15 s on
   2 cores), so each fixture runs a whole family of checks in one spawn and records each
   check's assertion message per rank; the tests then look their own check up.
3. bf16 inputs are compared against the fp64 reference of the bf16-rounded logits: the code
   upcasts to fp32 before the softmax, so bf16 values get fp32 tolerances and only the
   gradients (returned in bf16) get bf16 ones.
"""

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torchtitan.components.loss import IGNORE_INDEX

from conftest import run_ranks
import plugin.scoring.logprobs
from plugin.model.parallelize import tag_compile_caches
from plugin.scoring.logprobs import (
    Scoring,
    chunk_tokens_for,
    chunked_logprobs,
    compute_entropy,
    compute_logprobs,
    compute_logprobs_and_entropy,
    maybe_compiled,
)

B = 2
D = 16

# value: log-probs and entropies; grad: d(sum(w * out)) / d(logits | hidden | weights)
# (errors seen: fp32 values 2e-6, grads 1e-6; bf16 grads 4e-3 relative, i.e. one bf16 rounding)
TOL = {
    torch.float32: {"value": dict(atol=2e-5, rtol=1e-5), "grad": dict(atol=1e-5, rtol=1e-4)},
    torch.bfloat16: {"value": dict(atol=2e-5, rtol=1e-5), "grad": dict(atol=1e-5, rtol=1.6e-2)},
}
# |logits| ~ 1e4: log-probs reach -3e4, where fp32 keeps ~7 digits (2e-3 absolute seen)
EXTREME_TOL = {dtype: {**tol, "value": dict(atol=2e-5, rtol=1e-6)} for dtype, tol in TOL.items()}
# the same fp32 math, chunked or compiled, against the unchunked eager run: summation order only
SAME_TOL = {"value": dict(atol=1e-5, rtol=1e-6), "grad": dict(atol=1e-6, rtol=1e-5)}


def ref_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp64 log softmax(logits / temperature)[labels], 0 at IGNORE_INDEX."""
    x = logits.double() / temperature
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels == IGNORE_INDEX, 0.0, picked)


def ref_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp64 sum_v -p log p of softmax(logits / temperature); finite logits only."""
    x = logits.double() / temperature
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    return -(logp.exp() * logp).sum(-1)


def ref_head(hidden, norm_weight, out_weight, eps):
    """fp64 logits of the final norm + output layer."""
    h = hidden.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    return h @ out_weight.double().T


def make_logits(T: int, V: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, T, V, generator=g)).to(dtype)


def make_extreme_logits(T: int, V: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Mostly N(0, 9), a tenth +1e4 and a tenth -1e4; row (1, 0) is -1e4 but for one +1e4."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(B, T, V, generator=g)
    u = torch.rand(B, T, V, generator=g)
    logits[u < 0.1] = 1e4
    logits[u > 0.9] = -1e4
    logits[1, 0] = -1e4
    logits[1, 0, V // 3] = 1e4
    return logits.to(dtype)


def make_labels(T: int, V: int, seed: int = 1) -> torch.Tensor:
    """Random labels with ignored positions and the vocab edges and middle (the TP shard border)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(V, (B, T), generator=g)
    labels[0, :7] = IGNORE_INDEX  # a prompt-like prefix
    labels[1, -3:] = IGNORE_INDEX  # padding-like suffix
    labels[1, :5] = torch.tensor([0, V - 1, (V + 1) // 2 - 1, (V + 1) // 2, V // 3])
    return labels


def make_weights(T: int, seed: int = 2) -> torch.Tensor:
    """Upstream gradient for the log-probs: random, so a misplaced gradient shows."""
    return torch.randn(B, T, generator=torch.Generator().manual_seed(seed))


def close(actual, expected, tol, what: str) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [47, 64])
@pytest.mark.parametrize("V", [1271, 2048])
def test_logprobs_plain(V, T, dtype, temperature):
    logits = make_logits(T, V, dtype).requires_grad_()
    labels, w = make_labels(T, V), make_weights(T)
    logprobs = compute_logprobs(logits, labels, temperature)
    assert type(logprobs) is torch.Tensor and logprobs.dtype == torch.float32 and logprobs.shape == (B, T)

    ref_in = logits.detach().double().requires_grad_()
    ref = ref_logprobs(ref_in, labels, temperature)
    close(logprobs, ref, TOL[dtype]["value"], "logprobs")
    ignored = labels == IGNORE_INDEX
    assert (logprobs[ignored] == 0).all()

    (logprobs * w).sum().backward()
    (ref * w.double()).sum().backward()
    assert logits.grad.dtype == dtype
    close(logits.grad, ref_in.grad, TOL[dtype]["grad"], "d logprobs / d logits")
    assert (logits.grad[ignored] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, V", [(47, 1271), (64, 2048)])
def test_entropy_plain(V, T, dtype, temperature):
    logits = make_logits(T, V, dtype).requires_grad_()
    w = make_weights(T)
    entropy = compute_entropy(logits, temperature)
    assert type(entropy) is torch.Tensor and entropy.dtype == torch.float32 and entropy.shape == (B, T)

    ref_in = logits.detach().double().requires_grad_()
    ref = ref_entropy(ref_in, temperature)
    close(entropy, ref, TOL[dtype]["value"], "entropy")

    (entropy * w).sum().backward()
    (ref * w.double()).sum().backward()
    close(logits.grad, ref_in.grad, TOL[dtype]["grad"], "d entropy / d logits")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extreme_logits_plain(dtype, temperature):
    T, V = 47, 1271
    logits = make_extreme_logits(T, V, dtype).requires_grad_()
    labels, w = make_labels(T, V), make_weights(T)
    logprobs = compute_logprobs(logits, labels, temperature)
    entropy = compute_entropy(logits.detach(), temperature)

    ref_in = logits.detach().double().requires_grad_()
    ref = ref_logprobs(ref_in, labels, temperature)
    # the inputs reach log-probs of about -2e4 / temperature, not only 0 and log(k)
    assert ref.min() < -1e4
    close(logprobs, ref, EXTREME_TOL[dtype]["value"], "logprobs")
    close(entropy, ref_entropy(ref_in.detach(), temperature), EXTREME_TOL[dtype]["value"], "entropy")

    (logprobs * w).sum().backward()
    (ref * w.double()).sum().backward()
    close(logits.grad, ref_in.grad, EXTREME_TOL[dtype]["grad"], "d logprobs / d logits")


class OpCount(TorchDispatchMode):
    """How many times each aten op ran."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_logprobs_and_entropy_from_one_softmax(entropy_grad):
    """One log_softmax over the logits in forward, no second one for the entropy, none in backward;
    values and gradients (with the entropy bonus's) match fp64."""
    T, V, temperature = 47, 1271, 0.7
    logits = make_logits(T, V, torch.float32).requires_grad_()
    labels, w, u = make_labels(T, V), make_weights(T), make_weights(T, seed=5)
    with OpCount() as forward:
        logprobs, entropy = compute_logprobs_and_entropy(logits, labels, temperature, entropy_grad)
    assert forward.counts.get("_log_softmax") == 1 and "exp" in forward.counts
    assert entropy.requires_grad == entropy_grad
    loss = (logprobs * w).sum() + ((entropy * u).sum() if entropy_grad else 0)
    with OpCount() as backward:
        loss.backward()
    assert "_log_softmax" not in backward.counts and backward.counts.get("_log_softmax_backward_data") == 1

    ref_in = logits.detach().double().requires_grad_()
    ref, ref_h = ref_logprobs(ref_in, labels, temperature), ref_entropy(ref_in, temperature)
    ((ref * w.double()).sum() + ((ref_h * u.double()).sum() if entropy_grad else 0)).backward()
    close(logprobs, ref, TOL[torch.float32]["value"], "logprobs")
    close(entropy, ref_h, TOL[torch.float32]["value"], "entropy")
    close(logits.grad, ref_in.grad, TOL[torch.float32]["grad"], "d (logprobs, entropy) / d logits")


class Head(nn.Module):
    """The final norm and output layer of a torchtitan decoder, with torchtitan's module names."""

    def __init__(self, dim: int, vocab: int, seed: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)  # not all ones, so its gradient is checked too

    def forward(self, h):
        return self.output(self.norm(h))


def make_hidden(T: int, seed: int = 4) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def head_reference(head: Head, hidden, labels, w, temperature, entropy_w=None):
    """fp64 log-probs, entropies and gradients (hidden, norm weight, output weight) of the full sequence.

    The loss is sum(w * logprobs), plus sum(entropy_w * entropy) when entropy_w is given.
    """

    def full(p):
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().requires_grad_()

    h, norm_w, out_w = hidden.double().requires_grad_(), full(head.norm.weight), full(head.output.weight)
    logits = ref_head(h, norm_w, out_w, head.norm.eps)
    logprobs, entropy = ref_logprobs(logits, labels, temperature), ref_entropy(logits, temperature)
    loss = (logprobs * w.double()).sum()
    if entropy_w is not None:
        loss = loss + (entropy * entropy_w.double()).sum()
    loss.backward()
    return logprobs.detach(), entropy.detach(), h.grad, norm_w.grad, out_w.grad


@contextlib.contextmanager
def graphs_compiled():
    """Yields a list that holds, after the block, how many graphs dynamo compiled in it (from a reset)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    count = []
    yield count
    count.append(counters["stats"]["unique_graphs"])


def run_chunked(head: Head, hidden, labels, w, *, temperature, chunk_size, seq_shards, compiled, entropy_w=None,
                log=None, chunk_tokens=0):
    """chunked_logprobs forward + backward of the loss above; grads of the weights as full tensors."""
    h = hidden.clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    # under TP, backward must also run inside loss_parallel
    with loss_parallel() if seq_shards > 1 else contextlib.nullcontext(), log or contextlib.nullcontext():
        logprobs, entropy = chunked_logprobs(h, labels, lambda x: head.output(head.norm(x)), Scoring(temperature=temperature, chunk_size=chunk_size, chunk_tokens=chunk_tokens, seq_shards=seq_shards, compiled=compiled, entropy_grad=entropy_w is not None))
        loss = (logprobs * w).sum()
        if entropy_w is not None:
            loss = loss + (entropy * entropy_w).sum()
        loss.backward()

    def full(g):
        return g.full_tensor() if isinstance(g, DTensor) else g

    assert type(logprobs) is torch.Tensor and logprobs.shape == labels.shape and logprobs.dtype == torch.float32
    assert type(entropy) is torch.Tensor and entropy.shape == labels.shape
    # without an entropy bonus the entropy is a statistic: no graph kept for it
    assert entropy.requires_grad == (entropy_w is not None)
    return logprobs.detach(), entropy.detach(), h.grad, full(head.norm.weight.grad), full(head.output.weight.grad)


def compare_chunked(got, ref, tol, what: str) -> None:
    names = ("logprobs", "entropy", "d/d hidden", "d/d norm.weight", "d/d output.weight")
    kinds = ("value", "value", "grad", "grad", "grad")
    for name, kind, a, b in zip(names, kinds, got, ref):
        close(a, b, tol[kind], f"{what}: {name}")


@pytest.mark.parametrize("chunk_size", [0, 8, 6, 47])
def test_chunked_tp1(chunk_size):
    T, V, temperature = 47, 1271, 0.7
    head, hidden, labels, w = Head(D, V), make_hidden(T), make_labels(T, V), make_weights(T)
    ref = head_reference(head, hidden, labels, w, temperature)
    whole = run_chunked(head, hidden, labels, w, temperature=temperature, chunk_size=0, seq_shards=1,
                        compiled=False)
    got = run_chunked(head, hidden, labels, w, temperature=temperature, chunk_size=chunk_size, seq_shards=1,
                      compiled=False)
    compare_chunked(got, ref, TOL[torch.float32], f"chunk_size={chunk_size} vs fp64")
    compare_chunked(got, whole, SAME_TOL, f"chunk_size={chunk_size} vs one chunk")
    assert (got[0][labels == IGNORE_INDEX] == 0).all()


@pytest.mark.parametrize("chunk_tokens", [5, 10, 47, 93])
def test_chunk_tokens_tp1(chunk_tokens):
    """Chunks of tokens across the batch (a chunk may span two sequences) match fp64 and one chunk."""
    T, V, temperature = 47, 1271, 0.7
    head, hidden, labels, w = Head(D, V), make_hidden(T), make_labels(T, V), make_weights(T)
    ref = head_reference(head, hidden, labels, w, temperature)
    whole = run_chunked(head, hidden, labels, w, temperature=temperature, chunk_size=0, seq_shards=1, compiled=False)
    got = run_chunked(head, hidden, labels, w, temperature=temperature, chunk_size=0, chunk_tokens=chunk_tokens,
                      seq_shards=1, compiled=False)
    compare_chunked(got, ref, TOL[torch.float32], f"chunk_tokens={chunk_tokens} vs fp64")
    compare_chunked(got, whole, SAME_TOL, f"chunk_tokens={chunk_tokens} vs one chunk")


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_chunk_tokens_do_not_grow_with_the_batch(batch):
    """The head sees at most chunk_tokens tokens at once, whatever the batch; logits memory follows that."""
    T, V = 20, 64
    head = Head(D, V)
    hidden = torch.randn(batch, T, D, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(V, (batch, T), generator=torch.Generator().manual_seed(1))
    calls = []
    chunked_logprobs(hidden, labels, lambda x: calls.append(x.shape[:2]) or head(x), Scoring(chunk_tokens=16))
    assert max(n for _, n in calls) == 16 and sum(n for _, n in calls) == batch * T


def test_chunk_tokens_for_a_memory_budget():
    # fp32 logits of one chunk on one rank: tokens x ceil(V / TP) x 4 bytes <= budget
    assert chunk_tokens_for(0, 32000) == 0
    assert chunk_tokens_for(256, 151936) == 256 * 2**20 // (151936 * 4) == 441
    assert chunk_tokens_for(256, 32000, 2) == 4194  # 2**28 // 64000 = 4194, a multiple of 2
    assert chunk_tokens_for(256, 1271, 2) % 2 == 0 and chunk_tokens_for(256, 1271, 2) * 636 * 4 <= 256 * 2**20
    assert chunk_tokens_for(1e-6, 151936, 4) == 4  # at least one token per rank


@pytest.mark.parametrize("chunk_size", [0, 8])
def test_chunked_entropy_grad_tp1(chunk_size):
    """entropy_grad=True (the entropy bonus): gradients of sum(w * logprobs + u * entropy) match fp64."""
    T, V, temperature = 47, 1271, 0.7
    head, hidden, labels, w = Head(D, V), make_hidden(T), make_labels(T, V), make_weights(T)
    u = make_weights(T, seed=5)
    ref = head_reference(head, hidden, labels, w, temperature, entropy_w=u)
    got = run_chunked(head, hidden, labels, w, temperature=temperature, chunk_size=chunk_size, seq_shards=1,
                      compiled=False, entropy_w=u)
    compare_chunked(got, ref, TOL[torch.float32], f"entropy_grad chunk_size={chunk_size} vs fp64")


@pytest.mark.parametrize("chunk_size, chunks", [(0, 1), (47, 1), (8, 6), (6, 8)])
def test_chunks_recomputed_in_backward(chunk_size, chunks):
    """Each chunk's head runs once in forward, once more in backward when there are several chunks."""
    T, V = 47, 64
    head, hidden, labels = Head(D, V), make_hidden(T), make_labels(T, V)
    calls = []

    def counting_head(x):
        calls.append(x.shape[1])
        return head(x)

    h = hidden.clone().requires_grad_()
    logprobs, _ = chunked_logprobs(h, labels, counting_head, Scoring(chunk_size=chunk_size))
    assert len(calls) == chunks and sum(calls) == B * T
    logprobs.sum().backward()
    assert len(calls) == (2 * chunks if chunks > 1 else 1)

    calls.clear()
    with torch.no_grad():
        chunked_logprobs(hidden, labels, counting_head, Scoring(chunk_size=chunk_size))
    assert len(calls) == chunks


def test_chunked_rejects_wrong_shard_length():
    head, labels = Head(D, 64), make_labels(8, 64)
    with pytest.raises(ValueError):
        chunked_logprobs(make_hidden(8)[:, :3], labels, head, Scoring(seq_shards=2))


@pytest.mark.slow  # inductor compiles on CPU: tens of seconds
def test_compiled_tp1(tmp_path, monkeypatch):
    # a fresh cache, so this compiles rather than loads what another run left behind
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # chunks of 12, 12 and 8 positions: the short last chunk is traced by the same graph (maybe_compiled's `varying`)
    T, V, temperature, chunk_size = 32, 1271, 0.7, 12
    head, hidden, labels, w = Head(D, V), make_hidden(T), make_labels(T, V), make_weights(T)
    ref = head_reference(head, hidden, labels, w, temperature)
    kwargs = dict(temperature=temperature, chunk_size=chunk_size, seq_shards=1)
    eager = run_chunked(head, hidden, labels, w, compiled=False, **kwargs)
    with graphs_compiled() as graphs:
        compiled = run_chunked(head, hidden, labels, w, compiled=True, **kwargs)
    assert graphs == [1]  # 2 before: dynamo specialized the first on 12 positions
    compare_chunked(compiled, eager, SAME_TOL, "compiled vs eager")
    compare_chunked(compiled, ref, TOL[torch.float32], "compiled vs fp64")
    # the entropy bonus's gradient through the compiled one-softmax path
    u = make_weights(T, seed=5)
    ref = head_reference(head, hidden, labels, w, temperature, entropy_w=u)
    compiled = run_chunked(head, hidden, labels, w, compiled=True, entropy_w=u, **kwargs)
    compare_chunked(compiled, ref, TOL[torch.float32], "compiled entropy_grad vs fp64")


def test_maybe_compiled():
    assert maybe_compiled(compute_logprobs, False) is compute_logprobs
    compiled = maybe_compiled(compute_logprobs, True)
    assert compiled is not compute_logprobs and maybe_compiled(compute_logprobs, True) is compiled


class CollectiveLog(TorchDispatchMode):
    """(collective, elements) of every collective that DTensor and loss_parallel issue.

    Like CommDebugMode, and also records sizes: the claim under test is that only [B, T]-sized
    statistics cross ranks, never a vocab-sized tensor.
    """

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if getattr(func, "namespace", "") in ("_c10d_functional", "c10d") and not name.startswith(
            ("wait_tensor", "_wrap_tensor_autograd")
        ):
            numel = next(t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.calls.append((name, numel))
        return out


def assert_only_small_all_reduces(log: CollectiveLog, limit: int, what: str) -> None:
    big = [(name, n) for name, n in log.calls if not name.startswith("all_reduce") or n > limit]
    assert not big, f"{what}: collectives other than all_reduce of <= {limit} elements: {big}"


class Checks:
    """Runs named checks on every rank and keeps each one's assertion message (None: passed)."""

    def __init__(self, out_dir: str, rank: int):
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn, *args) -> None:
        # only assertion errors are kept: they are raised after a check's collectives, so the
        # ranks stay in step; anything else fails the spawn
        try:
            fn(*args)
            self.results[name] = None
        except AssertionError as e:
            self.results[name] = f"{type(e).__name__}: {e}"

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.results, f)


def load_checks(out_dir) -> dict[int, dict[str, str | None]]:
    return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)}


def assert_check_passed(results, name: str) -> None:
    failures = [f"rank {rank}: {r[name]}" for rank, r in results.items() if r[name] is not None]
    assert not failures, "\n".join(failures)


# (V, dtype, temperature, extreme logits); V = 1271: rank 0 holds 636 vocab columns, rank 1 635
TP_CASES = [
    (V, dtype, temperature, False)
    for V in (1271, 2048)
    for dtype in (torch.float32, torch.bfloat16)
    for temperature in (1.0, 0.7)
] + [(1271, torch.float32, 0.7, True), (2048, torch.bfloat16, 1.0, True)]


def _tp_logprobs(mesh, T):
    for V, dtype, temperature, extreme in TP_CASES:
        case = f"V={V} {dtype} temperature={temperature} extreme={extreme}"
        tol = (EXTREME_TOL if extreme else TOL)[dtype]
        full = (make_extreme_logits if extreme else make_logits)(T, V, dtype)
        labels, w = make_labels(T, V), make_weights(T)
        logits = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
        log = CollectiveLog()
        with loss_parallel(), log:
            logprobs = compute_logprobs(logits, labels, temperature)
            (logprobs * w).sum().backward()
        grad = logits.grad.full_tensor()

        assert type(logprobs) is torch.Tensor and logprobs.dtype == torch.float32, case
        ref_in = full.double().requires_grad_()
        ref = ref_logprobs(ref_in, labels, temperature)
        (ref * w.double()).sum().backward()
        close(logprobs, ref, tol["value"], f"{case}: logprobs")
        assert (logprobs[labels == IGNORE_INDEX] == 0).all(), case
        close(grad, ref_in.grad, tol["grad"], f"{case}: d logprobs / d logits")
        assert log.calls, f"{case}: no collective seen; the log would miss a gather too"
        assert_only_small_all_reduces(log, B * T, case)


def _tp_entropy(mesh, T):
    for V, dtype, temperature, extreme in TP_CASES:
        case = f"V={V} {dtype} temperature={temperature} extreme={extreme}"
        tol = (EXTREME_TOL if extreme else TOL)[dtype]
        full = (make_extreme_logits if extreme else make_logits)(T, V, dtype)
        logits = distribute_tensor(full, mesh, [Shard(-1)])
        log = CollectiveLog()
        with loss_parallel(), log:
            entropy = compute_entropy(logits, temperature)
        assert type(entropy) is torch.Tensor and entropy.dtype == torch.float32, case
        close(entropy, ref_entropy(full, temperature), tol["value"], f"{case}: entropy")
        assert log.calls, case
        assert_only_small_all_reduces(log, B * T, case)


def _tp_entropy_grad(mesh, T):
    """compute_entropy returns a tensor that requires grad: its gradient must be the entropy's.

    loss_parallel's log_softmax backward passes the incoming gradient through unchanged, since it
    expects the nll_loss backward of cross_entropy to have done the softmax part already.
    """
    V, temperature = 1271, 1.0
    full, w = make_logits(T, V, torch.float32), make_weights(T)
    logits = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
    with loss_parallel():
        entropy = compute_entropy(logits, temperature)
        (entropy * w).sum().backward()
    grad = logits.grad.full_tensor()
    ref_in = full.double().requires_grad_()
    (ref_entropy(ref_in, temperature) * w.double()).sum().backward()
    close(grad, ref_in.grad, TOL[torch.float32]["grad"], "d entropy / d logits under loss_parallel")


def _tp_log_sees_gather(mesh, T):
    """The collective log flags a vocab gather: full_tensor() of the logits is one."""
    V = 1271
    logits = distribute_tensor(make_logits(T, V, torch.float32), mesh, [Shard(-1)])
    log = CollectiveLog()
    with log:
        logits.full_tensor()
    assert any(name.startswith("all_gather") and n >= B * T * (V // 2) for name, n in log.calls), log.calls


TP_CHUNK_SIZES = (0, 8, 6, 46)  # T = 46, 23 positions per rank: 8 and 6 give chunks of 4 and 3 per rank
TP_CHUNK_TOKENS = (2, 10, 30)  # 1, 5 and 15 of each rank's 46 tokens (2 sequences x 23 positions) per chunk


def _tp_head(mesh, V):
    head = Head(D, V)
    plan = {
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    return parallelize_module(head, mesh, plan)


def _tp_chunked(mesh, rank, chunk_size, chunk_tokens=0):
    T, V, temperature = 46, 1271, 0.7
    head = _tp_head(mesh, V)
    hidden, labels, w = make_hidden(T), make_labels(T, V), make_weights(T)
    ref = list(head_reference(head, hidden, labels, w, temperature))
    T_local = T // 2
    local = slice(rank * T_local, (rank + 1) * T_local)
    ref[2] = ref[2][:, local]  # this rank's part of d/d hidden
    kwargs = dict(temperature=temperature, seq_shards=2, compiled=False)
    whole = run_chunked(head, hidden[:, local], labels, w, chunk_size=0, **kwargs)
    log = CollectiveLog()
    got = run_chunked(head, hidden[:, local], labels, w, chunk_size=chunk_size, chunk_tokens=chunk_tokens, log=log,
                      **kwargs)
    what = f"TP=2 chunk_size={chunk_size} chunk_tokens={chunk_tokens}"
    compare_chunked(got, ref, TOL[torch.float32], f"{what} vs fp64")
    compare_chunked(got, whole, SAME_TOL, f"{what} vs one chunk")
    # the sequence-parallel all-gather / reduce-scatter of hidden chunks is expected; any logits
    # gather, even of the smallest chunk (B x 6 x 1271 / 2), would be larger than all of hidden
    too_big = [(name, n) for name, n in log.calls if n > B * T * D]
    assert log.calls and not too_big, f"chunk_size={chunk_size}: vocab-sized collectives {too_big}"


def _tp_chunked_entropy_grad(mesh, rank):
    """entropy_grad=True at TP=2: the entropy bonus's gradient reaches hidden and the weights intact."""
    T, V, temperature = 46, 1271, 0.7
    head = _tp_head(mesh, V)
    hidden, labels, w, u = make_hidden(T), make_labels(T, V), make_weights(T), make_weights(T, seed=5)
    ref = list(head_reference(head, hidden, labels, w, temperature, entropy_w=u))
    local = slice(rank * T // 2, (rank + 1) * T // 2)
    ref[2] = ref[2][:, local]
    results = [
        run_chunked(head, hidden[:, local], labels, w, temperature=temperature, chunk_size=chunk_size, seq_shards=2,
                    compiled=False, entropy_w=u)
        for chunk_size in (0, 8)
    ]
    for chunk_size, got in zip((0, 8), results):
        compare_chunked(got, ref, TOL[torch.float32], f"TP=2 entropy_grad chunk_size={chunk_size} vs fp64")


def _tp_eager_checks(rank, world_size, out_dir):
    mesh = init_device_mesh("cpu", (world_size,))
    checks = Checks(out_dir, rank)
    checks.run("logprobs", _tp_logprobs, mesh, 47)
    checks.run("entropy", _tp_entropy, mesh, 47)
    checks.run("entropy_grad", _tp_entropy_grad, mesh, 47)
    checks.run("log_sees_gather", _tp_log_sees_gather, mesh, 47)
    for chunk_size in TP_CHUNK_SIZES:
        checks.run(f"chunked_{chunk_size}", _tp_chunked, mesh, rank, chunk_size)
    for chunk_tokens in TP_CHUNK_TOKENS:
        checks.run(f"chunk_tokens_{chunk_tokens}", _tp_chunked, mesh, rank, 0, chunk_tokens)
    checks.run("chunked_entropy_grad", _tp_chunked_entropy_grad, mesh, rank)
    checks.save()


@pytest.fixture(scope="module")
def tp_eager(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_eager")
    run_ranks(2, _tp_eager_checks, str(out))
    return load_checks(out)


def test_tp_logprobs(tp_eager):
    """Shard(-1) logits under loss_parallel: values and dt.grad.full_tensor() match fp64; only [B*T] all-reduces."""
    assert_check_passed(tp_eager, "logprobs")


def test_tp_entropy(tp_eager):
    """Shard(-1) logits under loss_parallel: entropies match fp64; only [B*T] all-reduces."""
    assert_check_passed(tp_eager, "entropy")


def test_tp_entropy_grad(tp_eager):
    """Gradient of compute_entropy wrt Shard(-1) logits, forward and backward inside loss_parallel."""
    assert_check_passed(tp_eager, "entropy_grad")


def test_tp_collective_log_sees_a_gather(tp_eager):
    assert_check_passed(tp_eager, "log_sees_gather")


@pytest.mark.parametrize("chunk_size", TP_CHUNK_SIZES)
def test_chunked_tp2(tp_eager, chunk_size):
    """SequenceParallel norm + ColwiseParallel output on sequence-sharded hidden, as torchtitan's llama3."""
    assert_check_passed(tp_eager, f"chunked_{chunk_size}")


@pytest.mark.parametrize("chunk_tokens", TP_CHUNK_TOKENS)
def test_chunk_tokens_tp2(tp_eager, chunk_tokens):
    """Token chunks across the batch's sequence shards at TP=2 match fp64 and one chunk; no vocab-sized collective."""
    assert_check_passed(tp_eager, f"chunk_tokens_{chunk_tokens}")


def test_chunked_entropy_grad_tp2(tp_eager):
    """The entropy bonus (entropy_grad=True) under TP: gradients wrt hidden and weights match fp64."""
    assert_check_passed(tp_eager, "chunked_entropy_grad")


def _tp_compiled(mesh, rank, cache_dir):
    """compiled=True at TP=2 on uneven chunks, against eager; then torch.compile of the vocab-sharded log-probs
    themselves, cold and warm on one cache folder, with and without the per-rank guard."""
    # V = 2048 splits evenly: both ranks trace the same shapes, the case where a shared cache collides
    T, V, temperature = 32, 2048, 0.7
    # 16 positions and 32 tokens a rank: chunks of 12, 12 and 8 tokens. Compiled, the last one failed (RecursionError
    # in torch 2.13's make_fx), as the next batch's token count did in a TP run without the fused pass
    kwargs = dict(temperature=temperature, chunk_size=12, seq_shards=2)
    head = _tp_head(mesh, V)
    hidden, labels, w = make_hidden(T), make_labels(T, V), make_weights(T)
    local = slice(rank * T // 2, (rank + 1) * T // 2)
    ref = list(head_reference(head, hidden, labels, w, temperature))
    ref[2] = ref[2][:, local]
    eager = run_chunked(head, hidden[:, local], labels, w, compiled=False, **kwargs)
    # the order parallelize_grpo uses: the rank's cache key tag before anything is compiled; one folder for both ranks
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    tag_compile_caches(rank)
    own_tag = torch.compiler.config.cache_key_tag
    with graphs_compiled() as graphs:
        compiled = run_chunked(head, hidden[:, local], labels, w, compiled=True, **kwargs)

    # what a cache shared without the tags does to compiled log-probs of DTensor logits (on two chunks of 8
    # tokens, which compile): rank 1 finds rank 0's entries under the same keys, with rank 0's vocab range in them
    even = dict(kwargs, chunk_size=16)
    want = run_chunked(head, hidden[:, local], labels, w, compiled=False, **even)
    plugin.scoring.logprobs.COMPILE_SHARDED_LOGITS = True

    def direct(what):
        torch._dynamo.reset()  # drop in-process compiled code: the next call compiles or loads from disk
        return what, run_chunked(head, hidden[:, local], labels, w, compiled=True, **even)

    try:
        results = [direct("cold cache"), direct("warm shared cache, own tag")]
        dist.barrier()  # both ranks' graphs are in the folder
        torch.compiler.config.cache_key_tag = "rank0"
        shared = direct("rank 0's tag")[1]
    finally:
        torch.compiler.config.cache_key_tag = own_tag
        plugin.scoring.logprobs.COMPILE_SHARDED_LOGITS = False
    return eager, ref, (compiled, graphs), (want, results, shared)


def _tp_compiled_checks(rank, world_size, out_dir, cache_dir):
    mesh = init_device_mesh("cpu", (world_size,))
    checks = Checks(out_dir, rank)
    eager, ref, (compiled, graphs), (want, results, shared) = _tp_compiled(mesh, rank, cache_dir)

    def compiled_matches():
        compare_chunked(compiled, eager, SAME_TOL, "TP=2 compiled vs eager")
        compare_chunked(compiled, ref, TOL[torch.float32], "TP=2 compiled vs fp64")
        assert graphs == [0], graphs  # vocab-sharded logits are scored eagerly (plugin.scoring.logprobs._score_chunk)
        for what, got in results:
            compare_chunked(got, want, SAME_TOL, f"TP=2 compiled DTensor log-probs ({what}) vs eager")
            compare_chunked(got, ref, TOL[torch.float32], f"TP=2 compiled DTensor log-probs ({what}) vs fp64")

    def shared_cache_is_wrong():
        err = (shared[0] - want[0]).abs().max().item()
        assert err > 1e-2, f"rank 1 on rank 0's compile cache still gave right log-probs (max error {err:.2e})"

    checks.run("compiled", compiled_matches)
    checks.run("shared_cache", shared_cache_is_wrong)
    checks.save()


@pytest.fixture(scope="module")
def tp_compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_compiled")
    run_ranks(2, _tp_compiled_checks, str(out), str(tmp_path_factory.mktemp("inductor_cache")))
    return load_checks(out)


@pytest.mark.slow  # inductor compiles on CPU: tens of seconds
def test_compiled_tp2(tp_compiled):
    """compiled=True at TP=2 on uneven chunks matches eager and fp64 (values and gradients), and log-probs of DTensor
    logits compiled (on even chunks) under per-rank cache key tags in one folder, cold then warm, equal eager's."""
    assert_check_passed(tp_compiled, "compiled")


@pytest.mark.slow  # the fixture compiles with inductor
def test_shared_compile_cache_breaks_tp(tp_compiled):
    """Why tag_compile_caches exists: a rank that loads the other rank's compiled log-probs of DTensor logits gets
    wrong values (the product scores those eagerly now; the tags keep any such graph a rank's own)."""
    assert_check_passed(tp_compiled, "shared_cache")



def test_compile_cache_tag_is_the_ranks_and_set_once():
    """A user's own cache key tag is kept; parallelize may tag several model parts, the rank is added once."""
    # config.patch restores the tag; pytest's monkeypatch would delete it on undo, which torch's config
    # module turns into "cache_key_tag does not exist" for every later compile in this process
    with torch.compiler.config.patch(cache_key_tag="mine"):
        tag_compile_caches(1)
        tag_compile_caches(1)
        assert torch.compiler.config.cache_key_tag == "mine-rank1"
    with torch.compiler.config.patch(cache_key_tag=""):
        tag_compile_caches(11)
        assert torch.compiler.config.cache_key_tag == "rank11"
    assert torch.compiler.config.cache_key_tag == ""
