"""Mixture-of-experts policies: qwen3's MoE flavors on CPU (plugin.cpu's two patches), expert parallelism
from TOML, and the same training on every layout.

Simplifications:
1. The runs use grpo_qwen3's `debugmodel_moe_small` (plugin.model.qwen3): torchtitan's `debugmodel_moe`
   router and grouped experts at 8 experts, top 2.
2. Every run starts from the same seed checkpoint on the same global batch of 16 completions.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import plugin  # noqa: F401  (registers grpo_qwen3 and patches torchtitan for the CPU)
from conftest import parse_config, run, scalars, train_runs
from plugin.model.moe import moe_layers

MOE = ["--model.name", "grpo_qwen3", "--model.flavor", "debugmodel_moe_small"]
STEPS = 3
RTOL = 1e-4  # fp32: FSDP and EP only move tokens and reorder reductions
KL_RTOL = 1e-3
ONLINE_ON = ["--online.enable", "--online.reward_funcs", "plugin.example:arith_reward"]
HALF = ["--training.local_batch_size", "8"]  # 2 data-parallel ranks: 8 completions each
NO_TP = ["--parallelism.tensor_parallel_degree", "1"]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
LAYOUTS = {
    "single": (1, NO_TP),
    "compiled": (1, [*NO_TP, "--compile.enable", "--reference_model.compile"]),
    # the log-prob paths: the default fused pass in 32-token chunks, and log-probs to the loss in chunks
    "chunked": (1, [*NO_TP, "--grpo.logprob_chunk_tokens", "32"]),
    "unfused_chunked": (1, [*NO_TP, "--grpo.logprob_chunk_tokens", "32", "--grpo.no_fused_policy_pass"]),
    "fsdp2": (2, [*NO_TP, *FSDP2, *HALF]),
    "fsdp2_ep2": (2, [*NO_TP, *FSDP2, *EP2, *HALF]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    # EP carved out of FSDP x TP (expert_tensor_parallel_degree 1: the experts are whole on each EP rank)
    "tp2_fsdp2_ep2": (4, ["--parallelism.tensor_parallel_degree", "2", *FSDP2, *EP2, *HALF]),
}
# online_cpu.toml: 4 prompts x 8 completions a step, over the data-parallel ranks; torchtitan's load-balancing bias on
# (its 1e-3 moves nothing in 2 steps of a near-uniform router; 1e-2 moves it)
# Both also replay the sampler's routing (R3); R2, on 1 rank, trains on each batch twice (num_iterations 2), routed as
# its old-log-prob pass was
BIAS_RATE = 0.01
ONLINE = {name: (n, [*extra, "--moe.router_bias_update_rate", str(BIAS_RATE), "--moe.router_replay", "R3"])
          for name, (n, extra) in
          {"single": (1, NO_TP), "fsdp2_ep2": (2, [*NO_TP, *FSDP2, *EP2, "--training.local_batch_size", "16"]),
           "tp2": (2, []),  # online_cpu.toml's TP=2
           "tp2_fsdp2_ep2": (4, [*FSDP2, *EP2, "--training.local_batch_size", "16"])}.items()}
ONLINE["r2"] = (1, [*NO_TP, "--moe.router_replay", "R2", "--online.num_iterations", "2"])
# a run stopped at step 3, inside its second batch's replay (num_iterations 2), and resumed: R3's routing is in the
# saved batch, the load-balancing bias in the model's state
RESUME = [*NO_TP, "--online.num_iterations", "2", "--moe.router_replay", "R3", "--moe.router_bias_update_rate",
          str(BIAS_RATE), "--online.reward_funcs", "reward_fns:even_ids", "--lr_scheduler.total_steps", "4"]
# the GPU config's twin (FSDP=2 x EP=2, compile, bf16, full activation checkpointing, R3), against itself without
# compile and checkpointing; a reward that a random policy's completions spread (even token ids)
TWIN = "train_configs/moe_twin_cpu.toml"
TWIN_REWARD = ["--online.reward_funcs", "reward_fns:even_ids"]
TWIN_PLAIN = ["--compile.no-enable", "--reference_model.no-compile", "--activation_checkpoint.mode", "none"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, seed_checkpoints):
    """Every layout from rollouts, online sampling on 1 rank and on FSDP=2 x EP=2, the GPU config's twin: 3 launches
    (1, 2, 4 ranks)."""
    seed = seed_checkpoints["grpo_qwen3_moe"]
    runs = {name: run(seed, n, *MOE, *extra, steps=STEPS) for name, (n, extra) in LAYOUTS.items()}
    for name, (n, extra) in ONLINE.items():
        runs[f"online_{name}"] = run(seed, n, *MOE, *extra, steps=2, config="train_configs/online_cpu.toml")
    runs["twin"] = run(seed, 2, *TWIN_REWARD, steps=STEPS, config=TWIN)
    runs["twin_plain"] = run(seed, 2, *TWIN_REWARD, *TWIN_PLAIN, steps=STEPS, config=TWIN)
    online = "train_configs/online_cpu.toml"
    runs["resume_straight"] = run(seed, 1, *MOE, *RESUME, steps=4, config=online)
    runs["resume_split"] = run(seed, 1, *MOE, *RESUME, steps=3, config=online)
    resumes = {"resume_split": run(seed, 1, *MOE, *RESUME, steps=4, config=online)}
    dumps = train_runs(tmp_path_factory, runs, resumes)
    return {name: scalars(dump) for name, dump in dumps.items()}


TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "grpo/entropy")


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_ep2"])
def test_fsdp_and_expert_parallel_train_as_one_rank(runs, name):
    single, other = runs["single"], runs[name]
    assert len(single["loss_metrics/global_avg_loss"]) == STEPS
    for tag in TAGS:
        assert other[tag] == pytest.approx(single[tag], rel=RTOL), tag
    assert other["grpo/kl"][0] == single["grpo/kl"][0] == 0
    # as for the dense layouts (test_gpu_twin): the KL after Adam's first step is small (2.2e-4) and made of
    # updates m / sqrt(v) of gradients that differ at 4e-5 (seen: 1.25e-4 relative on fsdp2, 1e-5 on fsdp2_ep2)
    assert other["grpo/kl"][1:] == pytest.approx(single["grpo/kl"][1:], rel=KL_RTOL)


# Under TP the attention output is summed across ranks in another order, and the router of a randomly initialised
# model scores its 8 experts nearly alike (softmax of gates near 0): a few near-tie tokens pick another expert, which
# moves the small KL (seen: 1.4e-3 relative at step 2, 3e-3 at step 3, on tp2 and on TP x FSDP x EP; with the experts'
# grouped matmuls in fp32 as well; 6.8e-3 for the compiled run below), while losses, grad norms and entropies stay
# within 1e-4 (seen: 6e-5).
TP_KL_RTOL = 2e-2


@pytest.mark.parametrize("name", ["tp2", "tp2_fsdp2_ep2"])
def test_tensor_parallel_layouts_train_as_one_rank(runs, name):
    single, other = runs["single"], runs[name]
    for tag in TAGS:
        assert other[tag] == pytest.approx(single[tag], rel=RTOL), tag
    assert other["grpo/kl"][1:] == pytest.approx(single["grpo/kl"][1:], rel=TP_KL_RTOL)


# inductor fuses and reorders the fp32 math before the experts' bf16 cast (torchtitan's grouped matmuls), so a few
# inputs round to another bf16 value: seen 1.4e-4 relative on step 3's loss (dense compiled runs agree to 1e-4)
COMPILED_TOL = {"loss_metrics/global_avg_loss": 1e-3, "grad_norm": 1e-3, "grpo/entropy": 1e-4, "grpo/kl": TP_KL_RTOL}


def test_compiled_run_trains_as_the_eager_one(runs):
    """Compiled blocks (torchtitan compiles an MoE block's attention and experts one by one), loss and reference."""
    single, compiled = runs["single"], runs["compiled"]
    for tag, rel in COMPILED_TOL.items():
        print(tag, [f"{abs(a - b) / max(abs(b), 1e-30):.1e}" for a, b in zip(compiled[tag], single[tag])])
        assert len(compiled[tag]) == STEPS
        assert compiled[tag] == pytest.approx(single[tag], rel=rel, abs=1e-12), tag


@pytest.mark.parametrize("name", ["chunked", "unfused_chunked"])
def test_the_log_prob_paths_train_as_one_pass(runs, name):
    """The fused pass in chunks, and log-probs to the loss in chunks (recomputed in backward), against the fused pass
    over the whole batch: the same MoE training in fp32."""
    single, other = runs["single"], runs[name]
    # (moe/load_max is left out: a near-tie token that changes expert moves an integer count, seen 2% at step 3)
    for tag, rel in {**COMPILED_TOL, "moe/router_entropy": 1e-4}.items():
        print(name, tag, [f"{abs(a - b) / max(abs(b), 1e-30):.1e}" for a, b in zip(other[tag], single[tag])])
        # step 1: the same weights, chunks only reorder sums; later steps as the compiled run (near-tie routing)
        assert other[tag][0] == pytest.approx(single[tag][0], rel=RTOL, abs=1e-12), tag
        assert other[tag] == pytest.approx(single[tag], rel=rel, abs=1e-12), tag


@pytest.mark.parametrize("name", ["single", "fsdp2_ep2", "tp2", "tp2_fsdp2_ep2"])
def test_the_sampler_generates_with_the_trainers_routing(runs, name):
    """Online, with a load-balancing bias that the first step moved: the sampler's log-probs of what it drew are the
    trainer's (the same experts chosen, by the same biased rule), on 1 rank and EP; its moe/sampler_* are recorded
    apart from the policy's, over nearly the same tokens (the prompt and completion, less the last draw)."""
    tb = runs[f"online_{name}"]
    assert len(tb["online/logprob_mismatch"]) == 2
    assert max(tb["online/logprob_mismatch"]) < 1e-5  # seen: 1.5e-7 on FSDP=2 x EP=2
    assert min(tb["online/completion_length_mean"]) > 0
    assert 0 < tb["moe/expert_bias_max_abs"][0] <= 2 * BIAS_RATE
    assert tb["moe/sampler_router_entropy"] == pytest.approx(tb["moe/router_entropy"], rel=1e-3)  # seen 4e-5
    for side in ("", "sampler_"):
        assert all(0 < h < math.log(8) for h in tb[f"moe/{side}router_entropy"])
        assert all(a >= 1 >= b >= 0 for a, b in zip(tb[f"moe/{side}load_max"], tb[f"moe/{side}load_min"]))


def test_the_load_balancing_bias_and_routing_metrics_are_global(runs):
    """FSDP=2 x EP=2 sums the routing counts of its data-parallel ranks before the bias moves and before moe/* are
    logged: the same bias and metrics as 1 rank, which drew the same completions; without a rate, no bias is logged.
    Under R3 both replay the sampler's routing, which their routers would have chosen themselves (fp32, one set of
    weights): agreement 1."""
    single, ep = runs["online_single"], runs["online_fsdp2_ep2"]
    for tag in ("moe/expert_bias_max_abs", "moe/load_max", "moe/load_min", "moe/sampler_load_max",
                "moe/sampler_load_min", "moe/routing_agreement"):
        assert ep[tag] == pytest.approx(single[tag], rel=1e-6), tag
    assert ep["moe/router_entropy"] == pytest.approx(single["moe/router_entropy"], rel=1e-5)
    for name in ("fsdp2", "fsdp2_ep2"):  # from rollouts, no rate
        assert runs[name]["moe/load_max"] == pytest.approx(runs["single"]["moe/load_max"], rel=1e-6)
    assert "moe/expert_bias_max_abs" not in runs["single"] and "moe/routing_agreement" not in runs["single"]
    assert single["moe/routing_agreement"] == [1.0, 1.0]
    assert ep["loss_metrics/global_avg_loss"] == pytest.approx(single["loss_metrics/global_avg_loss"], rel=RTOL)


# bf16 with compile and activation checkpointing against bf16 eager (test_gpu_twin's tolerances: step 1 the same
# weights and draws; later steps follow slightly different updates)
STEP1_RTOL = 1e-3
LATER_TOL = {"loss_metrics/global_avg_loss": dict(abs=5e-3), "grad_norm": dict(rel=0.03), "grpo/entropy": dict(rel=0.06)}


def test_the_gpu_configs_twin_trains_as_its_plain_run(runs):
    """train_configs/moe_twin_cpu.toml (qwen3_30b_a3b_gpu.toml's shape) trains as the same run without compile and
    activation checkpointing; R3's replay agrees with the sampler on almost every slot in bf16."""
    twin, plain = runs["twin"], runs["twin_plain"]
    assert max(plain["grpo/reward_std"]) > 0  # advantages, so gradients, to compare
    for tag, tol in LATER_TOL.items():
        print(tag, [f"{abs(a - b) / max(abs(b), 1e-30):.1e}" for a, b in zip(twin[tag], plain[tag])])
        assert len(twin[tag]) == STEPS, tag
        assert twin[tag][0] == pytest.approx(plain[tag][0], rel=STEP1_RTOL, abs=1e-12), tag
        assert twin[tag][1:] == pytest.approx(plain[tag][1:], **tol), tag
    for tb in (twin, plain):
        # bf16: the sampler's decode steps and the trainer's pass round differently, and a few near-tie slots flip
        assert all(0.99 < a <= 1 for a in tb["moe/routing_agreement"])
        assert max(tb["online/logprob_mismatch"]) < 5e-3  # bf16's; seen 9e-4


def test_twin_config_is_the_moe_gpu_config_in_miniature(monkeypatch):
    """The twin changes sizes, the data and the step count, never a parallelism or numerics setting, and the GPU
    config passes the start-up checks on its 8 ranks (EP=8 carved from FSDP=8, 128 experts)."""
    import tomllib

    from conftest import REPO
    from plugin import config as grpo_config

    gpu_path = "train_configs/qwen3_30b_a3b_gpu.toml"
    gpu, twin = (tomllib.loads((REPO / path).read_text()) for path in (gpu_path, TWIN))
    same = {
        "training": ("mixed_precision_param", "mixed_precision_reduce", "max_norm"),
        "parallelism": ("tensor_parallel_degree", "data_parallel_shard_degree", "expert_tensor_parallel_degree"),
        "compile": ("enable", "components"),
        "activation_checkpoint": ("mode",),
        "grpo": ("beta", "clip_low", "clip_high", "kl_estimator", "temperature"),
        "moe": ("router_replay", "router_bias_update_rate"),
        "online": ("enable", "num_generations"),
        "reference_model": ("compile",),
    }
    for section, keys in same.items():
        for key in keys:
            assert twin[section][key] == gpu[section][key], f"[{section}] {key}"
    assert twin["model"]["name"] == gpu["model"]["name"] and gpu["model"]["flavor"] == "30B-A3B"
    assert twin["parallelism"]["expert_parallel_degree"] > 1 and gpu["parallelism"]["expert_parallel_degree"] == 8
    monkeypatch.setenv("WORLD_SIZE", "8")
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--job.config_file", str(REPO / gpu_path)])
    assert (cfg.model.flavor, cfg.parallelism.expert_parallel_degree, cfg.moe.router_replay) == ("30B-A3B", 8, "R3")
    grpo_config.validate_job(cfg)


def test_resume_mid_replay_is_bitwise(runs):
    """Stopped after step 3 (batch 2's first pass; its replay, step 4, pending) and resumed from that checkpoint:
    every step's figures equal the straight run's, bit for bit."""
    straight, split = runs["resume_straight"], runs["resume_split"]
    assert len(straight["loss_metrics/global_avg_loss"]) == len(split["loss_metrics/global_avg_loss"]) == 4
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/kl", "moe/expert_bias_max_abs",
                "moe/routing_agreement", "moe/load_max", "moe/router_entropy"):
        assert split[tag] == straight[tag], tag
    # something to differ in: the replay step trains (seen loss -5.4e-3), its router disagrees with the sampler's
    assert straight["loss_metrics/global_avg_loss"][3] != 0 and straight["moe/routing_agreement"][3] < 1


