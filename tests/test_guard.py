"""Non-finite values never train silently: a NaN injected in each place stops the step before the
optimizer applies it, naming the term and the step; with on_nonfinite = "skip" the update is dropped
and counted."""

import pytest
import torch

from conftest import CONFIG, build_model, check, job_logs, torchrun_jobs
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


def resume(dump, seed) -> dict:
    """The run of `dump` continued to step 4 from its step-2 checkpoint, as a job that must fail."""
    return {"argv": ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", "4",
                     "--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.initial_load_path", str(seed),
                     "--parallelism.tensor_parallel_degree", "1"], "fails": True}


@pytest.fixture(scope="module")
def resumes(tmp_path_factory, seed_checkpoint) -> dict:
    """Three 2-step runs in one launch (one saved model-only, as torchtitan does by default, two in full); one full
    step folder then loses half its largest data file, the other its .metadata. The three resumes, which must
    fail, share a second launch: it follows the first, so no state of a first run is left in its process. For
    each: (its checkpoint folder, its file snapshot before the resume, after it, the resume's log); and the name
    of the file cut short."""
    dumps = {name: tmp_path_factory.mktemp(name) for name in ("model_only", "truncated", "bad_metadata")}
    check(torchrun_jobs(1, [
        first_run(dumps["model_only"], seed_checkpoint),
        *(first_run(dumps[name], seed_checkpoint, "--checkpoint.no-last-save-model-only")
          for name in ("truncated", "bad_metadata")),
    ]))
    step = dumps["truncated"] / "checkpoint" / "step-2"
    data = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    (dumps["bad_metadata"] / "checkpoint" / "step-2" / ".metadata").write_bytes(b"not a pickle")
    before = {name: snapshot(dump / "checkpoint") for name, dump in dumps.items()}
    proc = torchrun_jobs(1, [resume(dump, seed_checkpoint) for dump in dumps.values()])
    check(proc)  # each job failed, as it should
    logs = job_logs(proc)
    assert len(logs) == len(dumps), proc.stdout[-4000:]
    out = {name: (dump / "checkpoint", before[name], snapshot(dump / "checkpoint"), log)
           for (name, dump), log in zip(dumps.items(), logs)}
    return {**out, "truncated_file": data.name}


def test_resuming_a_model_only_step_says_how_and_touches_nothing(resumes):
    folder, before, after, log = resumes["model_only"]
    assert "failed, as it should" in log
    assert f"{folder / 'step-2'} holds only the model" in log
    assert "last_save_model_only = false" in log and "initial_load_path" in log and "load_step" in log
    assert "Missing key in checkpoint" not in log
    assert after == before


def test_truncated_checkpoint_names_the_step_folder_and_touches_nothing(resumes):
    folder, before, after, log = resumes["truncated"]
    assert "failed, as it should" in log
    assert f"{folder / 'step-2'}: {resumes['truncated_file']} is missing or truncated" in log
    assert after == before
    folder, before, after, log = resumes["bad_metadata"]
    assert "failed, as it should" in log
    assert f"{folder / 'step-2'}: the checkpoint's .metadata cannot be read" in log
    assert after == before
