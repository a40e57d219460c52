"""The reference model's lifecycle: start-up weights, checkpoints, export, sync, offload, beta = 0.

Simplifications:
1. Fast tests build the GRPO model in one process as torchtitan's Trainer does (meta init,
   parallelize, to_empty, init_weights); sharded models only appear in the torchrun tests.
2. End-to-end tests run torchtitan's training jobs, all from the session's seed checkpoint, with 2-6
   steps, in one 2-rank torchrun launch, the 1-rank runs on its rank 0 (conftest's torchrun_jobs: a
   launch's start-up, most of a short run's time on 2 cores, is paid once).
3. Offload cannot move anything on a CPU-only machine: only its being a no-op there is tested.
"""

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from torchtitan.protocols.train_spec import get_train_spec

from conftest import CONFIG, REPO, build_model, check, job_logs, parse_config, read_checkpoint, scalars_by_step, torchrun_jobs
from fixtures.make_old_checkpoint import flat, step  # seeded gradients and an optimizer step; the weights as a vector
from plugin import config as grpo_config
from plugin.model.reference import load_reference_checkpoint, reference_entries

EXPORT_STEPS = 2
parse = parse_config


def build(*overrides, device="cpu"):
    """The GRPO model in this process, one rank (on the CPU unless `device` says otherwise)."""
    return build_model("--parallelism.tensor_parallel_degree", "1", *overrides, device=device)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (4, 16), generator=g), torch.randint(0, 2048, (4, 16), generator=g)


def state(module) -> dict[str, torch.Tensor]:
    """A (single-process) module's weights, cloned."""
    return {k: v.detach().clone() for k, v in get_model_state_dict(module).items()}


def reference_of(checkpoint: dict) -> dict[str, torch.Tensor]:
    return reference_entries(checkpoint["optimizer"])


def hf_export(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def hf_adapter(cfg):
    spec = get_train_spec(cfg.model.name)
    return spec.state_dict_adapter(spec.model_args[cfg.model.flavor], None)


def job(dump: Path, seed: Path, steps: int, *extra: str) -> list[str]:
    """A training job's arguments: the bundled config from `seed`'s weights, `steps` steps."""
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), *extra]


def launch(nproc: int, jobs: list[list[str]]) -> tuple:
    """The jobs one after another in one torchrun launch (a job may read what an earlier one saved): the
    launch, and rank 0's log of each job (torchtitan's logger writes to stdout)."""
    proc = torchrun_jobs(nproc, jobs)
    check(proc)
    logs = job_logs(proc)
    assert len(logs) == len(jobs), proc.stdout[-4000:]
    return proc, logs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--reference_model.checkpoint_path", "/nonexistent/step-9"],
         r"\[reference_model\] checkpoint_path = '/nonexistent/step-9' does not exist"),
        (["--reference_model.checkpoint_path", str(REPO / "plugin")],
         r"checkpoint_path = .* holds neither a DCP .metadata file nor \*.safetensors files"),
        (["--reference_model.checkpoint_path", str(REPO / "plugin/assets/tokenizer"), "--reference_model.checkpoint_format", "dcp"],
         r"has no .metadata file, as \[reference_model\] checkpoint_format = 'dcp' requires"),
    ],
)
def test_bad_reference_checkpoint_fails_at_start_up(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo_config.validate_job(parse(*overrides))


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(checkpoint_format="safetensors"), r"\[reference_model\] checkpoint_format = 'safetensors' is not one of"),
        (dict(sync_steps=4, sync_alpha=0.0),
         r"\[reference_model\] sync_alpha = 0.0 must be in \(0, 1\] when \[reference_model\] sync_steps = 4"),
        (dict(sync_steps=4, sync_alpha=1.5), r"\[reference_model\] sync_alpha = 1.5 must be in \(0, 1\]"),
        (dict(sync_steps=-1), r"\[reference_model\] sync_steps = -1 must be >= 0"),
    ],
)
def test_bad_reference_values_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        grpo_config.ReferenceModel(**values)