def test_r2_replays_the_old_log_prob_pass_routing(runs):
    """R2 with num_iterations 2: both passes over a batch route as its old-log-prob pass did. The first pass has
    the old pass's weights, so its router agrees everywhere; the second follows an update."""
    tb = runs["online_r2"]
    assert len(tb["moe/routing_agreement"]) == 2
    assert tb["moe/routing_agreement"][0] == 1.0 and 0.5 < tb["moe/routing_agreement"][1] <= 1.0
    assert all(math.isfinite(x) for x in tb["loss_metrics/global_avg_loss"])



def test_integer_histc_on_cpu_counts_as_cuda_does():
    """torch.histc on integer expert ids (torchtitan's router and reorderer): CPU refuses them without plugin.cpu."""
    from plugin import cpu

    assert cpu.is_active() and torch.histc is cpu._histc_integers
    ids = torch.tensor([[3, 0], [3, 7], [1, 3]])
    counts = torch.histc(ids.view(-1), bins=8, min=0, max=8)
    assert counts.dtype == torch.int64
    assert counts.tolist() == torch.bincount(ids.view(-1), minlength=8).tolist() == [1, 1, 0, 3, 0, 0, 0, 1]
    x = torch.tensor([0.5, 1.5, 1.7, 9.0])
    assert torch.equal(torch.histc(x, bins=2, min=0, max=2), cpu._histc(x, bins=2, min=0, max=2))
    with pytest.raises(RuntimeError, match="histogram_cpu"):
        cpu._histc(ids.view(-1), bins=8, min=0, max=8)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "for_loop"])
