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
from harness import ONE_RANK
from plugin.model.llama3 import TiedStateDictAdapter
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


def zero_grad_step(*overrides: str, n_layers: int | None = None):
    """A fresh container at lr 0.5, weight decay 0.5, and one step on zero gradients: AdamW's update is then its
    weight decay alone, p <- 0.75 p. Returns (model, container, the weights before)."""
    model, cfg, pd, spec = build_model(*ONE_RANK, "--optimizer.lr", "0.5", "--optimizer.weight_decay", "0.5",
                                       *overrides, n_layers=n_layers)
    container = spec.build_optimizers_fn([model], cfg.optimizer, pd)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    container.step()
    return model, container, before


def test_norms_get_no_weight_decay_as_in_the_hf_trainer():
    """SmolLM2's shape (one block): with norms_and_biases the decayed parameters are those HF's Trainer (TRL) decays
    in a LlamaForCausalLM of the same shape, the tied embedding among them; the norm weights are left alone."""
    transformers = pytest.importorskip("transformers", reason="the oracle is HF's Trainer: pip install -e '.[dev]'")
    model, _, before = zero_grad_step("--model.flavor", "smollm2_135m", "--optimizer.weight_decay_exempt",
                                      "norms_and_biases", n_layers=1)
    shrunk = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    for n in shrunk:
        torch.testing.assert_close(model.get_parameter(n).detach(), before[n] * 0.75)

    adapter = TiedStateDictAdapter(model.model_args, None)
    hf_name = {n: next(iter(adapter.to_hf({n: p.detach()}))) for n, p in model.named_parameters()}
    a = model.model_args
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=1536, num_hidden_layers=1,
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, tie_word_embeddings=True))
    assert set(hf_name.values()) == {n for n, _ in hf_model.named_parameters()}  # the same parameters
    hf_decayed = set(transformers.Trainer.get_decay_parameter_names(None, hf_model)) - {"lm_head.weight"}  # tied
    assert {hf_name[n] for n in shrunk} == hf_decayed
    assert "tok_embeddings.weight" in shrunk
    assert {"norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"}.isdisjoint(shrunk)


def test_every_parameter_decays_by_default():
    """torchtitan's build_optimizers' choice: one param group, every parameter decayed."""
    model, container, before = zero_grad_step()
    assert [len(o.param_groups) for o in container.optimizers] == [1]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] * 0.75)


@pytest.mark.parametrize("saved, resumed", [("none", "norms_and_biases"), ("norms_and_biases", "none")])
def test_a_resume_keeps_the_configs_weight_decay(saved, resumed):
    """The optimizer state of a run with the other setting loads, and the config's decay per group stays."""
    add_tiny_flavor()
    flags = (*ONE_RANK, "--model.flavor", "tiny", "--training.seq_len", "16")
    containers = []
    for exempt in (saved, resumed):
        model, cfg, pd, spec = build_model(*flags, "--optimizer.weight_decay_exempt", exempt)
        containers.append((model, spec.build_optimizers_fn([model], cfg.optimizer, pd)))
    (model, first), (_, second) = containers
    step(first, model, 0)
    expected = [[g["weight_decay"] for g in o.param_groups] for o in second.optimizers]
    second.load_state_dict(first.state_dict())
    assert [[g["weight_decay"] for g in o.param_groups] for o in second.optimizers] == expected
    assert sorted(expected[0]) == ([0.0, 0.1] if resumed == "norms_and_biases" else [0.1])


def test_a_toml_weight_decay_exempt_outside_the_choices_names_the_key():
    cfg = parse_config()
    cfg.optimizer.weight_decay_exempt = "biases"  # as a TOML value arrives: tyro checks only the command line
    with pytest.raises(ValueError, match=r"\[optimizer\] weight_decay_exempt = 'biases' is not one of \['none', "):
        build_grpo_optimizers([torch.nn.Linear(2, 2)], cfg.optimizer, None)


def test_linear_decay_without_warmup_is_hfs_schedule():
    """torchtitan's linear schedule (warmup 0) and HF's get_linear_schedule_with_warmup (TRL's default) give each
    step the same learning rate: lr * (steps - k) / steps at step k = 0..steps-1, no off-by-one."""
    transformers = pytest.importorskip("transformers", reason="the oracle is HF's scheduler: pip install -e '.[dev]'")
    from torchtitan.components.lr_scheduler import build_lr_schedulers

    cfg = parse_config("--lr_scheduler.warmup_steps", "0")
    steps, lrs = 40, {}
    for name in ("torchtitan", "hf"):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-5)
        if name == "hf":
            scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, steps)
        else:
            scheduler = build_lr_schedulers([optimizer], cfg.lr_scheduler, steps)
        lrs[name] = []
        for _ in range(steps):  # the lr each optimizer step runs with, then the scheduler's step (both trainers' order)
            lrs[name].append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    assert lrs["torchtitan"] == pytest.approx(lrs["hf"], rel=1e-12, abs=0)
    assert lrs["hf"][0] == 1e-5 and lrs["hf"][-1] == pytest.approx(1e-5 / steps)
