"""Rollout index -> GRPO microbatches: whole groups, the same global batch on every rank.

`plugin.rollouts` checks and indexes the rollout file; this module cuts the index's groups
into global batches and a rank's microbatches, and reads only the rows a microbatch trains on.
Rewards are normalized within a group, so a group is never split across batches or ranks.

Token layout of one completion (P prompt tokens, C completion tokens):
    sequence = prompt + completion                     # P + C tokens, P + C <= seq_len + 1
    input    = sequence[:-1], right-padded to seq_len with the pad (EOS) id
    labels   = sequence[1:], IGNORE_INDEX where the target is a prompt token or padding
so the loss mask (labels != IGNORE_INDEX) covers exactly the C completion tokens; nothing is
truncated (a longer row is a bad row, see plugin.rollouts).
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from .config import validate_job
from .metrics import GRPOStats
from .rollouts import Completion, Encoder, RolloutError, RolloutIndex, index_rollouts


class Rollouts:
    """Per-completion values that travel with a batch to the loss, in full precision.

    Deliberately a plain class, not a tensor, dict, tuple or dataclass: FSDP2's mixed-precision
    policy casts the floating-point tensors of every forward input to the param dtype, and
    `_apply_to_tensors` (torch/distributed/utils.py) recurses into those containers, dataclasses
    included, so bf16 params would round advantages, loss weights and behaviour log-probs.
    """

    __slots__ = ("advantages", "rewards", "loss_weights", "old_logprobs", "sampler_logprobs", "keep_logprobs",
                 "ref_logprobs")

    def __init__(self, advantages: torch.Tensor, rewards: torch.Tensor, loss_weights: torch.Tensor,
                 old_logprobs: torch.Tensor | None = None, sampler_logprobs: torch.Tensor | None = None,
                 keep_logprobs: bool = False, ref_logprobs: torch.Tensor | None = None):
        self.advantages = advantages  # [B] fp32
        self.rewards = rewards  # [B] fp32
        self.loss_weights = loss_weights  # [B] fp32, see loss_weights()
        self.old_logprobs = old_logprobs  # [B, T] behaviour log-probs aligned with labels, NaN where unknown
        # online mode: the sampler's own log-probs, for the sampler/trainer mismatch metric only
        self.sampler_logprobs = sampler_logprobs  # [B, T], NaN outside the completions; None: not measured
        # online mode with num_iterations > 1: the model stores this pass's detached log-probs in
        # old_logprobs, the old log-probs of the batch's replays (plugin.online)
        self.keep_logprobs = keep_logprobs
        # the reference's log-probs from the rollout file, given for every completion token of the
        # microbatch: the model then skips the reference pass; None: the reference model scores it
        self.ref_logprobs = ref_logprobs  # [B, T] aligned with labels, 0 outside the completions

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


def loss_weights(completion_lens: torch.Tensor, aggregation: str, horizon: int) -> torch.Tensor:
    """Per-completion weights w such that sum(w * token losses) / (global completion tokens) aggregates as asked.

    torchtitan divides every loss by the global number of valid tokens; the weights turn that
    token mean into the other modes. `completion_lens` covers the whole global batch.
    """
    n, tokens = completion_lens.numel(), completion_lens.sum().double()
    if aggregation == "token_mean":
        w = torch.ones(n, dtype=torch.float64)
    elif aggregation == "seq_mean_token_mean":  # mean over completions of each one's token mean
        w = tokens / (n * completion_lens.double())
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
        k, n = self.groups_per_step, self.num_groups
        start, end, out = step * k, (step + 1) * k, []
        while start < end:
            epoch, offset = divmod(start, n)
            out.append(self.epoch_order(epoch)[offset : offset + end - start])
            start += len(out[-1])
        return np.concatenate(out)

    def epoch_starting(self, step: int) -> int | None:
        """The epoch that starts within global batch `step`, if one does."""
        k, n = self.groups_per_step, self.num_groups
        return (step * k) // n if (step * k) // n != (step * k - 1) // n else None


class RolloutDataset(IterableDataset, Stateful):
    """Yields this rank's microbatches, cut from global batches of whole groups (GroupStream).

    Every rank computes the same stream, so a global batch's statistics (completion tokens,
    reward std) come from the index on every rank without communication. A rank reads only its
    own microbatch's rows.
    """

    def __init__(self, index: RolloutIndex, plan: BatchPlan, collate: "Collate", seed: int):
        self.index, self.plan, self.collate, self.seed = index, plan, collate, seed
        self.step, self.microbatch = 0, 0  # position: the next (global batch, microbatch) to yield
        self.stream = GroupStream(index.num_groups, plan.groups_per_step, seed)

    def __iter__(self):
        G = self.plan.group_size
        while True:
            # the step's completions, group-major: entry i * G + j is completion j of the i-th group
            items = (self.stream.step_groups(self.step)[:, None] * G + np.arange(G)).ravel()
            rewards = torch.from_numpy(self.index.rewards[items])
            completion_lens = torch.from_numpy(self.index.lengths[items]).long()
            if self.microbatch == 0 and (epoch := self.stream.epoch_starting(self.step)) is not None:
                logger.info(f"Rollout data: epoch {epoch} starts at step {self.step + 1}")
            while self.microbatch < self.plan.grad_accum:
                rows = self.plan.rows(self.microbatch)
                self.microbatch += 1
                yield self.collate(rewards, completion_lens, rows, self.index.read(items[rows]))
            self.step, self.microbatch = self.step + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "microbatch": self.microbatch, "num_groups": self.index.num_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("num_groups", self.index.num_groups)
        if saved != self.index.num_groups:
            raise RolloutError(
                f"{self.index.path}: {self.index.num_groups} valid groups, but the checkpoint's data position "
                f"is in a stream of {saved}; resume with the same rollout file and [rollout_data] settings"
            )
        self.step, self.microbatch = state_dict["step"], state_dict["microbatch"]


class Collate:
    """One microbatch: padded to seq_len, completion tokens unmasked, with advantages, loss weights, behaviour log-probs."""

    def __init__(self, seq_len: int, pad_id: int, grpo, group_size: int, sampled: bool = False):
        self.seq_len, self.pad_id, self.cfg, self.group_size = seq_len, pad_id, grpo, group_size
        # online mode: a completion's log-probs are the sampler's, a metric; in a file, the behaviour policy's
        self.sampled = sampled

    def __call__(self, rewards: torch.Tensor, completion_lens: torch.Tensor, rows: list[int], batch: list[Completion]):
        """`rewards`, `completion_lens`: [N], every completion of the step, group-major;
        `rows`: this microbatch's positions among them; `batch`: those completions."""
        cfg = self.cfg
        adv = advantages(rewards, self.group_size, cfg.advantage_norm, cfg.advantage_eps)
        weights = loss_weights(completion_lens, cfg.loss_aggregation, cfg.horizon or self.seq_len)
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
            labels[i, c.prompt_len - 1 : len(seq) - 1] = seq[c.prompt_len :]
            if c.logprobs:
                old_logprobs[i, c.prompt_len - 1 : len(seq) - 1] = torch.tensor(c.logprobs)
            if ref_logprobs is not None:
                ref_logprobs[i, c.prompt_len - 1 : len(seq) - 1] = torch.tensor(c.ref_logprobs)
        old, sampler = (None, old_logprobs) if self.sampled else (old_logprobs, None)
        rollouts = Rollouts(adv[rows], rewards[rows], weights[rows], old, sampler, ref_logprobs=ref_logprobs)
        return {"input": inputs, "labels": labels, "rollouts": rollouts}, labels