def test_moe_layer_on_cpu_is_its_experts_weighted_by_the_router(grouped):
    """torchtitan's MoE layer on CPU (both expert paths, the grouped one through torchtitan's CPU permutation):
    each token's output is the sum of its top-k experts' SwiGLU outputs, weighted by the renormalised softmax scores;
    gradients reach the router and every chosen expert."""
    import dataclasses

    from torchtitan.models.moe import MoE
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec("grpo_qwen3").model_args["debugmodel_moe_small"]
    moe_args = dataclasses.replace(args.moe_args, use_grouped_mm=grouped, load_balance_coeff=None)
    torch.manual_seed(0)
    layer = MoE(moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim)
    with torch.no_grad():
        layer.init_weights(0.02, torch.device("cpu"))
    x = torch.randn(2, 5, args.dim)
    out = layer(x)

    tokens = x.view(-1, args.dim)
    scores = F.softmax(layer.router.gate(tokens).float(), dim=-1)
    top, experts = scores.topk(moe_args.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    e = layer.experts
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for k in range(moe_args.top_k):
            i = experts[t, k]
            h = F.silu(tokens[t] @ e.w1[i].T) * (tokens[t] @ e.w3[i].T)
            expected[t] += top[t, k] * (h @ e.w2[i].T)
    # the grouped path computes the experts in bf16 (torchtitan's _run_experts_grouped_mm), the for-loop one in fp32
    tol = dict(rtol=2e-2, atol=2e-3) if grouped else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.view(-1, args.dim), expected, **tol)
    out.square().sum().backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0
    chosen = experts.unique()
    assert (e.w1.grad[chosen].flatten(1).abs().sum(-1) > 0).all()