def test_sync_alpha_is_checked_only_with_sync():
    grpo_config.ReferenceModel(sync_alpha=0.0)


def test_auto_format_is_resolved_once_at_start_up(exports):
    cfg = parse("--reference_model.checkpoint_path", str(exports["hf"]))
    grpo_config.validate_job(cfg)
    assert cfg.reference_model.checkpoint_format == "hf"


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_beta_zero_builds_and_runs_no_reference():
    with_ref, *_ = build()
    without, *_ = build("--grpo.beta", "0")
    assert without.reference is None
    assert _param_bytes(with_ref.reference.module) == _param_bytes(with_ref) == _param_bytes(without) > 0
    tokens, labels = batch()
    for model, passes in ((with_ref, 1), (without, 0)):
        model(tokens, labels=labels)
        assert model.stats.sums["ref_passes"] == passes


def test_reference_logprobs_in_the_rollouts_replace_the_reference_pass():
    """Rollouts carrying the reference's log-probs: no reference pass runs, and the loss and its gradients are
    those of the pass that computes the same values."""
    from plugin.data.batch import Rollouts
    from plugin.scoring.loss import build_grpo_loss

    model, cfg, *_ = build("--grpo.entropy_coef", "0.01")
    loss_fn = build_grpo_loss(cfg)
    tokens, labels = batch()
    labels[:, :6] = -100
    model.reference.load_once(model, tokens.device)
    with torch.no_grad():  # a reference away from the policy, so KL and its gradient are not 0
        g = torch.Generator().manual_seed(1)
        for p in model.reference.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    stats = model.stats
    computed = model.reference.logprobs(model, tokens, labels, stats)

    def step(ref_logprobs):
        model.zero_grad(set_to_none=True)
        stats.reset()
        rollouts = Rollouts(torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([1.0, 0.0, 1.0, 0.0]),
                            torch.tensor([1.0, 0.5, 2.0, 1.0]), ref_logprobs=ref_logprobs)
        pred = model(tokens, labels=labels, rollouts=rollouts)
        loss = loss_fn(pred, labels)
        loss.backward()
        assert stats.device_sums[1] > 0  # the KL sum
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, stats.sums["ref_passes"]

    loss, grads, passes = step(None)
    given_loss, given_grads, given_passes = step(torch.where(labels == -100, 0.0, computed))
    assert (passes, given_passes) == (1, 0)
    assert stats.sums["ref_time"] == 0 and stats.peaks["ref_peak_mem"] == 0
    assert torch.equal(given_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(given_grads[name], grad, rtol=0, atol=0, msg=name)


def test_first_forward_loads_the_reference_also_without_its_pass():
    """A run whose first batches carry reference log-probs still starts the reference at the policy's weights."""
    from plugin.data.batch import Rollouts

    model, *_ = build()
    tokens, labels = batch()
    initial = flat(model)
    rollouts = Rollouts(torch.zeros(4), torch.zeros(4), torch.ones(4), ref_logprobs=torch.zeros(4, 16))
    model(tokens, labels=labels, rollouts=rollouts)
    assert model.reference.loaded and model.stats.sums["ref_passes"] == 0
    assert torch.equal(flat(model.reference.module), initial)


def test_reference_pass_computes_no_entropy():
    model, *_ = build()
    model.reference.load_once(model, torch.device("cpu"))
    tokens, labels = batch()
    logprobs = model.reference.module.logprobs(tokens, labels)
    assert not model.reference.module.scoring.with_entropy and logprobs.shape == labels.shape


def test_offload_is_a_noop_on_cpu():
    model, *_ = build("--reference_model.offload")
    assert model.reference.offload is False
    assert all(p.device.type == "cpu" for p in model.reference.module.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_reference_visits_cuda_only_for_its_pass():
    """[reference_model] offload on CUDA: the reference's weights rest in host memory, come to the GPU for its pass
    (which computes the log-probs of a reference that stays there) and leave it afterwards."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    kept, *_ = build(device=cuda)
    offloaded, *_ = build("--reference_model.offload", device=cuda)
    assert offloaded.reference.offload and not kept.reference.offload
    assert all(p.is_cuda for p in offloaded.parameters())  # the policy stays
    ref = offloaded.reference.module
    assert not any(p.is_cuda for p in ref.parameters())
    tokens, labels = (t.to(cuda) for t in batch())
    want = kept.reference.logprobs(kept, tokens, labels, kept.stats)
    for first in (True, False):  # the first pass also loads the policy's weights into the reference
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        got = offloaded.reference.logprobs(offloaded, tokens, labels, offloaded.stats)
        torch.cuda.synchronize()
        assert not any(p.is_cuda for p in ref.parameters()), first
        # only the output stays (a few blocks of 512 bytes): the 23.5 MiB of weights are gone again
        assert torch.cuda.memory_allocated() - before < 2**20, first
        assert torch.cuda.max_memory_allocated() - before >= _param_bytes(ref), first  # the weights came
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(flat(ref), flat(kept.reference.module.cpu()))


def test_sync_moves_reference_toward_policy_and_survives_resume():
    alpha = 0.3
    flags = ("--reference_model.sync_steps", "2", "--reference_model.sync_alpha", str(alpha))
    model, cfg, pd, spec = build(*flags)
    tokens, labels = batch()
    model(tokens, labels=labels)  # the first forward sets reference = policy
    with torch.no_grad():
        for p in model.reference.module.parameters():
            p.add_(torch.randn_like(p))  # so that a sync is not a copy
    container = spec.build_optimizers_fn([model], cfg.optimizer, pd)

    ref0 = flat(model.reference.module)
    step(container, model, 1)
    assert torch.equal(flat(model.reference.module), ref0)  # step 1: no sync
    step(container, model, 2)
    ref2 = flat(model.reference.module)
    torch.testing.assert_close(ref2, alpha * flat(model) + (1 - alpha) * ref0, rtol=1e-6, atol=1e-7)

    # resume at step 2: the step count comes back with the optimizer state, so the next sync is at step 4
    saved = copy.deepcopy(container.state_dict())
    resumed, *_ = build(*flags)
    resumed_container = spec.build_optimizers_fn([resumed], cfg.optimizer, pd)
    resumed.load_state_dict(get_model_state_dict(model))
    resumed_container.load_state_dict(saved)
    assert resumed_container.applied_steps == 2 and resumed.reference.loaded
    assert torch.equal(flat(resumed.reference.module), ref2)
    step(resumed_container, resumed, 3)
    assert torch.equal(flat(resumed.reference.module), ref2)
    step(resumed_container, resumed, 4)
    torch.testing.assert_close(flat(resumed.reference.module), alpha * flat(resumed) + (1 - alpha) * ref2, rtol=1e-6, atol=1e-7)


def test_the_reference_takes_the_policys_router_bias_with_its_weights():
    """An MoE router's expert_bias picks the experts: a policy loaded from a checkpoint trained with load balancing
    has one, and a reference set to (or synced toward) the policy without it routes otherwise."""
    model, cfg, pd, spec = build("--model.name", "grpo_qwen3", "--model.flavor", "debugmodel_moe_small",
                                 "--reference_model.sync_steps", "1", "--reference_model.sync_alpha", "0.5")
    bias = lambda m: {n: b.clone() for n, b in m.named_buffers() if n.endswith("expert_bias")}  # noqa: E731
    counts = lambda m: {n: b.clone() for n, b in m.named_buffers() if n.endswith("tokens_per_expert")}  # noqa: E731
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(len(n))))
    tokens, labels = batch()
    out = model(tokens, labels=labels)  # the first forward sets reference = policy
    assert bias(model.reference.module).keys() == bias(model).keys() and len(bias(model)) == 4
    for n, b in bias(model).items():
        assert torch.equal(bias(model.reference.module)[n], b), n
    # the same routing, so the same log-probs: the reference is the policy
    gap = (out.ref_logprobs - out.logprobs.detach()).abs().max().item()
    assert gap < 1e-5, gap  # seen: 9.5e-7; without the bias 6.2e-3
    # a sync mixes the bias as it mixes the weights; the reference's own expert counts stay its own
    ref_bias, ref_counts = bias(model.reference.module), counts(model.reference.module)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.add_(1.0)
    model.reference.sync(model, 0.5)
    for n, b in bias(model).items():
        torch.testing.assert_close(bias(model.reference.module)[n], 0.5 * b + 0.5 * ref_bias[n])
    assert all(torch.equal(counts(model.reference.module)[n], c) for n, c in ref_counts.items())


RESUME_STEPS, RESUME_AT = 6, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoint) -> dict:
    """Every end-to-end run, in one 2-rank launch, in this order (each job reads only what earlier ones saved):

    1. beta_zero, on rank 0 alone: [grpo] beta = 0, 2 steps (its log is checked: first in the launch, it runs in a
       fresh process, as in a launch of its own).
    2. export_hf: the policy after 2 steps (TP=2), exported model-only as HF safetensors.
    3. split: TP=2, the reference from that export, synced every 2 steps: the first 3 of 6 steps.
    4. straight: the same 6 steps in one go.
    5. export_dcp: the policy after 2 steps at FSDP=2, exported model-only as DCP; it also syncs its
       reference every step (FSDP's sharded parameters are updated in place).
    6. split's resume from its step-3 checkpoint, to match straight. Not right after split or straight:
       export_dcp, a different run, comes between, so that what they leave in the process could not pass
       for what the resume must restore.
    7. hf_initial, on rank 0 alone: 2 steps from the HF export's weights ([checkpoint] initial_load_in_hf).
    """
    names = ("beta_zero", "export_hf", "split", "straight", "export_dcp", "hf_initial")
    dumps = {name: tmp_path_factory.mktemp(name) for name in names}
    export_hf = dumps["export_hf"] / f"checkpoint/step-{EXPORT_STEPS}"
    export = ("--checkpoint.interval", "1000", "--checkpoint.last_save_model_only")
    resume = ("--checkpoint.interval", str(RESUME_AT), "--checkpoint.no-last-save-model-only",
              "--lr_scheduler.total_steps", str(RESUME_STEPS),  # the same LR schedule for the 3-step run
              "--reference_model.checkpoint_path", str(export_hf),
              "--reference_model.sync_steps", "2", "--reference_model.sync_alpha", "0.5")
    one_rank = ("--parallelism.tensor_parallel_degree", "1", "--checkpoint.no-last-save-model-only",
                "--checkpoint.interval", "1000")
    jobs = [
        {"argv": job(dumps["beta_zero"], seed_checkpoint, 2, "--grpo.beta", "0", *one_rank), "nproc": 1},
        job(dumps["export_hf"], seed_checkpoint, EXPORT_STEPS, *export, "--checkpoint.last_save_in_hf"),
        job(dumps["split"], seed_checkpoint, RESUME_AT, *resume),
        job(dumps["straight"], seed_checkpoint, RESUME_STEPS, *resume),
        job(dumps["export_dcp"], seed_checkpoint, EXPORT_STEPS, *export, "--parallelism.tensor_parallel_degree", "1",
            "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "8",
            "--reference_model.sync_steps", "1", "--reference_model.sync_alpha", "0.5"),
        job(dumps["split"], seed_checkpoint, RESUME_STEPS, *resume),
        {"argv": job(dumps["hf_initial"], export_hf, 2, "--checkpoint.initial_load_in_hf", *one_rank), "nproc": 1},
    ]
    proc, logs = launch(2, jobs)
    return {**dumps, "beta_zero_log": logs[0], "resume_log": logs[5], "stderr": proc.stderr}


@pytest.fixture(scope="module")
def exports(runs) -> dict[str, Path]:
    """The policy after 2 steps, exported model-only as DCP (FSDP=2) and as HF safetensors (TP=2)."""
    return {fmt: runs[f"export_{fmt}"] / f"checkpoint/step-{EXPORT_STEPS}" for fmt in ("dcp", "hf")}


def test_exports_hold_exactly_the_policy(exports, seed_checkpoint):
    policy_keys = set(read_checkpoint(seed_checkpoint))
    assert set(read_checkpoint(exports["dcp"])) == policy_keys
    assert set(hf_export(exports["hf"])) == set(hf_adapter(parse()).to_hf(read_checkpoint(seed_checkpoint)))
    assert grpo_config.reference_checkpoint_format(str(exports["dcp"])) == "dcp"
    assert grpo_config.reference_checkpoint_format(str(exports["hf"])) == "hf"


@pytest.mark.parametrize("fmt", ["dcp", "hf"])
def test_load_reference_checkpoint(exports, fmt):
    model, cfg, *_ = build()
    adapter = hf_adapter(cfg)
    load_reference_checkpoint(model.reference.module, str(exports[fmt]), fmt, adapter)
    expected = read_checkpoint(exports["dcp"]) if fmt == "dcp" else adapter.from_hf(hf_export(exports["hf"]))
    got = state(model.reference.module)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_reference_starts_from_hf_initial_weights(runs, exports):
    """[checkpoint] initial_load_in_hf: the policy and so the reference start from the HF weights."""
    dump = runs["hf_initial"]
    expected = hf_adapter(parse()).from_hf(hf_export(exports["hf"]))
    reference = reference_of(read_checkpoint(dump / "checkpoint/step-2"))
    assert set(reference) == set(expected)
    assert all(torch.equal(reference[k], v) for k, v in expected.items())
    assert scalars_by_step(dump)["grpo/kl"][1] == 0


def test_resume_continues_bitwise(runs):
    """TP=2, the reference from the HF export, synced every 2 steps: 6 steps straight, and 3 + resume + 3."""
    straight, split = (scalars_by_step(runs[k]) for k in ("straight", "split"))
    assert sorted(split["loss_metrics/global_avg_loss"]) == list(range(1, RESUME_STEPS + 1))
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/kl"):
        assert split[tag] == straight[tag], tag
    assert straight["grpo/kl"][1] > 0  # the reference came from checkpoint_path, not the policy

    end = {k: read_checkpoint(runs[k] / f"checkpoint/step-{RESUME_STEPS}") for k in ("straight", "split")}
    ref_straight, ref_split = reference_of(end["straight"]), reference_of(end["split"])
    assert ref_straight and set(ref_straight) == set(ref_split)
    assert all(torch.equal(v, ref_split[k]) for k, v in ref_straight.items())
    # the resume restored the saved (synced) reference instead of reloading checkpoint_path
    log = runs["resume_log"]
    assert "Reference model restored from the checkpoint" in log and "loaded from [reference_model]" not in log
    # stderr is the whole launch's: the check holds for every job there
    assert "loaded from [reference_model]" not in runs["stderr"]


def test_beta_zero_run_has_no_reference(runs):
    dump, log = runs["beta_zero"], runs["beta_zero_log"]
    assert "[grpo] beta = 0: no reference model is built" in log and "Reference model" not in log
    assert "dp_shard=1, cp=1, tp=1," in log  # on 1 rank of the 2-rank launch, it saw a world of 1 (FSDP=2 otherwise)
    assert "Reference model" not in runs["stderr"]  # the whole launch's stderr: no job writes it there
    tags = scalars_by_step(dump)
    assert "loss_metrics/global_avg_loss" in tags
    assert not [t for t in tags if t.startswith("grpo/ref_")]
    assert not reference_of(read_checkpoint(dump / "checkpoint/step-2"))
