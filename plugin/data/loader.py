"""Rollout index -> GRPO microbatches, and the GRPO TrainSpec's dataloader builder.

`plugin.data.rollouts` checks and indexes the rollout file; this module cuts the index's groups into
global batches and a rank's microbatches (plugin.data.batch), and reads only the rows a microbatch
trains on. In online mode the builder hands the prompt file to plugin.data.online instead.
"""

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from plugin.data.batch import BatchPlan, Collate, GroupStream
from plugin.data.chat import ChatTemplate
from plugin.data.online import build_online_dataset
from plugin.data.rollouts import Encoder, RolloutError, RolloutIndex, index_rollouts
from plugin.data.turns import token_text
from plugin.generation.tools import load_tools
from plugin.job import GRPOJob


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
            completion_lens = torch.from_numpy(self.index.loss_lengths[items]).long()  # the loss weights' lengths
            if self.microbatch == 0 and (epoch := self.stream.epoch_starting(self.step)) is not None:
                logger.info(f"Rollout data: epoch {epoch} starts at step {self.step + 1}")
            tokens = self.collate.tokens(self.index.prompt_lengths[items], self.index.lengths[items])
            while self.microbatch < self.plan.grad_accum:
                rows = self.plan.rows(self.microbatch, tokens)
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


def build_encoder(job_config, tokenizer) -> Encoder:
    """Rows -> ids for the run's model: its vocabulary, [training] seq_len, and both kinds of chat template."""
    try:  # the model's vocabulary size (ids at or above it index past the embedding); else the tokenizer's
        vocab_size = get_train_spec(job_config.model.name).model_args[job_config.model.flavor].vocab_size
    except (KeyError, ValueError, AttributeError):
        vocab_size = tokenizer.get_vocab_size()
    # message-list rows use the tokenizer's own chat template, from the folder torchtitan's tokenizer is read from,
    # or [rollout_data] chat_template_path's
    chat = ChatTemplate.from_folder(job_config.model.hf_assets_path, job_config.rollout_data.chat_template_path)
    online = job_config.online
    # the stop id that ends an assistant turn, as the template writes it: where a multi-turn completion's turns end
    stop_ids = list(online.stop_token_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    return Encoder(tokenizer, vocab_size, job_config.training.seq_len, job_config.rollout_data.chat_template, chat,
                   tools=load_tools(online.tools), stop_text=token_text(tokenizer, stop_ids[0]) if stop_ids else None)


def build_rollout_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    """torchtitan's dataloader builder: the rollout file, or in online mode the prompt file, of [training] dataset_path."""
    job = GRPOJob.of(job_config)  # the first of the GRPO TrainSpec's builders that torchtitan's Trainer calls
    training = job_config.training
    online = job_config.online.enable
    if not training.dataset_path:
        what = "a prompt file" if online else "a rollout file"
        raise ValueError(f"[training] dataset_path is empty: set it to {what} (JSONL or Parquet)")
    encoder = build_encoder(job_config, tokenizer)
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
        # sequence parallelism shards a padding-free row's positions over the TP ranks
        tp = job_config.parallelism.tensor_parallel_degree
        return plan, Collate(training.seq_len, pad_id, job_config.grpo, group_size, sampled, pack_multiple=tp)

    if online:
        dataset = build_online_dataset(job_config, job, tokenizer, encoder, batching)
    else:
        dataset = _rollout_dataset(job_config, job, encoder, batching)
    # the dataset yields whole microbatches: no automatic batching
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=None)


def _rollout_dataset(job_config, job: GRPOJob, encoder, batching) -> RolloutDataset:
    training, grpo, cfg = job_config.training, job_config.grpo, job_config.rollout_data
    index = index_rollouts(training.dataset_path, encoder, fmt=cfg.format, group_size=grpo.group_size,
                           on_error=cfg.on_error)
    # every rank indexes the whole file, so the count is the same on all of them
    job.stats.skipped_rows = index.skipped_rows
    group_size = index.group_size
    plan, collate = batching(group_size, index.num_groups, "groups")
    logger.info(
        f"Rollouts: {index.num_groups} groups of {group_size} from {training.dataset_path} "
        f"({'grouped' if index.grouped else 'flat'} rows, index {index.nbytes / 2**20:.2f} MiB); "
        f"{plan.groups_per_step} groups per step, {index.num_groups / plan.groups_per_step:.1f} steps per epoch"
    )
    return RolloutDataset(index, plan, collate, job_config.debug.seed or 0)
