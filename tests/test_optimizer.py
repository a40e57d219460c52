"""The GRPO optimizer container (plugin.model.optimizer): a named class built by the TrainSpec's builder.

A full checkpoint written by main at f2b79fe, whose container was torchtitan's with its class
swapped in place, resumes bitwise: tests/fixtures/make_old_checkpoint.py wrote it there.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from fixtures.make_old_checkpoint import FLAGS, OUT, add_tiny_flavor, batch, flat, step
from conftest import build_model, parse_config
from plugin.model.optimizer import STEP_KEY, GRPOOptimizersContainer, build_grpo_optimizers
from plugin.model.reference import REFERENCE_PREFIX


def test_a_checkpoint_of_the_class_swapping_container_resumes_bitwise():
    add_tiny_flavor()
    model, cfg, pd, spec = build_model(*FLAGS)
    model(batch()[0], labels=batch()[1])
    container = spec.build_optimizers_fn([model], cfg.optimizer, pd)
    assert type(container) is GRPOOptimizersContainer
    state = {"model": get_model_state_dict(model), "optimizer": container.state_dict()}
    # the same entries as the old container's: its optimizer state, the reference and the step count
    assert {k for k in state["optimizer"] if k.startswith(REFERENCE_PREFIX)} and STEP_KEY in state["optimizer"]
    dcp.load(state, checkpoint_id=str(OUT))
    set_model_state_dict(model, state["model"])
    container.load_state_dict(state["optimizer"])
    assert (container.step_calls, container.applied_steps) == (2, 2)
    for seed in (3, 4):  # the sync at step 4 happens where the old run's did
        step(container, model, seed)
    after = torch.load(OUT / "after.pt")
    assert torch.equal(flat(model), after["model"]) and torch.equal(flat(model.reference.module), after["reference"])


@pytest.mark.parametrize("key, value, match", [
    ("--optimizer.early_step_in_backward", None, r"\[optimizer\] early_step_in_backward"),
    ("--optimizer.name", "SGD", r"\[optimizer\] name = 'SGD' is not one of \['Adam', 'AdamW'\]"),
])
def test_unsupported_optimizer_settings_name_the_key(key, value, match):
    cfg = parse_config(key, *([value] if value else []))
    with pytest.raises(ValueError, match=match):
        build_grpo_optimizers([torch.nn.Linear(2, 2)], cfg.optimizer, None)
