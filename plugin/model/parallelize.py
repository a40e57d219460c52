"""The GRPO model's parallelize function: torchtitan's, applied to the policy and its reference alike, with tied
embedding and output weights kept one parameter under TP and FSDP2."""

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division
from torchtitan.tools.logging import logger

from plugin import cpu
from plugin.config import compiles_loss
from plugin.job import GRPOJob
from plugin.model.moe import Routing, moe_layers
from plugin.model.policy import ties_weights
from plugin.model.reference import Reference
from plugin.scoring.logprobs import Scoring, chunk_tokens_for
from plugin.scoring.loss import token_terms_fn


def tag_compile_caches(rank: int) -> None:
    """Give this rank's compiled graphs cache keys of their own (torch.compiler.config.cache_key_tag).

    The FX graph and AOTAutograd cache keys do not tell TP ranks apart, so with one cache folder a rank
    would load a graph that has the other rank's vocab range baked in, and its log-probs would be silently
    wrong (pytorch/pytorch#188390; tests/test_logprobs.py shows it). Compiled log-probs of DTensor logits
    are such a graph; the policy scores those eagerly now (plugin.scoring.logprobs._score_chunk), so the tag
    guards any graph that would bake a rank's values in. The tag keeps the graphs apart while
    the ranks share one folder, so the C++ and Triton kernels, keyed by their source, are compiled once
    for all ranks (under a file lock) rather than once per rank.
    """
    tag, config = f"rank{rank}", torch.compiler.config
    if config.cache_key_tag.split("-")[-1] != tag:  # parallelize may run for several model parts
        config.cache_key_tag = f"{config.cache_key_tag}-{tag}" if config.cache_key_tag else tag


def build_grpo_parallelize_fn(base_parallelize: Callable) -> Callable:
    """Wrap torchtitan's parallelize function: parallelize the policy and its reference alike, and configure both."""

    def parallelize_grpo(model: nn.Module, parallel_dims, job_config) -> nn.Module:
        job = GRPOJob.of(job_config)
        if parallel_dims.tp_enabled and (job_config.compile.enable or job_config.reference_model.compile):
            tag_compile_caches(torch.distributed.get_rank())

        def parallelize(module: nn.Module) -> nn.Module:
            return parallelize_model(base_parallelize, module, parallel_dims, job_config)

        reference = Reference.build(model, parallelize, job_config)  # a copy of the meta-device policy
        model = parallelize(model)
        cpu.prepare_parallelized(model)
        grpo, seq_shards = job_config.grpo, parallel_dims.tp if parallel_dims.tp_enabled else 1
        scoring = Scoring(
            temperature=grpo.temperature,
            chunk_size=grpo.logprob_chunk_size,
            # a chunk's fp32 logits on one rank stay within the budget, whatever the batch size
            chunk_tokens=grpo.logprob_chunk_tokens or chunk_tokens_for(grpo.logprob_chunk_mib,
                                                                       model.model_args.vocab_size, seq_shards),
            seq_shards=seq_shards,
            compiled=compiles_loss(job_config),
            backend=job_config.compile.backend,
            entropy_grad=grpo.entropy_coef > 0,
        )
        if scoring.compiled and seq_shards > 1 and not grpo.fused_policy_pass:
            logger.info("[grpo] fused_policy_pass = false under tensor parallelism: the policy's log-probs of the "
                        "vocab-sharded logits run eagerly in loss_parallel (torch 2.13 fails to compile them once "
                        "a batch's token count changes); the blocks and the loss terms are compiled")
        if reference is not None:
            ref_scoring = dataclasses.replace(scoring, compiled=job_config.reference_model.compile,
                                              with_entropy=False, entropy_grad=False)
            reference.module.configure(ref_scoring, padding_free=grpo.padding_free)
        model.configure(
            scoring, job.stats, reference, token_terms=token_terms_fn(job_config) if grpo.fused_policy_pass else None,
            # torchtitan's FSDP policy for the last group: resharded after forward only with "always"
            head_reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward == "always",
            sequence_ratio=grpo.importance_sampling_level == "sequence",
            padding_free=grpo.padding_free,
        )
        if moe_layers(model):
            model.routing = Routing(model, job_config.moe.router_bias_update_rate, job_config.moe.router_replay)
        job.policy, job.parallel_dims = model, parallel_dims  # the online dataset samples from it
        return model

    return parallelize_grpo


def unwrapped_name(name: str) -> str:
    """A parameter's name without the module wrappers parallelize adds (compile's, activation checkpointing's):
    the model's own, on any layout."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


class _WithoutDataParallel:
    """`parallel_dims` as torchtitan's parallelize function sees it when FSDP is applied by `fully_shard_tied`."""

    fsdp_enabled = dp_replicate_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)


def parallelize_model(base_parallelize: Callable, model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torchtitan's parallelize function, with tied embedding and output weights kept one parameter.

    TP gives the embedding and the output layer a DTensor parameter each; both are Shard(0) of
    the same [V, D] weight, so they are tied again before FSDP. torchtitan's FSDP wrapping puts
    the two in different groups, which FSDP2 rejects for a shared parameter ("use
    fully_shard([module_a, module_b])"): with tied weights FSDP is applied by fully_shard_tied.
    """
    if not ties_weights(model):
        return base_parallelize(model, parallel_dims, job_config)
    dp = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    model = base_parallelize(model, _WithoutDataParallel(parallel_dims) if dp else parallel_dims, job_config)
    model.output.weight = model.tok_embeddings.weight
    if dp:
        fully_shard_tied(model, parallel_dims, job_config)
    return model


def fully_shard_tied(model: nn.Module, parallel_dims, job_config) -> None:
    """torchtitan's FSDP/HSDP wrapping of a dense model (llama4's apply_fsdp), the embedding joining the head's group."""
    if not parallel_dims.fsdp_enabled:
        raise ValueError(
            "[parallelism] data_parallel_replicate_degree > 1 without data_parallel_shard_degree > 1 (DDP) is not "
            "supported with tied embedding and output weights: use data_parallel_shard_degree"
        )
    training, policy = job_config.training, job_config.parallelism.fsdp_reshard_after_forward
    mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
    )
    config = dict(mesh=mesh, mp_policy=mp)
    if training.enable_cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=policy != "never")
    # one group for the shared weight; like torchtitan's head group, kept gathered after forward by default
    fully_shard([model.tok_embeddings, model.norm, model.output], **config, reshard_after_forward=policy == "always")
    fully_shard(model, **config)
    disable_fsdp_gradient_division(model)
    logger.info("Applied FSDP with the tied embedding and output weights in one group")
