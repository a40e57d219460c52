"""A global batch of whole groups -> a rank's microbatches: the batch plan, the group stream, the collate.

Shared by rollout files (plugin.data.loader) and online mode (plugin.data.online). Rewards are normalized
within a group, so a group is never split across batches or ranks.

Token layout of one completion (P prompt tokens, C completion tokens):
    sequence = prompt + completion                     # P + C tokens, P + C <= seq_len + 1
    input    = sequence[:-1], right-padded to seq_len with the pad (EOS) id
    labels   = sequence[1:], IGNORE_INDEX where the target is a prompt token or padding
so the loss mask (labels != IGNORE_INDEX) covers exactly the C completion tokens; nothing is
truncated (a longer row is a bad row, see plugin.data.rollouts).
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX

from plugin.data.rollouts import Completion


class Rollouts:
    """Per-completion values that travel with a batch to the loss, in full precision.

    Deliberately a plain class, not a tensor, dict, tuple or dataclass: FSDP2's mixed-precision
    policy casts the floating-point tensors of every forward input to the param dtype, and
    `_apply_to_tensors` (torch/distributed/utils.py) recurses into those containers, dataclasses
    included, so bf16 params would round advantages, loss weights and behaviour log-probs.
    """

    __slots__ = ("advantages", "rewards", "loss_weights", "old_logprobs", "sampler_logprobs", "ref_logprobs")

    def __init__(self, advantages: torch.Tensor, rewards: torch.Tensor, loss_weights: torch.Tensor,
                 old_logprobs: torch.Tensor | None = None, sampler_logprobs: torch.Tensor | None = None,
                 ref_logprobs: torch.Tensor | None = None):
        self.advantages = advantages  # [B] fp32
        self.rewards = rewards  # [B] fp32
        self.loss_weights = loss_weights  # [B] fp32, see loss_weights()
        self.old_logprobs = old_logprobs  # [B, T] behaviour log-probs aligned with labels, NaN where unknown
        # online mode: the sampler's own log-probs, for the sampler/trainer mismatch metric only
        self.sampler_logprobs = sampler_logprobs  # [B, T], NaN outside the completions; None: not measured
        # the reference's log-probs from the rollout file, given for every completion token of the
        # microbatch: the model then skips the reference pass; None: the reference model scores it
        self.ref_logprobs = ref_logprobs  # [B, T] aligned with labels, 0 outside the completions

    def __setstate__(self, state) -> None:
        # a mid-replay data checkpoint of an earlier version also holds a `keep_logprobs` slot
        for name, value in state[1].items():
            if name in self.__slots__:
                setattr(self, name, value)

    def to(self, device: torch.device) -> "Rollouts":
        move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return Rollouts(*(move(getattr(self, name)) for name in self.__slots__))


def advantages(rewards: torch.Tensor, group_size: int, norm: str, eps: float) -> torch.Tensor:
    """Per-completion advantages of whole groups: reward - group mean, over the group's or the batch's std."""
    r = rewards.double().view(-1, group_size)  # [groups, G]
    centered = r - r.mean(dim=1, keepdim=True)
    if norm == "group_std":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif norm == "batch_std":
        centered = centered / (r.std() + eps)
    return centered.flatten().float()


def loss_weights(completion_lens: torch.Tensor, aggregation: str, horizon: int,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per-completion weights w such that sum(w * token losses) / (global completion tokens) aggregates as asked.

    torchtitan divides every loss by the global number of valid tokens; the weights turn that
    token mean into the other modes. `completion_lens` covers the whole global batch. A completion
    that `keep` [N] bool leaves out of the loss (mask_truncated_completions) has no tokens, as with
    TRL's zeroed completion mask, but still counts among the N completions the seq modes average over.
    """
    lens = completion_lens.double()
    if keep is not None:
        lens = torch.where(keep, lens, 0.0)
    n, tokens = lens.numel(), lens.sum()
    if aggregation == "token_mean":
        w = torch.ones(n, dtype=torch.float64)
    elif aggregation == "seq_mean_token_mean":  # mean over completions of each one's token mean
        w = torch.where(lens > 0, tokens / (n * lens.clamp(min=1)), 0.0)
    elif aggregation == "seq_mean_token_sum":  # mean over completions of each one's token sum
        w = torch.full((n,), (tokens / n).item(), dtype=torch.float64)
    else:  # fixed_horizon (Dr. GRPO): token sum / (completions * horizon)
        w = torch.full((n,), (tokens / (n * horizon)).item(), dtype=torch.float64)
    return w.float()


@dataclass
class BatchPlan:
    """How global batches are cut: every rank derives the same global batch, then takes its part."""

    group_size: int
    groups_per_microbatch: int  # local_batch_size / group_size
    grad_accum: int  # microbatches per step on each rank
    dp_rank: int
    dp_world_size: int

    @property
    def groups_per_step(self) -> int:
        return self.groups_per_microbatch * self.grad_accum * self.dp_world_size

    def microbatch(self, j: int) -> range:
        """Positions, within a step's groups, of this rank's j-th microbatch; microbatch-major, then rank."""
        start = (j * self.dp_world_size + self.dp_rank) * self.groups_per_microbatch
        return range(start, start + self.groups_per_microbatch)

    def rows(self, j: int) -> list[int]:
        """Positions, within a step's completions (group-major), of this rank's j-th microbatch."""
        return [i * self.group_size + m for i in self.microbatch(j) for m in range(self.group_size)]