def test_routing_counts_the_recorded_passes_and_its_bias_moves_toward_an_even_load():
    """plugin.model.moe.Routing on the policy: moe/* from the passes it records only (policy and sampler apart), the
    counts torchtitan's router makes; torchtitan's bias update from the policy's counts, after applied steps only,
    and never in the reference."""
    from conftest import build_model

    rate = 0.01
    model, *_ = build_model(*MOE, "--moe.router_bias_update_rate", str(rate))
    routing = model.routing
    assert len(routing.layers) == model.model_args.n_layers and routing.num_experts == 8
    seen = []  # (layer input, torchtitan's counts) of each router call, hooked after the Routing's
    for moe in routing.layers:
        moe.router.register_forward_hook(lambda m, args, out: seen.append((args[0].detach(), out[2].float())))
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens)  # as evaluation: not recorded
    assert routing.take(None) == {"moe/expert_bias_max_abs": 0.0}

    def expected(calls):
        counts = torch.stack([c for _, c in calls])
        load = counts / counts.mean(-1, keepdim=True)
        h = torch.cat([-(F.softmax(s, -1) * F.log_softmax(s, -1)).sum(-1) for s in
                       (m.router.gate(x).float() for m, (x, _) in zip(routing.layers, calls))])
        return counts, load.max(-1).values.mean().item(), load.min(-1).values.mean().item(), h.mean().item()

    seen.clear()
    with routing.record("sampler"), torch.no_grad():
        model(tokens[:1])
    sampler = expected(seen)
    seen.clear()
    with routing.record("policy"):
        model(tokens)
    counts, load_max, load_min, entropy = expected(seen)
    assert counts.sum(-1).tolist() == [tokens.numel() * 2] * len(routing.layers)  # top 2 of 8 per token
    metrics = routing.take(None)
    assert metrics["moe/load_max"] == pytest.approx(load_max) and metrics["moe/load_min"] == pytest.approx(load_min)
    assert metrics["moe/router_entropy"] == pytest.approx(entropy, rel=1e-6)
    assert 0 < entropy < math.log(8)
    assert metrics["moe/sampler_load_max"] == pytest.approx(sampler[1])
    assert metrics["moe/sampler_router_entropy"] == pytest.approx(sampler[3], rel=1e-6)

    routing.after_step(applied=False, group=None)  # a refused step drops its counts and moves nothing
    assert all(m.expert_bias.abs().max() == 0 for m in routing.layers)
    with routing.record("policy"):
        model(tokens)
    routing.after_step(applied=True, group=None)
    delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
    delta -= delta.mean(-1, keepdim=True)
    for moe, d in zip(routing.layers, delta):
        torch.testing.assert_close(moe.expert_bias, d, rtol=0, atol=1e-9)
    assert routing.take(None)["moe/expert_bias_max_abs"] == pytest.approx(delta.abs().max().item())
    assert all(m.expert_bias.abs().max() == 0 for m in moe_layers(model.reference.module))  # its routing never moves