def build_rollout_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    """torchtitan's dataloader builder: the rollout file, or in online mode the prompt file, of [training] dataset_path."""
    # the first of the GRPO TrainSpec's builders that torchtitan's Trainer calls
    validate_job(job_config)
    training, cfg = job_config.training, job_config.rollout_data
    online = job_config.online.enable
    if not training.dataset_path:
        what = "a prompt file" if online else "a rollout file"
        raise ValueError(f"[training] dataset_path is empty: set it to {what} (JSONL or Parquet)")
    try:  # the model's vocabulary size (ids at or above it index past the embedding); else the tokenizer's
        vocab_size = get_train_spec(job_config.model.name).model_args[job_config.model.flavor].vocab_size
    except (KeyError, ValueError, AttributeError):
        vocab_size = tokenizer.get_vocab_size()
    encoder = Encoder(tokenizer, vocab_size, training.seq_len, cfg.chat_template)
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    def batching(group_size: int, available: int, what: str, sampled: bool = False) -> tuple[BatchPlan, Collate]:
        """How `available` groups (`what`: "groups" of a file, "prompts" online) are cut into batches and collated."""
        if training.local_batch_size % group_size:
            raise ValueError(
                f"[training] local_batch_size = {training.local_batch_size} must be a multiple of the "
                f"group size {group_size}: a group is never split across batches"
            )
        global_batch = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * dp_world_size
        plan = BatchPlan(
            group_size=group_size,
            groups_per_microbatch=training.local_batch_size // group_size,
            grad_accum=global_batch // (training.local_batch_size * dp_world_size),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
        if plan.groups_per_step > available:
            of = f"{group_size} completions" if sampled else group_size
            raise RolloutError(f"{training.dataset_path}: {available} {what}, fewer than one global batch "
                               f"({plan.groups_per_step} {what} of {of})")
        return plan, Collate(training.seq_len, pad_id, job_config.grpo, group_size, sampled)

    if online:
        from .online import build_online_dataset

        dataset = build_online_dataset(job_config, tokenizer, encoder, batching)
    else:
        dataset = _rollout_dataset(job_config, encoder, batching)
    # the dataset yields whole microbatches: no automatic batching
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None)


def _rollout_dataset(job_config, encoder, batching) -> RolloutDataset:
    training, grpo, cfg = job_config.training, job_config.grpo, job_config.rollout_data
    index = index_rollouts(training.dataset_path, encoder, fmt=cfg.format, group_size=grpo.group_size,
                           on_error=cfg.on_error)
    # every rank indexes the whole file, so the count is the same on all of them
    GRPOStats.skipped_rows = index.skipped_rows
    group_size = index.group_size
    plan, collate = batching(group_size, index.num_groups, "groups")
    logger.info(
        f"Rollouts: {index.num_groups} groups of {group_size} from {training.dataset_path} "
        f"({'grouped' if index.grouped else 'flat'} rows, index {index.nbytes / 2**20:.2f} MiB); "
        f"{plan.groups_per_step} groups per step, {index.num_groups / plan.groups_per_step:.1f} steps per epoch"
    )
    return RolloutDataset(index, plan, collate, job_config.debug.seed or 0)
