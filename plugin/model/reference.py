"""The frozen reference model's whole lifecycle: build, first load, sync, offload, checkpoint.

The reference is a deep copy of the policy's meta-device module, parallelized by the same
function on the same TP/FSDP mesh, so every parameter shard lines up with the policy's. The
policy holds it through a `Reference`, not as a submodule: torchtitan's optimizer, grad-norm
clipping, FSDP gradient reduction and checkpoint/export of `model_parts` only see the policy.

1. build: at parallelize time, on meta (no memory yet); `[grpo] beta = 0` builds none.
2. materialize: the policy's to_empty / init_weights materialize it and compute its buffers.
3. first load, at the first forward (after torchtitan's checkpoint load): [reference_model]
   checkpoint_path, else the policy's weights; unless a full checkpoint restored it.
4. sync: every sync_steps optimizer steps, an optimizer step post-hook moves it toward the policy.
5. offload: with [reference_model] offload its weights visit the device only for its forward.
6. checkpoint: saved with the optimizer's state, see plugin.model.optimizer.
"""

import copy
from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.logging import logger

from plugin import cpu

# the reference's entries in the optimizer container's state dict (and so in full checkpoints)
REFERENCE_PREFIX = "grpo_reference."


def reference_entries(state_dict: dict) -> dict:
    """The reference's weights among a (checkpoint's optimizer) state dict's entries, prefix removed."""
    return {k[len(REFERENCE_PREFIX):]: v for k, v in state_dict.items() if k.startswith(REFERENCE_PREFIX)}


class Reference:
    """The frozen reference model of a policy, and everything done to it."""

    def __init__(self, module: nn.Module, job_config):
        r = job_config.reference_model
        self.module = module
        self.checkpoint_path, self.sync_steps, self.sync_alpha = r.checkpoint_path, r.sync_steps, r.sync_alpha
        self.checkpoint_format = r.checkpoint_format  # resolved from "auto" by plugin.config.validate_job
        self.sd_adapter = None
        if self.checkpoint_format == "hf":
            adapter_cls = get_train_spec(job_config.model.name).state_dict_adapter
            self.sd_adapter = adapter_cls(module.model_args, job_config.model.hf_assets_path)
        self.offload = r.offload and not cpu.is_active()
        if r.offload and cpu.is_active():
            logger.info("[reference_model] offload = true has no effect on CPU: the weights already live in CPU memory")
        self.loaded = False  # holds its start-up (or restored) weights

    @classmethod
    def build(cls, policy: nn.Module, parallelize: Callable[[nn.Module], nn.Module], job_config) -> "Reference | None":
        """A frozen, parallelized copy of the (meta-device) policy; None with [grpo] beta = 0."""
        if job_config.grpo.beta == 0:
            logger.info("[grpo] beta = 0: no reference model is built, loaded or run; [reference_model] has no effect")
            return None
        module = parallelize(copy.deepcopy(policy))
        module.requires_grad_(False)
        module.eval()
        if isinstance(module, FSDPModule):
            # no backward follows its forward: free every all-gathered weight right away
            # (torchtitan keeps the last layers' for backward), so its parameters also stay
            # sharded like the policy's, as sync needs
            module.set_reshard_after_forward(True)
        cpu.prepare_parallelized(module)
        return cls(module, job_config)

    def materialize(self, device, recurse: bool = True) -> None:
        self.module.to_empty(device=device, recurse=recurse)

    def init_buffers(self, *args, **kwargs) -> None:
        """Its buffers (RoPE tables); the weights come at the first forward, after torchtitan's checkpoint load."""
        self.module.init_weights(*args, **kwargs)
        self.loaded = False
        if self.offload:
            self.module.to("cpu")

    @contextmanager
    def on_device(self, device: torch.device):
        """With offload, the weights visit `device` only inside this block.

        `nn.Module.to` works for plain, TP (DTensor) and FSDP2-sharded parameters: it swaps
        DTensor parameters in place, and FSDP2 re-registers its shards after the move.
        """
        with offloaded(self.module, device, self.offload):
            yield

    def logprobs(self, policy: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, stats, **kwargs) -> torch.Tensor:
        """[B, T] log-probs of `labels` under the reference; its first call loads its weights."""
        self.load_once(policy, tokens.device)
        # the offload's transfers count toward the pass's time and peak memory
        with stats.reference_pass(tokens.device), self.on_device(tokens.device):
            return self.module.logprobs(tokens, labels, **kwargs)

    def load_once(self, policy: nn.Module, device: torch.device) -> None:
        """The start-up weights ([reference_model] checkpoint_path, else the policy's) at the first forward, also
        one whose reference log-probs came with the rollouts: a later pass, a sync or a checkpoint must see the
        policy's initial weights."""
        if self.loaded:
            return
        with self.on_device(device):
            if self.checkpoint_path:
                load_reference_checkpoint(self.module, self.checkpoint_path, self.checkpoint_format, self.sd_adapter)
                logger.info(f"Reference model loaded from [reference_model] checkpoint_path = "
                            f"{self.checkpoint_path} ({self.checkpoint_format})")
            else:
                self.sync(policy)
                logger.info("Reference model set to the policy's current weights")
        self.loaded = True

    @torch.no_grad()
    def sync(self, policy: nn.Module, alpha: float = 1.0) -> None:
        """reference <- alpha * policy + (1 - alpha) * reference, for the parameters and the floating-point buffers
        the state dict holds: an MoE router's load-balancing expert_bias picks the experts, so a reference without
        the policy's would route otherwise (a policy loaded from a torchtitan checkpoint trained with balancing has
        one; on debugmodel_moe_small a random bias put the reference up to 6.2e-3 nats off the policy at the first
        forward, 1e-6 with it). Counters (tokens_per_expert) and constants (RoPE) stay the reference's. Same
        parallelization, so every update is local."""
        ref = {**dict(self.module.named_parameters()), **_state_buffers(self.module)}
        for name, p in [*policy.named_parameters(), *_state_buffers(policy).items()]:
            if alpha == 1:
                ref[name].copy_(p)
            else:
                ref[name].mul_(1 - alpha).add_(p, alpha=alpha)

    def state_dict(self) -> dict:
        """Its weights under REFERENCE_PREFIX (with offload, the CPU copies)."""
        return {REFERENCE_PREFIX + k: v for k, v in get_model_state_dict(self.module).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.module, reference_entries(state_dict))
        self.loaded = True
        logger.info("Reference model restored from the checkpoint")


