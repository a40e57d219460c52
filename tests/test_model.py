"""The GRPO model class: torchtitan's model with a mixin, each family's trunk, no shared state."""

import pytest
import torch

from conftest import build_model
from plugin.model.policy import GRPOModel, grpo_model_cls


@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_hidden_states_give_the_base_models_logits(name):
    """The family's explicit trunk + the final norm and output layer = torchtitan's own forward."""
    model, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--model.name", name)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)  # no labels: torchtitan's forward, through super()
        assert logits.shape == (2, 16, 2048)
        torch.testing.assert_close(model.output(model.norm(model.hidden_states(tokens))), logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["grpo_llama3", "grpo_qwen3"])
def test_one_class_per_base_and_no_shared_defaults(name):
    a, _, _, spec = build_model("--parallelism.tensor_parallel_degree", "1", "--model.name", name)
    b, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--model.name", name, "--grpo.temperature", "0.5")
    cls = spec.model_cls
    assert type(a) is type(b) is cls and issubclass(cls, GRPOModel)
    _, base = cls.__bases__  # GRPOModel, torchtitan's model class
    assert grpo_model_cls(base, name.removeprefix("grpo_")) is cls
    assert a.scoring is not b.scoring and (a.scoring.temperature, b.scoring.temperature) == (1.0, 0.5)
    assert a.reference is not b.reference and a.reference.module is not a
    assert "reference" not in dict(a.named_children())  # never a submodule of the policy


def test_qwen3_small_debug_flavor_keeps_what_sets_qwen3_apart():
    """debugmodel_small (plugin.model.qwen3), the CPU twin's flavor: head_dim apart from dim / n_heads, QK norm,
    grouped KV heads and tied weights, as the debugmodel and Qwen3-0.6B; at 1.2M parameters, not 32M."""
    model, *_ = build_model("--parallelism.tensor_parallel_degree", "1", "--model.name", "grpo_qwen3",
                            "--model.flavor", "debugmodel_small")
    args = model.model_args
    assert args.head_dim * args.n_heads != args.dim and args.qk_norm and args.n_kv_heads < args.n_heads
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) < 1.3e6