class _OneToolTurn:
    """After a row's first turn (a stop id), append two ids and let it go on once: the sampler's resume path."""

    def resume(self, rows, completions, room):
        return [[5, 6] if sum(c.count(s) for s in self.stops) < 2 else None for c in completions]


def _trainer_rows(prompts, samples, layers):
    """The training rows of the sampled sequences, right-padded: inputs, labels, the sampler's log-probs on the
    labels and its captured routing as Collate lays them out."""
    seqs = [p + c for p, c in zip(prompts, samples.completions)]
    B, T = len(seqs), max(map(len, seqs)) - 1
    inputs, labels = torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -100)
    sampler_lp, routed = torch.full((B, T), math.nan), torch.full((B, T, layers, 2), -1, dtype=torch.int16)
    for b, (p, q) in enumerate(zip(prompts, seqs)):
        n = len(q) - 1
        inputs[b, :n], labels[b, len(p) - 1:n] = torch.tensor(q[:-1]), torch.tensor(q[len(p):])
        sampler_lp[b, len(p) - 1:n] = torch.tensor(samples.logprobs[b])
        assert samples.routed_experts[b].shape == (n, layers, 2) and (samples.routed_experts[b] >= 0).all()
        routed[b, :n] = torch.from_numpy(samples.routed_experts[b])
    return inputs, labels, sampler_lp, routed


