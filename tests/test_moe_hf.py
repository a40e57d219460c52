"""Hugging Face Qwen3-MoE weights in and out of grpo_qwen3: a tiny random transformers `Qwen3MoeForCausalLM`, saved
with save_pretrained, loads through torchtitan's qwen3 state-dict adapter the way torchtitan's checkpointer loads
`[checkpoint] initial_load_in_hf` (to_hf for the names and shapes, DCP's HF reader, from_hf), and gives transformers'
logits on the same ids, on one process and with its experts split over 2 expert-parallel ranks; to_hf gives the
checkpoint back, key for key, and so does torchtitan's distributed HF export from the 2 ranks. The plugin's
reference loader (`[reference_model] checkpoint_path` at an HF folder) loads it too.

Simplifications:
1. The model is grpo_qwen3's `debugmodel_moe_small` resized to the checkpoint: 64 wide, head_dim 32 (not 64 / 4
   heads), 2 KV heads, 2 layers, each a mixture of 8 experts of 32, top 2, vocabulary 1024, untied output weights
   as in torchtitan's MoE flavors. Its router is the flavor's as it is (softmax scores, top-k renormalised, gates
   applied after the experts, no shared expert): `test_the_flavors_router_is_qwen3_moes` pins what config.json
   cannot say.
2. The experts run torchtitan's fp32 for-loop; the flavor's grouped matmuls compute in bf16
   (torchtitan's `_run_experts_grouped_mm`) and are compared at bf16's tolerance.
3. transformers initialises the router at std 0.02, which scores the 8 experts nearly alike; its weights are scaled
   x10 so that no token's second and third expert are near a tie that rounding could flip.
4. EP=2 is torchtitan's ExpertParallel (`apply_moe_ep_tp`) on a 1-D "ep" mesh of 2 gloo ranks without FSDP: each
   rank runs its own half of the batch, as EP ranks borrowed from data parallelism do (test_moe trains the
   FSDP x EP layouts). The export is the DCP save torchtitan's `last_save_in_hf` makes. Spawning the ranks takes
   about 10 s of the file's 12 s; conftest marks the two tests that use them slow.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import plugin  # noqa: F401  (registers grpo_qwen3 and patches torchtitan for the CPU)
from conftest import ranks_result
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.protocols.train_spec import get_train_spec

FLAVOR = "debugmodel_moe_small"
ROUTER_SCALE = 10.0
# torchtitan's adapter drops the MoE load-balancing bias on the way out (to_hf), so from_hf cannot bring it back; it
# only ranks the experts, starts at zero and has no counterpart in transformers' Qwen3-MoE
NOT_IN_HF = {"layers.0.moe.expert_bias", "layers.1.moe.expert_bias"}


def hf_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[],  # every layer a mixture of experts, as in the flavor
        norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=64,
    )


def titan_args(config, grouped_mm: bool = False):
    """The flavor at the checkpoint's sizes (config.json's), its router and experts' settings as they are."""
    base = get_train_spec("grpo_qwen3").model_args[FLAVOR]
    return dataclasses.replace(
        base, vocab_size=config.vocab_size, dim=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        norm_eps=config.rms_norm_eps, rope_theta=config.rope_parameters["rope_theta"],
        max_seq_len=config.max_position_embeddings, enable_weight_tying=config.tie_word_embeddings,
        moe_inter_dim=config.moe_intermediate_size,
        moe_args=dataclasses.replace(base.moe_args, num_experts=config.num_experts,
                                     top_k=config.num_experts_per_tok, use_grouped_mm=grouped_mm),
    )


def load_hf(model: torch.nn.Module, adapter, path: Path) -> set[str]:
    """torchtitan's HF load (CheckpointManager.dcp_load with from_hf); the model's entries it left as they were.

    Under EP, to_hf names only this rank's experts, DCP reads only those, and from_hf stacks them into the
    Shard(0) DTensor the experts' weights are."""
    state_dict = ModelWrapper(model).state_dict()
    hf_state_dict = adapter.to_hf(state_dict)
    dcp.load(hf_state_dict, storage_reader=adapter.get_hf_storage_reader(str(path)))
    loaded = adapter.from_hf(hf_state_dict)
    ModelWrapper(model).load_state_dict(loaded)  # strict=False, as torchtitan loads
    return set(state_dict) - set(loaded)


def build(args) -> tuple[torch.nn.Module, object]:
    """The GRPO policy (grpo_qwen3's model class, nn's default init until a load) and the TrainSpec's state-dict
    adapter, on the CPU."""
    spec = get_train_spec("grpo_qwen3")
    return spec.model_cls(args).eval(), spec.state_dict_adapter(args, None)


def loaded(args, hf_dir: Path) -> tuple[torch.nn.Module, object]:
    """`build`, then the checkpoint's weights in every entry HF has a name for."""
    model, adapter = build(args)
    assert load_hf(model, adapter, hf_dir) == NOT_IN_HF
    return model, adapter


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random Qwen3MoeForCausalLM in fp32, saved as the Hub's checkpoints are (experts one by one)."""
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers: pip install -e '.[dev]'")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_config())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    path = tmp_path_factory.mktemp("qwen3_moe_hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def config(hf_dir):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 1024, (4, 37), generator=torch.Generator().manual_seed(1))  # [B, T], no padding