class GroupStream:
    """One seeded permutation of `num_groups` groups per epoch, concatenated over epochs.

    Global batch s is the stream's groups [s*K, (s+1)*K), K = groups per step. Every rank
    computes the same stream, so no group is dropped or repeated within an epoch whatever the
    DP degree. Online mode's groups are prompts.
    """

    def __init__(self, num_groups: int, groups_per_step: int, seed: int):
        self.num_groups, self.groups_per_step, self.seed = num_groups, groups_per_step, seed
        self._orders: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of group ids; the last two are cached (a step can span two epochs)."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = rng.permutation(self.num_groups)
        return self._orders[epoch]

    def step_groups(self, step: int) -> np.ndarray:
        """The group ids of global batch `step`."""
        return self.groups(step * self.groups_per_step, self.groups_per_step)

    def groups(self, start: int, count: int) -> np.ndarray:
        """The group ids at stream positions [start, start + count) (online dynamic sampling draws past a step's)."""
        end, n, out = start + count, self.num_groups, []
        while start < end:
            epoch, offset = divmod(start, n)
            out.append(self.epoch_order(epoch)[offset : offset + end - start])
            start += len(out[-1])
        return np.concatenate(out)

    def epoch_starting(self, step: int) -> int | None:
        """The epoch that starts within global batch `step`, if one does."""
        return self.epoch_starting_at(step * self.groups_per_step, self.groups_per_step)

    def epoch_starting_at(self, start: int, count: int) -> int | None:
        """The epoch that starts within stream positions [start, start + count), if one does."""
        n = self.num_groups
        return (start - 1) // n + 1 if (start + count - 1) // n != (start - 1) // n else None


class Collate:
    """One microbatch: padded to seq_len, completion tokens unmasked, with advantages, loss weights, behaviour log-probs."""

    def __init__(self, seq_len: int, pad_id: int, grpo, group_size: int, sampled: bool = False):
        self.seq_len, self.pad_id, self.cfg, self.group_size = seq_len, pad_id, grpo, group_size
        # online mode: a completion's log-probs are the sampler's, a metric; in a file, the behaviour policy's
        self.sampled = sampled

    def __call__(self, rewards: torch.Tensor, completion_lens: torch.Tensor, rows: list[int], batch: list[Completion],
                 keep: torch.Tensor | None = None):
        """`rewards`, `completion_lens`: [N], every completion of the step, group-major;
        `rows`: this microbatch's positions among them; `batch`: those completions; `keep`: [N] bool,
        False for a completion left out of the loss (its labels are all IGNORE_INDEX), None: all kept."""
        cfg = self.cfg
        # every completion, kept or not, counts in its group's mean and std (TRL's convention)
        adv = advantages(rewards, self.group_size, cfg.advantage_norm, cfg.advantage_eps)
        if keep is not None and not keep.any():
            # nothing left to train on, where TRL's loss is 0: torchtitan would divide by 0 tokens, so the tokens
            # stay, weighted 0 (no update; the metrics still see them)
            keep, weights = None, torch.zeros(len(completion_lens))
        else:
            weights = loss_weights(completion_lens, cfg.loss_aggregation, cfg.horizon or self.seq_len, keep)
        n = len(batch)
        inputs = torch.full((n, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        # only when a row has them: None keeps the loss on-policy without a [B, T] tensor of NaN
        old_logprobs = torch.full((n, self.seq_len), math.nan) if any(c.logprobs for c in batch) else None
        # all or nothing: one unknown token (a null, an appended EOS) and the reference model scores the microbatch
        given_ref = all(c.ref_logprobs and not any(map(math.isnan, c.ref_logprobs)) for c in batch)
        ref_logprobs = torch.zeros(n, self.seq_len) if given_ref and not self.sampled else None
        for i, c in enumerate(batch):
            seq = torch.tensor(c.tokens, dtype=torch.long)
            inputs[i, : len(seq) - 1] = seq[:-1]
            # position t predicts token t+1: completion targets start at prompt_len - 1
            if keep is None or keep[rows[i]]:
                labels[i, c.prompt_len - 1 : len(seq) - 1] = seq[c.prompt_len :]
            if c.logprobs:
                old_logprobs[i, c.prompt_len - 1 : len(seq) - 1] = torch.tensor(c.logprobs)
            if ref_logprobs is not None:
                ref_logprobs[i, c.prompt_len - 1 : len(seq) - 1] = torch.tensor(c.ref_logprobs)
        old, sampler = (None, old_logprobs) if self.sampled else (old_logprobs, None)
        rollouts = Rollouts(adv[rows], rewards[rows], weights[rows], old, sampler, ref_logprobs=ref_logprobs)
        return {"input": inputs, "labels": labels, "rollouts": rollouts}, labels