def test_replay_routes_the_trainer_as_the_sampler_did_where_their_routers_disagree():
    """R3 on a constructed near-tie router: the sampler routes with a small expert bias that the trainer lacks (as
    another engine's numerics would), so the two pick different experts for many tokens. Without replay the
    trainer's log-probs of the sampled tokens miss the sampler's; replaying the sampler's captured routing (the
    trainer's own scores as gate weights) gives them back to fp32 rounding. The cached sampler, the no-cache oracle
    and a resumed tool turn capture the same routing, and so does a row that joins its prompt's entry in the engine's
    cache while a member decodes (its prompt routed by the member's prefill)."""
    from conftest import build_model
    from plugin.generation.engine import build_sampler

    model, *_ = build_model(*MOE, "--training.seq_len", "32")
    routing = model.routing
    layers = len(routing.layers)
    with torch.no_grad():
        for moe in routing.layers:
            moe.router.gate.weight.mul_(0.01)  # the 8 experts' scores within ~1e-4 of each other
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (5, 9, 7)]
    prompts.append(prompts[1])  # a group of two

    def sample(kv_cache, stops=(), turns=None, bias=2e-3, rows=(0, 1, 2, 3), **options):
        with torch.no_grad():
            for moe in routing.layers:
                moe.expert_bias.copy_(torch.linspace(0, bias, 8))
        sampler = build_sampler(model, kv_cache=kv_cache, max_new_tokens=12, stop_ids=list(stops), temperature=1.0,
                                pad_id=0, **options)
        try:
            with routing.capturing_samples():
                return sampler.generate([prompts[b] for b in rows], [11 + b for b in rows], turns)
        finally:
            with torch.no_grad():
                for moe in routing.layers:
                    moe.expert_bias.zero_()

    cached = sample(kv_cache=True)
    oracle = sample(kv_cache=False)
    assert cached.completions == oracle.completions
    for a, b in zip(cached.routed_experts, oracle.routed_experts):
        assert (a == b).all()
    stops = [cached.completions[1][4]]
    turns = _OneToolTurn()
    turns.stops = stops
    resumed = [sample(True, stops, turns), sample(False, stops, turns)]
    assert any(m.count(0) for m in resumed[0].tool_mask)  # a tool turn was appended and decoded after
    assert resumed[0].completions == resumed[1].completions
    for a, b in zip(*(r.routed_experts for r in resumed)):
        assert (a == b).all()
    assert sample(True, bias=0).routed_experts[0].tolist() != cached.routed_experts[0].tolist()
    # 2 slots over rows 0, 1, 3: row 0 stops within 4 tokens, and at the check after 8 row 3 takes its slot and
    # reads the prompt entry of row 1 (the same prompt), which decodes on
    stop = next(t for t in cached.completions[0][:4] if t not in cached.completions[1][:10])
    joined = [sample(kv_cache, [stop], rows=(0, 1, 3), max_num_seqs=2 if kv_cache else 0) for kv_cache in (True, False)]
    assert joined[0].completions == joined[1].completions and len(joined[0].completions[1]) > 8
    for a, b in zip(*(r.routed_experts for r in joined)):
        assert (a == b).all()

    inputs, labels, sampler_lp, routed = _trainer_rows(prompts, cached, layers)
    mask = labels != -100
    with torch.no_grad():
        own = model.logprobs(inputs, labels)
        with routing.replaying(routed):
            replayed = model.logprobs(inputs, labels)
    assert (own - sampler_lp)[mask].abs().max() > 1e-3  # seen 5.5e-3
    torch.testing.assert_close(replayed[mask], sampler_lp[mask], rtol=0, atol=1e-5)  # seen 9.5e-7
    agreement = routing.take(None)["moe/routing_agreement"]
    assert 0 < agreement < 0.9  # seen 0.29: the trainer's router picks few of the sampler's experts itself


