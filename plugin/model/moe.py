"""Mixture-of-experts routing: what the routers of the policy and of the sampler chose (the `moe/*` metrics), and
torchtitan's auxiliary-loss-free load balancing ([moe] router_bias_update_rate).

torchtitan's MoE layer counts its tokens per expert into a buffer on every forward, whoever calls it: training,
sampling, evaluation. So the counts here come from a forward hook on each layer's router instead, and only while a
pass is recorded (`Routing.record`): the policy's training passes and the sampler's generation. The hook sits on
the router module the layer calls, which under compile is torchtitan's compiled wrapper: it runs outside the graph.
The router's entropy needs its scores, which it does not return, so the hook runs the router's gate again on the
same input (one [tokens, dim] x [dim, experts] product, no gradient).

torchtitan's own balancing (`build_optimizers_with_moe_load_balancing`) is an optimizer pre-hook over those
buffers; its update is redone in `update_expert_bias` from the policy's recorded training tokens only, so that
neither generation nor evaluation moves the bias.
"""

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

PASSES = ("policy", "sampler")


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE modules, in layer order (torchtitan's blocks with `moe_enabled`)."""
    return [block.moe for block in model.layers.values() if getattr(block, "moe_enabled", False)]


def _local(t: torch.Tensor) -> torch.Tensor:
    # the router's outputs are replicated across TP ranks (torchtitan's NoParallel gate): a local copy is all of it
    return t.to_local() if isinstance(t, DTensor) else t


class Routing:
    """Tokens per expert and router entropy of a model's MoE layers, per pass kind (PASSES), since the last `take`;
    and the policy's training counts since the last bias update."""

    def __init__(self, model: nn.Module, bias_update_rate: float = 0.0):
        self.layers = moe_layers(model)
        self.bias_update_rate = bias_update_rate
        self.num_experts = self.layers[0].router.num_experts
        self._pass: str | None = None
        self._sums: dict[str, torch.Tensor] = {}  # pass -> [layers, experts + 2]: counts, entropy sum, tokens
        self._since_update: torch.Tensor | None = None  # the policy's counts since the last bias update
        for i, moe in enumerate(self.layers):
            moe.router.register_forward_hook(partial(self._router_hook, i))

    @contextmanager
    def record(self, kind: str):
        """Count the routing of the forwards run inside, as `kind`'s."""
        assert kind in PASSES and self._pass is None, (kind, self._pass)
        self._pass = kind
        try:
            yield
        finally:
            self._pass = None

    @torch.no_grad()
    def _router_hook(self, layer: int, router: nn.Module, args, output) -> None:
        if self._pass is None:
            return
        x, counts = args[0], _local(output[2]).float()
        scores = _local(router.gate(x)).float()
        entropy = -(F.softmax(scores, -1) * F.log_softmax(scores, -1)).sum(-1)
        row = torch.cat([counts, torch.stack([entropy.sum(), entropy.new_tensor(float(entropy.numel()))])])
        sums = self._sums.get(self._pass)
        if sums is None:
            sums = self._sums[self._pass] = torch.zeros(len(self.layers), self.num_experts + 2, dtype=torch.float64,
                                                        device=counts.device)
        sums[layer] += row
        if self._pass == "policy" and self.bias_update_rate > 0:
            if self._since_update is None:
                self._since_update = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64,
                                                 device=counts.device)
            self._since_update[layer] += counts

    def take(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """The `moe/*` metrics since the last call, over the data-parallel ranks of `group` (None: one rank).

        Per layer, an expert's load is its token count over the mean count of the layer's experts (1 everywhere:
        even); `load_max` and `load_min` average the layers' highest and lowest loads; `router_entropy` is the
        mean entropy (nats) of the router's softmax over every routed position. The sampler's carry `sampler_`."""
        out = {}
        for kind in PASSES:
            sums = self._sums.pop(kind, None)
            if group is not None:  # every rank takes part, having recorded or not
                sums = self._reduced(sums, group)
            if sums is None:
                continue
            counts, entropy, tokens = sums[:, :-2], sums[:, -2], sums[:, -1]
            if tokens.sum() == 0:
                continue
            load = counts / counts.mean(-1, keepdim=True).clamp_min(1e-30)
            prefix = "moe/" if kind == "policy" else "moe/sampler_"
            out[prefix + "load_max"] = load.max(-1).values.mean().item()
            out[prefix + "load_min"] = load.min(-1).values.mean().item()
            out[prefix + "router_entropy"] = (entropy.sum() / tokens.sum()).item()
        bias = [moe.expert_bias for moe in self.layers if getattr(moe, "expert_bias", None) is not None]
        if self.bias_update_rate > 0 and bias:
            out["moe/expert_bias_max_abs"] = max(_local(b).abs().max().item() for b in bias)
        return out

    def _reduced(self, sums: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor | None:
        """The sum over `group`'s ranks; a rank that recorded nothing adds zeros (all ranks of a step record alike)."""
        device = sums.device if sums is not None else self._device()
        present = torch.tensor([0.0 if sums is None else 1.0], device=device)
        buf = sums if sums is not None else torch.zeros(len(self.layers), self.num_experts + 2, dtype=torch.float64,
                                                        device=device)
        dist.all_reduce(present, group=group)
        if present.item() == 0:
            return None
        dist.all_reduce(buf, group=group)
        return buf

    def _device(self) -> torch.device:
        return self.layers[0].tokens_per_expert.device

    @torch.no_grad()
    def after_step(self, applied: bool, group: dist.ProcessGroup | None) -> None:
        """With a bias update rate: after an applied step, torchtitan's bias update from the policy's training counts
        since the last one, summed over `group`'s data-parallel ranks: +rate for an expert below its layer's mean
        count, -rate above, centered to sum 0. A step that was not applied moves no bias and drops its counts."""
        rate, counts, self._since_update = self.bias_update_rate, self._since_update, None
        if rate == 0 or not applied:
            return
        if counts is None:
            counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64, device=self._device())
        if group is not None:
            dist.all_reduce(counts, group=group)
        delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
        delta -= delta.mean(-1, keepdim=True)
        for moe, d in zip(self.layers, delta):
            _local(moe.expert_bias).add_(d.to(moe.expert_bias.dtype))
