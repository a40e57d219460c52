"""What grpo_qwen3 adds to torchtitan's qwen3 TrainSpec: debug flavors sized for CPU runs.

torchtitan's qwen3 `debugmodel` has 31M parameters (8 layers of 2048-wide attention and 3072-wide FFNs
on dim 256), five times llama3's debugmodel, and a CPU step with 4 ranks on 2 cores takes seconds.
`debugmodel_small` keeps what sets qwen3 apart from llama3 (an explicit head_dim unequal to
dim / n_heads, QK norm, grouped KV heads, tied embedding and output weights) at about 1M parameters:
one CPU step of train_configs/gpu_twin_cpu.toml on 4 ranks, 2 cores, took 11 s in bf16 eager on
`debugmodel`.

`debugmodel_moe_small` is torchtitan's `debugmodel_moe` (64 experts of 768 on dim 256, top 8, in each of
8 layers: 310M parameters) at the same small size: 8 experts of 64, top 2, every layer a mixture of
experts, and the rest of `debugmodel_moe`'s router and experts as they are (softmax scores, the top-k
renormalised, gates applied after the experts, grouped matmuls, which torchtitan computes in bf16).
"""

import dataclasses

SMALL = dict(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32)


def qwen3_family(base) -> dict:
    """What grpo_qwen3 replaces in torchtitan's qwen3 TrainSpec `base`: more flavors."""
    small = dataclasses.replace(base.model_args["debugmodel"], **SMALL, hidden_dim=384)
    moe = base.model_args["debugmodel_moe"]
    moe_small = dataclasses.replace(moe, **SMALL, moe_inter_dim=64,
                                    moe_args=dataclasses.replace(moe.moe_args, num_experts=8, top_k=2))
    return dict(model_args={**base.model_args, "debugmodel_small": small, "debugmodel_moe_small": moe_small})