def test_replayed_gate_weights_keep_the_routers_gradient():
    """A replayed pass routes to the experts given, weighted by the router's own renormalised softmax of them:
    the router's gate gets a gradient, and the output is the layer's under the same choice."""
    from conftest import build_model

    model, *_ = build_model(*MOE)
    routing = model.routing
    tokens = torch.randint(3, 2000, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    own = torch.full((*tokens.shape, len(routing.layers), 2), -1, dtype=torch.int16)
    with torch.no_grad(), routing.capturing(*tokens.shape, tokens.device) as kept:
        kept.at(None, None)
        plain = model.logprobs(tokens, labels)
    with torch.no_grad(), routing.replaying(own):  # -1 everywhere: the router's own choice
        torch.testing.assert_close(model.logprobs(tokens, labels), plain, rtol=0, atol=0)
    with torch.no_grad():
        logits = model(tokens)
    with routing.replaying(kept.experts):  # the captured choice replayed: the same pass, differentiable
        out = model(tokens)
        out.square().mean().backward()
    torch.testing.assert_close(out.detach(), logits, rtol=0, atol=1e-6)
    assert all(m.router.gate.weight.grad.abs().sum() > 0 for m in routing.layers)
    assert routing.take(None)["moe/routing_agreement"] == 1.0
    shifted = (kept.experts + 1) % 8  # other experts: other outputs
    with torch.no_grad(), routing.replaying(shifted):
        assert (model.logprobs(tokens, labels) - plain).abs().max() > 1e-4


def test_replay_holds_through_activation_checkpointings_recompute():
    """A replayed training pass under full activation checkpointing: the backward runs each block's forward again,
    and that recompute must route as the forward did (verl's REPLAY_BACKWARD). Its gradients equal those of the
    same pass without checkpointing, on experts the router would not pick itself."""
    from conftest import build_model

    grads = {}
    for mode in ("none", "full"):
        model, *_ = build_model(*MOE, "--activation_checkpoint.mode", mode)
        routing = model.routing
        tokens = torch.randint(3, 2000, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), routing.capturing(*tokens.shape, tokens.device) as kept:
            kept.at(None, None)
            model(tokens)
        routing.replay_through_backward((kept.experts + 3) % 8)  # other experts than its own
        model(tokens).square().mean().backward()
        routing.after_step(applied=True, group=None)  # the step ends the replay
        assert routing._replayed is None
        grads[mode] = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                       for n, p in model.named_parameters() if p.grad is not None}
    assert grads["none"].keys() == grads["full"].keys()
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_the_samplers_routing_travels_with_the_batch_and_its_checkpoint(padding_free):
    """Collate lays each completion's routing out as its input tokens (padded rows, or one padding-free row), -1
    elsewhere; the rollouts keep it through a mid-replay data checkpoint (pickled), and an older checkpoint's
    rollouts load without it."""
    import dataclasses
    import pickle

    import numpy as np

    from plugin.config import GRPO
    from plugin.data.batch import Collate, Rollouts
    from plugin.data.rollouts import Completion

    rng = np.random.default_rng(0)
    completions = []
    for prompt_len, total in ((3, 7), (4, 6)):
        completions.append(Completion(list(range(3, 3 + total)), prompt_len, 1.0, [-0.5] * (total - prompt_len),
                                      routed_experts=rng.integers(0, 8, (total - 1, 2, 2)).astype(np.int16)))
    collate = Collate(16, 0, dataclasses.replace(GRPO(), padding_free=padding_free), 2, sampled=True)
    inputs, _ = collate(torch.tensor([1.0, 0.0]), torch.tensor([4, 2]), [0, 1], completions)
    routed = inputs["rollouts"].routed_experts
    assert routed.shape == (*inputs["input"].shape, 2, 2) and routed.dtype == torch.int16
    flat, start = routed.view(-1, 2, 2), 0
    for b, c in enumerate(completions):
        n = len(c.tokens) - 1
        if not padding_free:
            start = b * 16
        assert torch.equal(flat[start:start + n], torch.from_numpy(c.routed_experts))
        start += n
    assert (flat >= 0).sum() == sum(c.routed_experts.size for c in completions)  # -1 everywhere else
    back = pickle.loads(pickle.dumps(inputs["rollouts"]))
    assert torch.equal(back.routed_experts, routed)
    old = Rollouts(torch.zeros(1), torch.zeros(1), torch.ones(1))
    state = old.__reduce_ex__(2)[2]
    del state[1]["routed_experts"]
    fresh = Rollouts.__new__(Rollouts)
    fresh.__setstate__(state)
    assert fresh.routed_experts is None


