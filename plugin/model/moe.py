"""Mixture-of-experts routing: what the routers of the policy and of the sampler chose (the `moe/*` metrics),
torchtitan's auxiliary-loss-free load balancing ([moe] router_bias_update_rate), and routing replay
([moe] router_replay: R2, R3).

Everything goes through one forward hook on each layer's router, the module the MoE layer calls: under compile
that is torchtitan's compiled wrapper, so the hook runs outside the graph. It

- counts the experts chosen and the router's entropy while a pass is recorded (`Routing.record`): the policy's
  training passes and the sampler's generation, not evaluation. torchtitan's own `tokens_per_expert` buffer
  counts every forward, whoever calls it. The entropy needs the router's scores, which it does not return, so the
  hook runs its gate again on the same input (one [tokens, dim] x [dim, experts] product, which a replay shares);
- replaces the router's choice with given experts (replay), the gate weights recomputed from the router's own
  scores of them, so that the router keeps its gradient;
- keeps the experts chosen at declared (row, position)s (`Capture`): the sampler's routing for R3, the
  old-log-prob pass's for R2.

torchtitan's balancing (`build_optimizers_with_moe_load_balancing`) is an optimizer pre-hook over its buffers; its
update is redone in `Routing.after_step` from the policy's recorded training tokens only, so that neither
generation nor evaluation moves the bias.
"""
from contextlib import contextmanager
from functools import partial

import numpy as np
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
    """A policy's MoE routing: tokens per expert and router entropy per pass kind (PASSES) since the last `take`,
    the policy's training counts since the last bias update, the experts replayed, a capture in progress."""

    def __init__(self, model: nn.Module, bias_update_rate: float = 0.0, replay: str = "none"):
        self.layers = moe_layers(model)
        self.bias_update_rate, self.replay = bias_update_rate, replay  # [moe] router_replay: none, R2 or R3
        self.num_experts, self.top_k = self.layers[0].router.num_experts, self.layers[0].router.top_k
        self._pass: str | None = None
        self._sums: dict[str, torch.Tensor] = {}  # pass -> [layers, experts + 2]: counts, entropy sum, tokens
        self._since_update: torch.Tensor | None = None  # the policy's counts since the last bias update
        self._replayed: torch.Tensor | None = None  # [tokens, layers, k] the experts the next forward routes to
        self._agreement = None  # [2] float64: replayed slots the router would have chosen too, replayed slots
        self._capture: Capture | None = None
        # the built-in sampler captures its routing (Samples.routed_experts) while this is set: online batches under R3
        self.captures_samples = False
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

    def replay_through_backward(self, experts: torch.Tensor | None) -> None:
        """Route the training pass that follows with `experts` (as `replaying`), and keep them for its backward:
        activation checkpointing runs the forward again there, and a recompute routed otherwise would give the
        gradient of another network (verl's REPLAY_BACKWARD). The next call or the optimizer step clears them."""
        self._replayed = None if experts is None else experts.reshape(-1, len(self.layers), self.top_k)

    @contextmanager
    def replaying(self, experts: torch.Tensor | None):
        """Route the forwards inside with `experts` ([..., layers, k], the input's tokens flattened in order; -1: the
        router's own choice): each token goes to the experts given, weighted by the router's own scores of them,
        which keep their gradient (verl's and slime's replay: the gate weights are the scores' gather). None: as is."""
        if experts is None:
            yield
            return
        assert self._replayed is None
        self._replayed = experts.reshape(-1, len(self.layers), self.top_k)
        try:
            yield
        finally:
            self._replayed = None

    @contextmanager
    def capturing(self, rows: int, length: int, device: torch.device):
        """Keep the experts chosen by the forwards inside, at the (row, position) each forward's tokens are declared
        at (`Capture.at`): a [rows, length, layers, k] int16 buffer, -1 where nothing was routed."""
        assert self._capture is None
        self._capture = Capture(rows, length, len(self.layers), self.top_k, device)
        try:
            yield self._capture
        finally:
            self._capture = None

    @contextmanager
    def capturing_samples(self, on: bool = True):
        """The built-in sampler captures the routing of what it generates inside (for R3's replay)."""
        self.captures_samples = on
        try:
            yield
        finally:
            self.captures_samples = False

    def _router_hook(self, layer: int, router: nn.Module, args, output):
        if torch.compiler.is_compiling():  # inside a compiled decode step ([online] compile_decode): left alone
            return None
        replayed = self._replayed
        # the router's scores before its choice, which it does not return: its gate once more, for both uses
        logits = _local(router.gate(args[0])).float() if replayed is not None or self._pass is not None else None
        if replayed is not None:
            output = self._replay(layer, router, logits, output, replayed[:, layer])
        if self._capture is not None:
            self._capture.write(layer, output[1])
        if self._pass is not None:
            self._count(layer, logits.detach(), output)
        return output if replayed is not None else None

    def _replay(self, layer: int, router: nn.Module, logits: torch.Tensor, output, given: torch.Tensor):
        """torchtitan's router output with the experts `given` ([tokens, k]; -1: its own): the gate weights are the
        router's scores of those experts (its score function, route_norm and route_scale, as torchtitan's
        TokenChoiceTopKRouter), so the router still gets gradients; the counts are of the experts routed to."""
        top, chosen, counts = output
        if given.shape[0] != chosen.shape[0]:
            raise RuntimeError(f"routing replay: layer {layer} routes {chosen.shape[0]} tokens but {given.shape[0]} "
                               "were recorded for this pass")
        given = given.to(chosen.device, torch.long)
        mine = given[:, 0] >= 0
        experts = torch.where(mine[:, None], given, chosen)
        scores = torch.sigmoid(logits) if router.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        weights = scores.gather(1, experts)
        if router.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * router.route_scale
        with torch.no_grad():
            same = (chosen[:, :, None] == experts[:, None, :]).any(-1) & mine[:, None]
            agreement = torch.stack([same.sum(), mine.sum() * self.top_k]).double()
            self._agreement = agreement if self._agreement is None else self._agreement + agreement
            counts = torch.bincount(experts.flatten(), minlength=self.num_experts).to(counts.dtype)
        return weights.to(top.dtype), experts, counts

    @torch.no_grad()
    def _count(self, layer: int, logits: torch.Tensor, output) -> None:
        counts = _local(output[2]).float()
        entropy = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1)
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
        if self.replay != "none" or self._agreement is not None:
            agreement = self._agreement if self._agreement is not None else torch.zeros(2, dtype=torch.float64,
                                                                                        device=self._device())
            self._agreement = None
            if group is not None:
                dist.all_reduce(agreement, group=group)
            if agreement[1] > 0:
                out["moe/routing_agreement"] = (agreement[0] / agreement[1]).item()
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
        """Ends the step's routing replay. With a bias update rate: after an applied step, torchtitan's bias update from the policy's training counts
        since the last one, summed over `group`'s data-parallel ranks: +rate for an expert below its layer's mean
        count, -rate above, centered to sum 0. A step that was not applied moves no bias and drops its counts."""
        self._replayed = None  # the step's last backward is done: generation and evaluation route for themselves
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


