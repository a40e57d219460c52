"""The GRPO models' optimizer container: torchtitan's, plus what GRPO keeps with the optimizer.

1. The frozen reference's weights are training state, like the optimizer's moments: they belong
   in full checkpoints (a resume is exact, a synced reference survives) and never in model-only
   or HF exports. In torchtitan 0.2.2 the optimizer container is the one state that full
   checkpoints save and exports do not, so its state dict carries them (`grpo_reference.*`).
2. Every [reference_model] sync_steps applied steps, a step post-hook moves the reference
   toward the policy.
3. No update from a step with a non-finite term (plugin.runtime.guard), and the steps asked for are
   counted in the state dict (`grpo_step_calls`).
4. An MoE policy's load-balancing bias ([moe] router_bias_update_rate) moves after each applied step
   (plugin.model.moe), as torchtitan's optimizer pre-hook would move it.
5. `[optimizer] weight_decay_exempt = "norms_and_biases"` puts 1-D parameters (norm weights, biases) in a
   second param group without weight decay, as the Hugging Face Trainer (TRL) does; torchtitan decays all.
The entries' names are those of the checkpoints written before this module existed.
"""

from typing import get_args

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from plugin.config import Optimizer
from plugin.model.moe import Routing
from plugin.model.reference import REFERENCE_PREFIX, Reference
from plugin.runtime.guard import nonfinite_terms, refuse_step
from plugin.runtime.stats import GRPOStats

STEP_KEY = "grpo_step_calls"
OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}  # torchtitan's build_optimizers' choice
WEIGHT_DECAY_EXEMPT = get_args(Optimizer.__annotations__["weight_decay_exempt"])


def decay_groups(params, weight_decay_exempt: str) -> list[dict]:
    """Param groups: all of `params` (none exempt), or the 1-D ones apart with weight_decay 0.

    A 1-D parameter of llama3/qwen3 is a norm weight (or a bias): the parameters that the Hugging Face
    Trainer's get_decay_parameter_names leaves out by name. Embeddings and the (tied) output decay in both.
    `ndim` is a DTensor's global one, so FSDP and TP shards fall in the same groups.
    """
    params = list(params)
    if weight_decay_exempt == "none":
        return [{"params": params}]
    groups = [{"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class GRPOOptimizersContainer(OptimizersContainer):
    """torchtitan's OptimizersContainer with the reference in its state, its sync, and the non-finite guard."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs: dict, *,
                 reference: Reference | None, stats: GRPOStats, weight_decay_exempt: str = "none",
                 routing: Routing | None = None, dp_group=None):
        # torchtitan's container hands each model part's parameters to optimizer_cls: grouped on the way
        grouped = lambda params, **kwargs: optimizer_cls(decay_groups(params, weight_decay_exempt), **kwargs)  # noqa: E731
        super().__init__(model_parts, grouped, optimizer_kwargs)
        # the config's decay per group; a checkpoint's param groups (another setting's, perhaps) do not override it
        self.weight_decays = [[g["weight_decay"] for g in o.param_groups] for o in self.optimizers]
        self.reference, self.stats = reference, stats
        self.routing, self.dp_group = routing, dp_group  # an MoE policy's routing (plugin.model.moe), its DP ranks
        self.step_calls = 0  # steps asked for, applied or skipped; saved with the state
        self.applied_steps = 0  # for [reference_model] sync_steps; a resume reads it from the optimizer state
        self.applied = False  # whether the last step call updated the weights
        if reference is not None and reference.sync_steps > 0:
            self.register_step_post_hook(lambda *_: self._sync_reference())

    def step(self, *args, **kwargs):
        self.step_calls += 1
        grads = [p.grad for model in self.model_parts for p in model.parameters() if p.grad is not None]
        bad = nonfinite_terms(self.stats, grads)
        self.applied = not bad
        if self.routing is not None:  # [moe] router_bias_update_rate: torchtitan's update, as its pre-step hook
            self.routing.after_step(self.applied, self.dp_group)
        if bad:
            # torch runs the step post-hooks all the same; _sync_reference reads `applied`
            return refuse_step(bad, self.step_calls, self.stats)
        self.applied_steps += 1
        policy = self.model_parts[0]
        policy.weights_version = getattr(policy, "weights_version", 0) + 1
        # not super().step(): torch wraps the step of each container class it builds with the hooks' runner, so
        # OptimizersContainer.step may be wrapped too (in a process that built one) and run the hooks twice
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)

    def _sync_reference(self) -> None:
        """Every sync_steps applied steps, move the reference toward the policy."""
        reference, policy = self.reference, self.model_parts[0]
        if not self.applied or self.applied_steps % reference.sync_steps:
            return
        with reference.on_device(next(policy.parameters()).device):
            reference.sync(policy, reference.sync_alpha)
        logger.info(f"Step {self.applied_steps}: reference <- {reference.sync_alpha} * policy + "
                    f"{1 - reference.sync_alpha:g} * reference")

    def state_dict(self):
        sd = super().state_dict()
        if self.reference is not None:
            sd.update(self.reference.state_dict())
        sd[STEP_KEY] = torch.tensor(self.step_calls)
        return sd

    def load_state_dict(self, state_dict):
        if STEP_KEY in state_dict:
            self.step_calls = int(state_dict.pop(STEP_KEY))
        reference_sd = {k: state_dict.pop(k) for k in list(state_dict) if k.startswith(REFERENCE_PREFIX)}
        super().load_state_dict(state_dict)
        for optimizer, decays in zip(self.optimizers, self.weight_decays):
            for group, decay in zip(optimizer.param_groups, decays):
                group["weight_decay"] = decay
        self.applied_steps = self._optimizer_steps()
        if reference_sd and self.reference is not None:
            self.reference.load_state_dict(reference_sd)

    def _optimizer_steps(self) -> int:
        """Steps applied, as Adam/AdamW (torchtitan's optimizers) count them in their state."""
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                if "step" in state:
                    return int(state["step"])
        return 0


def build_grpo_optimizers(model_parts: list[nn.Module], optimizer_config, parallel_dims, ft_manager=None):
    """The TrainSpec's optimizer builder: torchtitan's build_optimizers' choices, in a GRPOOptimizersContainer."""
    if optimizer_config.early_step_in_backward:
        raise ValueError("[optimizer] early_step_in_backward = true is not supported by the GRPO models: the "
                         "non-finite guard and the reference's checkpoint entries need the optimizer step")
    if ft_manager is not None and ft_manager.enabled:
        raise ValueError("[fault_tolerance] enable = true is not supported by the GRPO models")
    if optimizer_config.name not in OPTIMIZERS:
        raise ValueError(f"[optimizer] name = {optimizer_config.name!r} is not one of {list(OPTIMIZERS)}")
    c = optimizer_config
    if c.weight_decay_exempt not in WEIGHT_DECAY_EXEMPT:  # a TOML value bypasses tyro's Literal check
        raise ValueError(f"[optimizer] weight_decay_exempt = {c.weight_decay_exempt!r} is not one of "
                         f"{list(WEIGHT_DECAY_EXEMPT)}")
    kwargs = dict(lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
                  fused=c.implementation == "fused", foreach=c.implementation == "foreach")
    policy = model_parts[0]
    batch = parallel_dims.get_optional_mesh("batch") if parallel_dims.dp_enabled else None
    return GRPOOptimizersContainer(model_parts, OPTIMIZERS[c.name], kwargs, reference=policy.reference,
                                   stats=policy.stats, weight_decay_exempt=c.weight_decay_exempt,
                                   routing=policy.routing, dp_group=batch.get_group() if batch else None)
