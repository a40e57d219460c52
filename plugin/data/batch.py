"""A global batch of whole groups -> a rank's microbatches: the batch plan, the group stream, the collate.

Shared by rollout files (plugin.data.loader) and online mode (plugin.data.online). Rewards are normalized
within a group, so a group is never split across batches or ranks.

Token layout of one completion (P prompt tokens, C completion tokens):
    sequence = prompt + completion                     # P + C tokens, P + C <= seq_len + 1
    input    = sequence[:-1]
    labels   = sequence[1:], IGNORE_INDEX where the target is a prompt token
so the loss mask (labels != IGNORE_INDEX) covers exactly the C completion tokens, less a multi-turn
completion's tool tokens (its tool mask), which the model reads but is never trained on; nothing is
truncated (a longer row is a bad row, see plugin.data.rollouts). A microbatch lays them out as
- padded: one row each, right-padded to seq_len with the pad (EOS) id and IGNORE_INDEX labels;
- padding-free ([grpo] padding_free): one row [1, T] of the inputs end to end, labels made per
  sequence before they are concatenated (no label crosses a boundary), positions restarting at 0
  at each sequence (the attention's boundaries, plugin.model.attention), T rounded up to a
  multiple of `pack_multiple` (the TP degree, for sequence parallelism) by a pad sequence of its
  own. Its completions are then assigned to microbatches by token count (BatchPlan.balanced).
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

    __slots__ = ("advantages", "rewards", "loss_weights", "old_logprobs", "sampler_logprobs", "ref_logprobs",
                 "seq_lens", "packed", "routed_experts")

    def __init__(self, advantages: torch.Tensor, rewards: torch.Tensor, loss_weights: torch.Tensor,
                 old_logprobs: torch.Tensor | None = None, sampler_logprobs: torch.Tensor | None = None,
                 ref_logprobs: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                 packed: bool = False, routed_experts: torch.Tensor | None = None):
        self.advantages = advantages  # [B] fp32
        self.rewards = rewards  # [B] fp32
        self.loss_weights = loss_weights  # [B] fp32, see loss_weights()
        self.old_logprobs = old_logprobs  # [B, T] behaviour log-probs aligned with labels, NaN where unknown
        # online mode: the sampler's own log-probs, for the sampler/trainer mismatch metric only
        self.sampler_logprobs = sampler_logprobs  # [B, T], NaN outside the completions; None: not measured
        # the reference's log-probs from the rollout file, given for every completion token of the
        # microbatch: the model then skips the reference pass; None: the reference model scores it
        self.ref_logprobs = ref_logprobs  # [B, T] aligned with labels, 0 outside the completions
        # [B] each completion's input tokens (prompt + completion - 1): its real tokens; None: not known
        self.seq_lens = seq_lens
        # the per-token tensors above and the batch's are one padding-free row [1, T]: the B sequences of
        # `seq_lens` end to end, then padding; else [B, T], row b completion b
        self.packed = packed
        # an MoE policy's routing replay ([moe] router_replay): [B, T, layers, k] int16, the experts each input
        # position is routed to (-1: the router's own choice); None: the router chooses
        self.routed_experts = routed_experts

    def __setstate__(self, state) -> None:
        # not in a data checkpoint of an earlier version
        self.seq_lens, self.packed, self.routed_experts = None, False, None
        # a mid-replay data checkpoint of an earlier version also holds a `keep_logprobs` slot
        for name, value in state[1].items():
            if name in self.__slots__:
                setattr(self, name, value)

    def to(self, device: torch.device) -> "Rollouts":
        """The per-completion and per-token values on `device`; `seq_lens`, the layout, stays on the host, so
        the indices made from it need no device sync."""
        move = lambda name, t: t.to(device) if isinstance(t, torch.Tensor) and name != "seq_lens" else t  # noqa: E731
        return Rollouts(*(move(name, getattr(self, name)) for name in self.__slots__))

    def token_rows(self, numel: int) -> torch.Tensor:
        """[numel] the completion of each position of the flattened per-token tensors (a packed row's padding:
        the last one; its labels are IGNORE_INDEX)."""
        B, device = self.advantages.numel(), self.advantages.device
        if not self.packed:
            return torch.arange(numel, device=device) // (numel // B)
        rows, _ = segments(self.seq_lens.cpu())
        return torch.cat([rows, rows.new_full((numel - rows.numel(),), B - 1)]).to(device)

    def unpacked(self, x: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor | None:
        """A packed row's per-token [1, T] tensor as the padded layout [B, longest], `fill` past each sequence;
        differentiable. A padded [B, T] tensor is returned as it is."""
        if x is None or not self.packed:
            return x
        lens = self.seq_lens.cpu()
        B, width = lens.numel(), int(lens.max())
        rows, cols = segments(lens)
        out = x.new_full((B * width,), fill)
        return out.index_put(((rows * width + cols).to(x.device),), x.reshape(-1)[: rows.numel()]).view(B, width)


def segments(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences of `lens` ([B] on the host) laid end to end: each token's sequence and its position in it."""
    rows = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    return rows, torch.arange(rows.numel()) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)


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

    def rows(self, j: int, tokens: np.ndarray | None = None) -> list[int]:
        """Positions, within a step's completions (group-major), of this rank's j-th microbatch.

        With `tokens` ([N] each completion's sequence length, N the step's completions), the
        completions are balanced by tokens over every rank's microbatches instead (`balanced`).
        """
        if tokens is not None:
            return balanced(tokens, self.grad_accum * self.dp_world_size)[j * self.dp_world_size + self.dp_rank]
        return [i * self.group_size + m for i in self.microbatch(j) for m in range(self.group_size)]