class Capture:
    """The experts each (row, position) of a batch was routed to, filled as forwards run (Routing.capturing)."""

    def __init__(self, rows: int, length: int, layers: int, k: int, device: torch.device):
        self.experts = torch.full((rows, length, layers, k), -1, dtype=torch.int16, device=device)
        self._rows = self._positions = self._source = None

    def at(self, rows: torch.Tensor | None, positions: torch.Tensor | None, source: torch.Tensor | None = None) -> None:
        """Token `source[i]` (default i) of the next forward's input, flattened in order, is row `rows[i]`'s at
        `positions[i]`; rows None: the input is the buffer's [rows, length] itself."""
        self._rows, self._positions, self._source = rows, positions, source

    def write(self, layer: int, chosen: torch.Tensor) -> None:
        chosen = _local(chosen).to(torch.int16)
        if self._rows is None:
            self.experts[:, :, layer] = chosen.view(*self.experts.shape[:2], -1)
            return
        chosen = chosen[self._source] if self._source is not None else chosen[: self._rows.numel()]
        # a later write to a position wins: a finished row's discarded draws are rewritten, or lie past its end
        self.experts[self._rows, self._positions, layer] = chosen

    def copy(self, rows: list[int], sources: list[int], lengths: list[int]) -> None:
        """Row `rows[i]`'s first `lengths[i]` positions routed as row `sources[i]`'s: a prompt both rows read, which
        one prefill routed (the built-in engine's prompt sharing)."""
        for b, source, n in zip(rows, sources, lengths):
            self.experts[b, :n] = self.experts[source, :n]

    def row(self, b: int, length: int) -> np.ndarray:
        """Row b's first `length` positions, [length, layers, k] int16 on the host."""
        return self.experts[b, :length].cpu().numpy()