@pytest.fixture(scope="module")
def hf_logits(hf_dir, ids) -> torch.Tensor:
    """transformers' own load of the folder and its logits (SDPA attention, its default); [B, T, V]."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    for router_logits in out.router_logits:  # [B * T, experts] per layer
        top3 = router_logits.softmax(-1).topk(3, dim=-1).values
        # seen: 9.7e-4 and 1.0e-3 per layer (2.1e-5 at transformers' init), where the logits differ by 6e-8 in fp32
        # and 3.4e-4 with bf16 experts
        assert (top3[:, 1] - top3[:, 2]).min() > 5e-4
    return out.logits


@pytest.fixture(scope="module")
def logits(config, hf_dir, ids) -> torch.Tensor:
    """grpo_qwen3's logits from the HF weights on one process, fp32 experts; [B, T, V]."""
    model, _ = loaded(titan_args(config), hf_dir)
    with torch.no_grad():
        return model(ids)


def test_the_flavors_router_is_qwen3_moes(config):
    """What config.json has no key for: Qwen3-MoE routes by softmax over all experts, renormalises the top k
    (norm_topk_prob), weights the experts' outputs, and has neither shared experts nor a route scale."""
    args = titan_args(config)
    moe = args.moe_args
    assert (moe.score_func, moe.route_norm, moe.route_scale) == ("softmax", config.norm_topk_prob, 1.0)
    assert not moe.score_before_experts and moe.num_shared_experts == 0 and not moe.gate_bias
    assert moe.num_expert_groups is None
    assert args.qk_norm and args.head_dim * args.n_heads != args.dim


# fp32: seen 6e-8 on logits up to 0.73
FP32 = dict(rtol=0, atol=1e-5)


def test_hf_weights_give_transformers_logits(logits, hf_logits):
    print(f"max |logits - transformers'|: {(logits - hf_logits).abs().max():.1e}")
    torch.testing.assert_close(logits, hf_logits, **FP32)


def test_the_flavors_bf16_experts_give_transformers_logits_at_bf16s_tolerance(config, hf_dir, ids, hf_logits):
    """The flavor's grouped matmuls, in bf16 on fp32 weights (torchtitan's `_run_experts_grouped_mm`)."""
    model, _ = loaded(titan_args(config, grouped_mm=True), hf_dir)
    with torch.no_grad():
        logits = model(ids)
    print(f"max |bf16 experts' logits - transformers'|: {(logits - hf_logits).abs().max():.1e}")
    torch.testing.assert_close(logits, hf_logits, rtol=2e-2, atol=5e-3)  # seen: 3.4e-4


def test_the_reference_loads_the_hf_checkpoint(config, hf_dir, ids, hf_logits):
    """[reference_model] checkpoint_path at an HF folder (plugin.model.reference): the same adapter, the plugin's
    strict load; the layers' expert_bias, which HF has no name for, stays the reference's own."""
    from plugin.model.reference import load_reference_checkpoint

    model, adapter = build(titan_args(config))
    load_reference_checkpoint(model, str(hf_dir), "hf", adapter)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_logits, **FP32)


def test_to_hf_gives_the_checkpoint_back(config, hf_dir):
    """The export's way out (to_hf, what `last_save_in_hf` writes): every name of the Hub's layout, no other, the
    same values; the experts' stacked [E, out, in] weights split back into E matrices."""
    model, adapter = loaded(titan_args(config), hf_dir)
    exported, original = adapter.to_hf(model.state_dict()), read_safetensors(hf_dir)
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported and len(exported) == 69


def _expert_parallel(rank: int, world_size: int, out: str, args, hf_dir: Path, ids: torch.Tensor, export: Path):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp  # what parallelize_qwen3 calls

    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model, adapter = build(args)
    apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=ep_mesh, etp_mesh=None, ep_etp_mesh=None)
    assert load_hf(model, adapter, hf_dir) == NOT_IN_HF
    w1 = model.layers["0"].moe.experts.w1
    assert isinstance(w1, DTensor) and w1.placements == (Shard(0),) and w1.to_local().shape[0] == 4
    with torch.no_grad():
        logits = model(ids.chunk(world_size)[rank])  # this rank's half of the batch; its tokens visit both ranks
    exported = adapter.to_hf(model.state_dict())
    experts = sorted({int(k.split(".")[5]) for k in exported if ".mlp.experts." in k})  # this rank's only
    # torchtitan's HF save without an index file to follow (CheckpointManager.dcp_save): one consolidated file
    dcp.save(exported, storage_writer=HuggingFaceStorageWriter(path=str(export), save_distributed=True,
                                                               enable_consolidation=True))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (logits, experts))
    if rank == 0:
        torch.save(gathered, out)


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory, config, hf_dir, ids):
    """Each EP rank's logits and the experts its to_hf named, and the folder the 2 ranks exported to."""
    export = tmp_path_factory.mktemp("ep2_export")
    ranks = ranks_result(tmp_path_factory, "ep2", 2, _expert_parallel, titan_args(config), hf_dir, ids, export)
    return ranks, export


def test_expert_parallel_ranks_give_transformers_logits(expert_parallel, logits, hf_logits):
    """EP=2 loads the HF experts into each rank's Shard(0) half through the adapter's DTensor path."""
    ranks, _ = expert_parallel
    assert [experts for _, experts in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ep_logits = torch.cat([rank_logits for rank_logits, _ in ranks])
    print(f"max |EP=2 logits - one process'|: {(ep_logits - logits).abs().max():.1e}, "
          f"- transformers': {(ep_logits - hf_logits).abs().max():.1e}")
    torch.testing.assert_close(ep_logits, logits, **FP32)
    torch.testing.assert_close(ep_logits, hf_logits, **FP32)


def test_expert_parallel_export_is_the_checkpoint(expert_parallel, hf_dir):
    """Each rank exports its own experts; the consolidated file is the checkpoint, key for key."""
    _, export = expert_parallel
    exported, original = read_safetensors(export), read_safetensors(hf_dir)
    assert sorted(exported) == sorted(original)
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
