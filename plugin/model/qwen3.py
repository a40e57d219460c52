"""What grpo_qwen3 adds to torchtitan's qwen3 TrainSpec: `debugmodel_small`, a debug flavor for CPU runs.

torchtitan's qwen3 `debugmodel` has 31M parameters (8 layers of 2048-wide attention and 3072-wide FFNs
on dim 256), five times llama3's debugmodel, and a CPU step with 4 ranks on 2 cores takes seconds.
`debugmodel_small` keeps what sets qwen3 apart from llama3 (an explicit head_dim unequal to
dim / n_heads, QK norm, grouped KV heads, tied embedding and output weights) at about 1M parameters:
one CPU step of train_configs/gpu_twin_cpu.toml on 4 ranks, 2 cores, took 11 s in bf16 eager on
`debugmodel`.
"""

import dataclasses


def qwen3_family(base) -> dict:
    """What grpo_qwen3 replaces in torchtitan's qwen3 TrainSpec `base`: one more flavor."""
    small = dataclasses.replace(base.model_args["debugmodel"], dim=128, n_layers=4, n_heads=8, n_kv_heads=4,
                                head_dim=32, hidden_dim=384)
    return dict(model_args={**base.model_args, "debugmodel_small": small})
