"""Non-finite values never train silently: a NaN injected in each place stops the step before the
optimizer applies it, naming the term and the step; with on_nonfinite = "skip" the update is dropped
and counted."""

import pytest
import torch

from conftest import CONFIG, build_model, check, torchrun, torchrun_jobs
from plugin.data.batch import Rollouts
from plugin.runtime.guard import NonFiniteError
from plugin.scoring.loss import build_grpo_loss

B, T = 4, 16


def setup(*overrides):
    model, cfg, pd, spec = build_model("--parallelism.tensor_parallel_degree", "1", *overrides)
    return model, spec.build_optimizers_fn([model], cfg.optimizer, pd), build_grpo_loss(cfg)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens, labels = torch.randint(0, 2048, (B, T), generator=g), torch.randint(0, 2048, (B, T), generator=g)
    labels[:, :6] = -100
    return tokens, labels, Rollouts(torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([1.0, 0.0, 1.0, 0.0]),
                                    torch.ones(B))


def nan_at_completion(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[1, 10] = float("nan")
    return x


def train_step(model, container, loss_fn, inject: str | None, monkeypatch, seed=0):
    tokens, labels, rollouts = batch(seed)
    if inject == "advantages":
        rollouts.advantages[2] = float("nan")
    if inject == "loss":  # an infinite loss weight: advantages and log-probs stay finite
        rollouts.loss_weights[0] = float("inf")
    if inject == "reference log-probs":
        logprobs = model.reference.logprobs
        monkeypatch.setattr(model.reference, "logprobs", lambda *a, **k: nan_at_completion(logprobs(*a, **k)))
    if inject == "policy log-probs":  # the fused pass's (the default), or the unfused one's
        if model.token_terms is not None:
            fused = model.fused_loss
            monkeypatch.setattr(model, "fused_loss", lambda *a, **k: (lambda loss, lp, ent: (
                loss, nan_at_completion(lp), ent))(*fused(*a, **k)))
        else:
            score = model.score
            monkeypatch.setattr(model, "score", lambda *a, **k: (lambda lp, ent: (nan_at_completion(lp), ent))(
                *score(*a, **k)))
    container.zero_grad()
    loss_fn(model(tokens, labels=labels, rollouts=rollouts), labels).backward()
    if inject == "gradients":
        next(model.parameters()).grad[0, 0] = float("inf")
    container.step()
    monkeypatch.undo()


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


TERMS = ["advantages", "reference log-probs", "policy log-probs", "loss", "gradients"]


@pytest.mark.parametrize("term", TERMS)
def test_nonfinite_term_stops_the_step_before_the_update(term, monkeypatch):
    model, container, loss_fn = setup()
    train_step(model, container, loss_fn, None, monkeypatch)  # step 1 is clean
    before = weights(model)
    with pytest.raises(NonFiniteError, match=rf"^step 2: non-finite {term}\b"):
        train_step(model, container, loss_fn, term, monkeypatch, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))


@pytest.mark.parametrize("term", TERMS)
def test_skip_drops_the_update_counts_it_and_goes_on(term, monkeypatch):
    model, container, loss_fn = setup("--grpo.on_nonfinite", "skip")
    before = weights(model)
    train_step(model, container, loss_fn, term, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    assert model.stats.skipped_steps == 1
    train_step(model, container, loss_fn, None, monkeypatch, seed=1)  # the next clean step trains
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.stats.reduce(None, torch.device("cpu"))["grpo/skipped_steps"] == 1


def test_step_count_survives_a_resume(monkeypatch):
    model, container, loss_fn = setup()
    train_step(model, container, loss_fn, None, monkeypatch)
    saved = container.state_dict()
    resumed, resumed_container, _ = setup()
    resumed_container.load_state_dict(saved)
    with pytest.raises(NonFiniteError, match=r"^step 2: "):
        train_step(resumed, resumed_container, loss_fn, "advantages", monkeypatch)


def snapshot(folder) -> dict:
    """Every file under `folder`: its size, modification time and content hash."""
    import hashlib

    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.md5(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def first_run(dump, seed, *extra) -> list[str]:
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", "2", "--checkpoint.enable",
            "--checkpoint.interval", "1000", "--checkpoint.initial_load_path", str(seed),
            "--parallelism.tensor_parallel_degree", "1", *extra]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, seed_checkpoint):
    """Both tests' 2-step runs, in one launch. Each test's failing resume has a launch of its own: it is
    expected to fail, and its output is read for the message."""
    dumps = {"model_only": tmp_path_factory.mktemp("model_only"), "full": tmp_path_factory.mktemp("full")}
    check(torchrun_jobs(1, [
        first_run(dumps["model_only"], seed_checkpoint),  # torchtitan's default: the last step is saved model-only
        first_run(dumps["full"], seed_checkpoint, "--checkpoint.no-last-save-model-only"),
    ]))
    return dumps


def resume(dump, seed):
    return torchrun(1, CONFIG, "--job.dump_folder", str(dump), "--training.steps", "4", "--checkpoint.enable",
                    "--checkpoint.interval", "1000", "--checkpoint.initial_load_path", str(seed),
                    "--parallelism.tensor_parallel_degree", "1")


def test_resuming_a_model_only_step_says_how_and_touches_nothing(first_runs, seed_checkpoint):
    dump = first_runs["model_only"]
    before = snapshot(dump / "checkpoint")
    proc = resume(dump, seed_checkpoint)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"{dump / 'checkpoint' / 'step-2'} holds only the model" in out
    assert "last_save_model_only = false" in out and "initial_load_path" in out and "load_step" in out
    assert "Missing key in checkpoint" not in out
    assert snapshot(dump / "checkpoint") == before


def test_truncated_checkpoint_names_the_step_folder_and_touches_nothing(first_runs, seed_checkpoint):
    dump = first_runs["full"]
    step = dump / "checkpoint" / "step-2"
    data = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = snapshot(dump / "checkpoint")
    proc = resume(dump, seed_checkpoint)
    assert proc.returncode != 0
    assert f"{step}: {data.name} is missing or truncated" in proc.stdout + proc.stderr
    assert snapshot(dump / "checkpoint") == before
    (step / ".metadata").write_bytes(b"not a pickle")
    proc = resume(dump, seed_checkpoint)
    assert proc.returncode != 0 and f"{step}: the checkpoint's .metadata cannot be read" in proc.stdout + proc.stderr