@contextmanager
def offloaded(module: nn.Module, device: torch.device, enabled: bool):
    """With `enabled`, `module`'s weights (kept in CPU memory) visit `device` only inside this block (the reference's
    and the reward models' [reference_model] offload)."""
    if enabled:
        module.to(device)
    try:
        yield
    finally:
        if enabled:
            module.to("cpu")


def _state_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's floating-point buffers that its state dict holds (persistent ones), by their named_buffers names:
    told by the tensors themselves, as the state dict's keys drop wrappers' prefixes (activation checkpointing's)."""
    held = {id(t) for t in module.state_dict(keep_vars=True).values()}
    return {n: b for n, b in module.named_buffers() if b.is_floating_point() and id(b) in held}


def load_reference_checkpoint(reference: nn.Module, path: str, fmt: str, sd_adapter=None) -> None:
    """Load a DCP step folder (model-only or full) or an HF safetensors folder into the reference.

    DCP reshards to the reference's own TP/FSDP layout. HF goes through the TrainSpec's
    state-dict adapter, exactly as torchtitan's `[checkpoint] initial_load_in_hf` does.
    """
    state_dict = get_model_state_dict(reference)
    if fmt == "hf":
        hf_state_dict = sd_adapter.to_hf(state_dict)
        dcp.load(hf_state_dict, storage_reader=sd_adapter.get_hf_storage_reader(path))
        # the entries HF has no name for keep the reference's own: torchtitan's adapter drops an MoE layer's
        # load-balancing expert_bias on the way out (to_hf), so from_hf cannot give it back
        state_dict = {**state_dict, **sd_adapter.from_hf(hf_state_dict)}
    else:
        # a full checkpoint holds the model's entries at top level, next to "optimizer" etc.
        dcp.load(state_dict, checkpoint_id=path)
    set_model_state_dict(reference, state_dict)
