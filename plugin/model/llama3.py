"""torchtitan 0.2.2's llama3 with what a SmolLM2-shaped checkpoint needs: tied embeddings, RoPE without scaling.

torchtitan's llama3 always applies Llama-3.1 RoPE scaling and has no weight tying; qwen3 has
`enable_weight_tying`. This module gives llama3 the same switch (model, state-dict adapter, the
`model_args.enable_weight_tying` that plugin.model.parallelize reads to keep the two one parameter) and
the `smollm2_135m` flavor, the shape of SmolLM2-135M(-Instruct) that plugin.convert_gguf writes.
Flavors of torchtitan's own are untouched: their args have no tying field and build as before.
"""

import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter


@dataclass
class TiedTransformerModelArgs(TransformerModelArgs):
    enable_weight_tying: bool = False
    """The output layer shares the embedding's weight (qwen3's field of the same name)."""

    def update_from_config(self, job_config, **kwargs) -> None:
        super().update_from_config(job_config, **kwargs)
        tp = job_config.parallelism.tensor_parallel_degree
        n_kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads % tp or n_kv_heads % tp:
            # torchtitan's TP plan shards wq/wk/wv by rows; a rank would hold a fraction of a head
            # and its forward would fail in a reshape, naming neither the key nor the heads
            raise ValueError(
                f"[parallelism] tensor_parallel_degree = {tp} does not divide [model] flavor "
                f"{job_config.model.flavor!r}'s {self.n_heads} attention heads and {n_kv_heads} KV heads: "
                f"use a divisor of {math.gcd(self.n_heads, n_kv_heads)}, and data_parallel_shard_degree for more ranks"
            )


class TiedTransformer(Transformer):
    """torchtitan's llama3 Transformer, the output layer sharing the embedding's weight when the args say so."""

    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(model_args)
        if ties(model_args):
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device=None):
        if ties(self.model_args):
            # as qwen3's init_weights: a meta-device model moved with to_empty may have lost the tie
            self.output.weight = self.tok_embeddings.weight
        super().init_weights(buffer_device)


class TiedStateDictAdapter(Llama3StateDictAdapter):
    """HF conversion with tied weights (no `lm_head.weight` read or written) and any head count under FSDP/TP.

    torchtitan's adapter permutes wq/wk rows by viewing [n_heads * head_dim, dim] as [n_heads, ...];
    a DTensor sharded by rows over a degree that does not divide n_heads (SmolLM2's 9 heads, FSDP=2)
    refuses that view ("Cannot unflatten unevenly sharded tensor"). The permutation is done on the
    full tensor instead (a [576, 576] matrix here), and resharded as it was; other layouts are left to torchtitan.
    """

    def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return on_full_tensor(super()._permute, w, n_heads_arg, dim1, dim2)

    def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return on_full_tensor(super()._reverse_permute, w, n_heads_arg, dim1, dim2)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_state_dict = super().to_hf(state_dict)
        if ties(self.model_args):
            hf_state_dict.pop("lm_head.weight", None)
        return hf_state_dict

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if ties(self.model_args) and "lm_head.weight" not in hf_state_dict:
            hf_state_dict = {**hf_state_dict, "lm_head.weight": hf_state_dict["model.embed_tokens.weight"]}
        return super().from_hf(hf_state_dict)


def on_full_tensor(fn, w, n_heads: int, *args):
    """fn(w, n_heads, *args); for a DTensor whose row shards split a head, fn of its full tensor, resharded as w."""
    if not isinstance(w, DTensor):
        return fn(w, n_heads, *args)
    row_shards = math.prod(w.device_mesh.size(i) for i, p in enumerate(w.placements) if p.is_shard(0))
    if n_heads % row_shards == 0:  # torchtitan's own flavors: its view works on the shards
        return fn(w, n_heads, *args)
    # every rank holds the same full tensor: each keeps its own shard, no scatter needed
    return distribute_tensor(fn(w.full_tensor(), n_heads, *args), w.device_mesh, w.placements, src_data_rank=None)


def ties(model_args) -> bool:
    return bool(getattr(model_args, "enable_weight_tying", False))


# SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 KV heads (head dim 64), FFN 1536, vocab 49152, RoPE base 1e5
SMOLLM2_135M = TiedTransformerModelArgs(
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    vocab_size=49152,
    multiple_of=256,  # llama3's FFN width: 256 * ceil(int(2 * 4 * 576 / 3) / 256) = 1536, as the checkpoint's
    norm_eps=1e-5,
    rope_theta=100000,
    # torchtitan applies Llama-3.1 scaling always; a factor of 1 makes every band's frequency unchanged
    rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
    max_seq_len=8192,
    enable_weight_tying=True,
)


def llama3_family(base) -> dict:
    """What grpo_llama3 replaces in torchtitan's llama3 TrainSpec `base`: the tying-aware classes, one more flavor."""
    return dict(
        model_cls=TiedTransformer,
        model_args={**base.model_args, "smollm2_135m": SMOLLM2_135M},
        state_dict_adapter=TiedStateDictAdapter,
    )
