"""Rollout files -> GRPO batches.

A rollout file is JSONL, one completion per line: {"prompt", "completion", "reward", "group"}.
`group` names the prompt the completion was sampled for; rewards are normalized within it,
so a group is never split across batches or data-parallel ranks.

Token layout of one completion (P prompt tokens incl. BOS, C completion tokens incl. EOS):
    sequence = prompt + completion                     # P + C tokens
    input    = sequence[:-1], padded to seq_len
    labels   = sequence[1:], IGNORE_INDEX where the target is a prompt token or padding
so the loss mask (labels != IGNORE_INDEX) covers exactly the C completion tokens.
"""

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from .config import validate

FIELDS = {"prompt": str, "completion": str, "reward": (int, float), "group": (str, int)}


@dataclass
class Rollouts:
    """Per-completion values that travel with a batch to the loss.

    Deliberately not a tensor, dict or other pytree: FSDP's mixed-precision policy casts every
    floating-point forward input to the param dtype, which would round advantages to bf16.
    """

    advantages: torch.Tensor  # [B] fp32
    rewards: torch.Tensor  # [B] fp32
    loss_weights: torch.Tensor  # [B] fp32, see loss_weights()
    old_logprobs: torch.Tensor | None = None  # [B, T] behaviour log-probs aligned with labels, NaN where unknown

    def to(self, device: torch.device) -> "Rollouts":
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return Rollouts(*(move(t) for t in (self.advantages, self.rewards, self.loss_weights, self.old_logprobs)))


class RolloutError(ValueError):
    """A rollout row that cannot be trained on; the message names the file, line and field."""


@dataclass
class Completion:
    tokens: list[int]  # prompt + completion token ids
    prompt_len: int
    reward: float
    where: str  # "file:line", for errors