def test_moe_small_flavor_is_debugmodel_moe_smaller():
    from torchtitan.protocols.train_spec import get_train_spec

    flavors = get_train_spec("grpo_qwen3").model_args
    small, full = flavors["debugmodel_moe_small"], flavors["debugmodel_moe"]
    assert small.moe_enabled and (small.moe_args.num_experts, small.moe_args.top_k) == (8, 2)
    for key in ("score_func", "route_norm", "route_scale", "score_before_experts", "num_shared_experts",
                "use_grouped_mm", "load_balance_coeff"):
        assert getattr(small.moe_args, key) == getattr(full.moe_args, key), key
    assert full.moe_args.num_experts == 64  # torchtitan's own flavor is left as it is
    assert small.head_dim * small.n_heads != small.dim and small.qk_norm


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--parallelism.expert_parallel_degree", "2"],
         r"expert_parallel_degree = 2 needs a mixture-of-experts flavor: \[model\] grpo_llama3 flavor 'debugmodel'"),
        ([*MOE, "--parallelism.expert_parallel_degree", "3"],
         r"expert_parallel_degree = 3 must divide the 8 experts"),
        ([*MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
          "--parallelism.expert_tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
         r"expert_parallel_degree = 2 must divide data_parallel_shard_degree \(1\)"),
        ([*MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
          "--parallelism.expert_tensor_parallel_degree", "4"],
         r"expert_tensor_parallel_degree = 4 .* torchtitan takes 1 or tensor_parallel_degree \(2\)"),
        (["--moe.router_bias_update_rate", "0.001"],
         r"\[moe\] router_bias_update_rate = 0.001 needs a mixture-of-experts flavor: \[model\] grpo_llama3"),
        (["--moe.router_replay", "R3"], r'\[moe\] router_replay = "R3" needs a mixture-of-experts flavor'),
        ([*MOE, "--moe.router_replay", "R3"], r'router_replay = "R3" replays the routing of online batches: set '
                                              r"\[online\] enable = true"),
        ([*MOE, *ONLINE_ON, "--moe.router_replay", "R3", "--online.compile_decode"],
         r"set \[online\] compile_decode = false"),
        ([*MOE, *ONLINE_ON, "--moe.router_replay", "R2"], r"with \[online\] num_iterations > 1 \(now 1\)"),
        ([*MOE, *ONLINE_ON, "--moe.router_replay", "R2", "--online.num_iterations", "2", "--online.behavior_logprobs",
          "sampler"], r'behavior_logprobs = "policy" \(now "sampler"\)'),
    ],
)
def test_expert_parallel_degrees_torchtitan_cannot_carve_name_the_key(overrides, message):
    from plugin import config as grpo_config

    with pytest.raises(ValueError, match=message):
        grpo_config.validate_job(parse_config(*overrides))
