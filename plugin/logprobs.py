"""Per-token log-probs and entropy from plain or vocab-sharded logits, one function for policy and reference.

With tensor parallelism the output layer returns logits as a DTensor sharded on the vocab
dim (`Shard(-1)`). Inside `torch.distributed.tensor.parallel.loss_parallel()` DTensor runs
log_softmax / cross_entropy on the shards and all-reduces only [B, T]-sized statistics, so
the vocabulary is never gathered. torchtitan's train context enters loss_parallel when
TP > 1, and backward also runs inside it, as loss_parallel requires.
"""

import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.components.loss import IGNORE_INDEX


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A per-token result as a plain tensor; DTensor results here are Replicate or Partial."""
    if isinstance(x, DTensor):
        # [B, T]-sized: an all-reduce for Partial, nothing for Replicate
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    return x


def compute_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log p(labels[:, t] | logits[:, t]) as a plain [B, T] tensor; IGNORE_INDEX positions are 0."""
    # fp32 before the softmax: bf16 log-sum-exp loses ~3 digits on a 150k vocab
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # cross_entropy is the op loss_parallel shards; reduction="none" keeps one value per token
    nll = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX
    )
    return -_plain(nll).view(labels.shape)


def compute_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 entropy of softmax(logits / temperature) per position, [B, T], plain tensor."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    # the vocab sum of a Shard(-1) DTensor is Partial: reducing it is an all-reduce of [B, T]
    return _plain(-(logp.exp() * logp).sum(-1))


_compiled: dict[str, object] = {}


def maybe_compiled(fn, enabled: bool, backend: str = "inductor"):
    """`fn` compiled once per (function, backend) when `enabled`, else `fn` itself."""
    if not enabled:
        return fn
    key = f"{fn.__qualname__}:{backend}"
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, backend=backend)
    return _compiled[key]


def isolate_compile_cache(rank: int) -> None:
    """Give each rank its own inductor/AOTAutograd cache directory.

    The AOTAutograd cache key does not include a DTensor's mesh coordinate, so with a cache
    shared by the TP ranks one rank reuses a graph that has the other rank's vocab range baked
    in, and log-probs come out silently wrong (../shared/notes/torchtitan-cpu.md, item 6).
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    base = cache_dir()
    if os.path.basename(base).startswith("rank_"):
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank_{rank}")