def _parse_row(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RolloutError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise RolloutError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name, types in FIELDS.items():
        if name not in row:
            raise RolloutError(f"{where}: missing field '{name}'")
        value = row[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise RolloutError(f"{where}: field '{name}' has type {type(value).__name__}")
    if not math.isfinite(row["reward"]):
        raise RolloutError(f"{where}: field 'reward' is {row['reward']}, not a finite number")
    if not row["completion"]:
        raise RolloutError(f"{where}: field 'completion' is empty")
    return row


def read_rollouts(path: str, tokenizer, seq_len: int) -> list[list[Completion]]:
    """Tokenized groups in order of first appearance; raises RolloutError on the first bad row."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[training] dataset_path = {path!r}: no such rollout file")
    groups: dict[Any, list[Completion]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            row = _parse_row(line, where)
            prompt = tokenizer.encode(row["prompt"], add_bos=True, add_eos=False)
            completion = tokenizer.encode(row["completion"], add_bos=False, add_eos=True)
            if len(prompt) + len(completion) - 1 > seq_len:
                raise RolloutError(
                    f"{where}: prompt + completion is {len(prompt) + len(completion)} tokens, "
                    f"more than [training] seq_len + 1 = {seq_len + 1}"
                )
            groups.setdefault(row["group"], []).append(
                Completion(prompt + completion, len(prompt), float(row["reward"]), where)
            )
    if not groups:
        raise RolloutError(f"{path}: no rollout rows")
    return list(groups.values())


def check_group_sizes(groups: list[list[Completion]], group_size: int) -> int:
    """The common group size (from [grpo] group_size, or inferred); errors name the group's first row."""
    expected = group_size or len(groups[0])
    for g in groups:
        if len(g) != expected:
            source = "[grpo] group_size" if group_size else f"the first group ({groups[0][0].where})"
            raise RolloutError(
                f"{g[0].where}: the group starting here has {len(g)} completions, {source} has {expected}"
            )
    if expected < 2:
        raise RolloutError(f"{groups[0][0].where}: groups of 1 completion have no advantage to compare")
    return expected


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


class RolloutDataset(IterableDataset, Stateful):
    """Yields this rank's microbatches, cut from global batches of whole groups.

    The group stream is one seeded permutation of all groups per epoch, concatenated over
    epochs: global batch s is the stream's groups [s*K, (s+1)*K), K = groups per step. Every
    rank computes the same stream, so a global batch's statistics (completion tokens, reward
    std) are known on every rank without communication, and no group is dropped or repeated
    within an epoch whatever the DP degree.
    """

    def __init__(self, groups: list[list[Completion]], plan: BatchPlan, collate: "Collate", seed: int):
        self.groups, self.plan, self.collate, self.seed = groups, plan, collate, seed
        self.step, self.microbatch = 0, 0  # position: the next (global batch, microbatch) to yield

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.groups)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def step_groups(self, step: int) -> list[int]:
        """The group ids of global batch `step`."""
        k, n = self.plan.groups_per_step, len(self.groups)
        first, out = step * k, []
        while len(out) < k:
            epoch, offset = divmod(first + len(out), n)
            out.extend(self.epoch_order(epoch)[offset : offset + k - len(out)])
        return out

    def __iter__(self):
        k, n = self.plan.groups_per_step, len(self.groups)
        while True:
            batch = [self.groups[g] for g in self.step_groups(self.step)]
            if self.microbatch == 0 and (self.step * k) // n != (self.step * k - 1) // n:
                logger.info(f"Rollout data: epoch {self.step * k // n} starts at step {self.step + 1}")
            while self.microbatch < self.plan.grad_accum:
                positions = self.plan.microbatch(self.microbatch)
                self.microbatch += 1
                yield self.collate(batch, positions)
            self.step, self.microbatch = self.step + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "microbatch": self.microbatch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.microbatch = state_dict["step"], state_dict["microbatch"]


class Collate:
    """One microbatch: pads to seq_len, masks all but completion tokens, attaches advantages and loss weights."""

    def __init__(self, seq_len: int, pad_id: int, grpo):
        self.seq_len, self.pad_id, self.cfg = seq_len, pad_id, grpo

    def __call__(self, global_batch: list[list[Completion]], mine: range):
        """`global_batch`: every group of the step, in order; `mine`: positions of this microbatch's groups."""
        cfg = self.cfg
        flat = [c for g in global_batch for c in g]
        G = len(global_batch[0])
        rewards = torch.tensor([c.reward for c in flat], dtype=torch.float32)
        adv = advantages(rewards, G, cfg.advantage_norm, cfg.advantage_eps)
        lens = torch.tensor([len(c.tokens) - c.prompt_len for c in flat])
        weights = loss_weights(lens, cfg.loss_aggregation, cfg.horizon or self.seq_len)
        rows = [i * G + k for i in mine for k in range(G)]
        batch = [flat[i] for i in rows]
        n = len(batch)
        inputs = torch.full((n, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for i, c in enumerate(batch):
            seq = torch.tensor(c.tokens, dtype=torch.long)
            inputs[i, : len(seq) - 1] = seq[:-1]
            # position t predicts token t+1: completion targets start at prompt_len - 1
            labels[i, c.prompt_len - 1 : len(seq) - 1] = seq[c.prompt_len :]
        rollouts = Rollouts(adv[rows], rewards[rows], weights[rows])
        return {"input": inputs, "labels": labels, "rollouts": rollouts}, labels


def build_rollout_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    """torchtitan's dataloader builder for rollout files named by [training] dataset_path."""
    validate(job_config)
    training, grpo = job_config.training, job_config.grpo
    if not training.dataset_path:
        raise ValueError("[training] dataset_path is empty: set it to a rollout JSONL file")
    groups = read_rollouts(training.dataset_path, tokenizer, training.seq_len)
    group_size = check_group_sizes(groups, grpo.group_size)
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
    if plan.groups_per_step > len(groups):
        raise RolloutError(
            f"{training.dataset_path}: {len(groups)} groups, fewer than one global batch "
            f"({plan.groups_per_step} groups of {group_size})"
        )
    logger.info(
        f"Rollouts: {len(groups)} groups of {group_size} from {training.dataset_path}; "
        f"{plan.groups_per_step} groups per step, {len(groups) / plan.groups_per_step:.1f} steps per epoch"
    )
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    collate = Collate(training.seq_len, pad_id, grpo)
    dataset = RolloutDataset(groups, plan, collate, job_config.debug.seed or 0)
    # the dataset yields whole microbatches: no automatic batching
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None)