def balanced(tokens: np.ndarray, bins: int) -> list[list[int]]:
    """The completions [0, N) in `bins` bins of near-equal token sums, each bin in ascending order.

    Longest first, each to the bin with the fewest tokens so far (ties: the lower bin): every rank
    computes the same bins. The loss is a sum over tokens divided by the global batch's token count,
    with advantages and loss weights computed over the whole batch, so where a completion is
    trained does not change it. With N >= bins no bin is empty.
    """
    order = np.argsort(-np.asarray(tokens, dtype=np.int64), kind="stable")
    load, out = np.zeros(bins, dtype=np.int64), [[] for _ in range(bins)]
    for i in order:
        b = int(np.argmin(load))
        load[b] += tokens[i]
        out[b].append(int(i))
    return [sorted(b) for b in out]


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
    """One microbatch, padded or padding-free (the module's doc), completion tokens unmasked, with advantages, loss
    weights, behaviour log-probs."""

    def __init__(self, seq_len: int, pad_id: int, grpo, group_size: int, sampled: bool = False, pack_multiple: int = 1):
        self.seq_len, self.pad_id, self.cfg, self.group_size = seq_len, pad_id, grpo, group_size
        # online mode: a completion's log-probs are the sampler's, a metric; in a file, the behaviour policy's
        self.sampled = sampled
        self.padding_free, self.pack_multiple = grpo.padding_free, pack_multiple

    def tokens(self, prompt_lens, completion_lens) -> np.ndarray | None:
        """[N] each completion's input tokens, the cost BatchPlan.rows balances; None: padded rows, balanced by count."""
        if not self.padding_free:
            return None
        return np.asarray(prompt_lens, dtype=np.int64) + np.asarray(completion_lens, dtype=np.int64) - 1

    def __call__(self, rewards: torch.Tensor, completion_lens: torch.Tensor, rows: list[int], batch: list[Completion],
                 keep: torch.Tensor | None = None):
        """`rewards`, `completion_lens` (the tokens in the loss: a multi-turn one's tool turns left out): [N], every
        completion of the step, group-major;
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
        seq_lens = torch.tensor([len(c.tokens) - 1 for c in batch], dtype=torch.long)
        if self.padding_free:
            total = int(seq_lens.sum())
            shape = (1, -(-total // self.pack_multiple) * self.pack_multiple)
            starts = (torch.cumsum(seq_lens, 0) - seq_lens).tolist()
        else:
            shape, starts = (n, self.seq_len), [i * self.seq_len for i in range(n)]
        inputs = torch.full(shape, self.pad_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        # only when a row has them: None keeps the loss on-policy without a [B, T] tensor of NaN
        old_logprobs = torch.full(shape, math.nan) if any(c.logprobs for c in batch) else None
        # all or nothing: one unknown token (a null, an appended EOS) and the reference model scores the microbatch
        given_ref = all(c.ref_logprobs and not any(map(math.isnan, c.ref_logprobs)) for c in batch)
        ref_logprobs = torch.zeros(shape) if given_ref and not self.sampled else None
        flat = lambda t: t.view(-1)  # noqa: E731
        routed = None
        if batch and batch[0].routed_experts is not None:  # the sampler's routing, replayed (R3)
            routed = torch.full((*shape, *batch[0].routed_experts.shape[1:]), -1, dtype=torch.int16)
        for i, (c, start) in enumerate(zip(batch, starts)):
            seq = torch.tensor(c.tokens, dtype=torch.long)
            end = start + len(seq) - 1
            flat(inputs)[start:end] = seq[:-1]
            if routed is not None:
                routed.view(-1, *routed.shape[2:])[start:end] = torch.from_numpy(c.routed_experts)
            # position t predicts token t+1: completion targets start at prompt_len - 1, within this sequence
            targets = slice(start + c.prompt_len - 1, end)
            if keep is None or keep[rows[i]]:
                target = seq[c.prompt_len :]
                if c.tool_mask is not None:  # a tool turn's tokens are read, never trained on: no label
                    target = target.masked_fill(torch.tensor(c.tool_mask) == 0, IGNORE_INDEX)
                flat(labels)[targets] = target
            if c.logprobs:
                flat(old_logprobs)[targets] = torch.tensor(c.logprobs)
            if ref_logprobs is not None:
                flat(ref_logprobs)[targets] = torch.tensor(c.ref_logprobs)
        old, sampler = (None, old_logprobs) if self.sampled else (old_logprobs, None)
        rollouts = Rollouts(adv[rows], rewards[rows], weights[rows], old, sampler, ref_logprobs=ref_logprobs,
                            seq_lens=seq_lens, packed=self.padding_free, routed_experts=routed)
        out = {"input": inputs, "labels": labels, "rollouts": rollouts}
        if self.padding_free:
            out["positions"] = packed_positions(seq_lens, shape[1])
        return out, labels


def packed_positions(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[1, width] positions of a padding-free row: 0.. of each sequence of `seq_lens`, then 0.. of its padding, which
    is so a sequence of its own."""
    return segments(torch.cat([seq_lens, seq_lens.new_tensor([width - int(seq_lens.sum())])]))[1][None]
