import json
import math

import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO
from plugin.config import GRPO
from plugin.data import (
    BatchPlan,
    Collate,
    Completion,
    RolloutDataset,
    RolloutError,
    advantages,
    check_group_sizes,
    loss_weights,
    read_rollouts,
)


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


ROW = {"prompt": "Q: 1+2=", "completion": " 3\n", "reward": 1.0, "group": 0}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({k: v for k, v in ROW.items() if k != "reward"}, "missing field 'reward'"),
        ({k: v for k, v in ROW.items() if k != "group"}, "missing field 'group'"),
        ({**ROW, "reward": "1.0"}, "field 'reward' has type str"),
        ({**ROW, "completion": 3}, "field 'completion' has type int"),
        ({**ROW, "reward": True}, "field 'reward' has type bool"),
        ({**ROW, "reward": math.nan}, "field 'reward' is nan"),
        ({**ROW, "reward": math.inf}, "field 'reward' is inf"),
        ({**ROW, "completion": ""}, "field 'completion' is empty"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({**ROW, "completion": " 3" * 40}, "more than [training] seq_len + 1"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, tokenizer, bad, message):
    path = _write(tmp_path / "r.jsonl", [ROW, {**ROW, "reward": 0.0}, bad])
    with pytest.raises(RolloutError) as e:
        read_rollouts(path, tokenizer, seq_len=32)
    assert f"{path}:3: " in str(e.value)
    assert message in str(e.value)


def test_missing_file_names_the_key(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"\[training\] dataset_path = .*nope.jsonl"):
        read_rollouts(str(tmp_path / "nope.jsonl"), tokenizer, 32)


def test_groups_and_sizes(tmp_path, tokenizer):
    rows = [{**ROW, "group": g, "reward": float(i)} for g in ("a", "b") for i in range(3)]
    rows.append({**ROW, "group": "a", "reward": 9.0})  # non-contiguous rows still join their group
    groups = read_rollouts(_write(tmp_path / "r.jsonl", rows), tokenizer, 32)
    assert [[c.reward for c in g] for g in groups] == [[0, 1, 2, 9], [0, 1, 2]]
    with pytest.raises(RolloutError, match=r"r.jsonl:4: the group starting here has 3 completions"):
        check_group_sizes(groups, 0)
    with pytest.raises(RolloutError, match=r"\[grpo\] group_size has 3"):
        check_group_sizes(groups, 3)


def test_advantages_reference():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 2.0, 1.0, 0.0, 1.0])
    r = rewards.double().view(3, 4)
    eps = 1e-4
    expected_group = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()
    torch.testing.assert_close(advantages(rewards, 4, "group_std", eps).double(), expected_group, rtol=1e-6, atol=1e-6)
    expected_batch = ((r - r.mean(1, keepdim=True)) / (r.std() + eps)).flatten()
    torch.testing.assert_close(advantages(rewards, 4, "batch_std", eps).double(), expected_batch, rtol=1e-6, atol=1e-6)
    expected_none = (r - r.mean(1, keepdim=True)).flatten()
    torch.testing.assert_close(advantages(rewards, 4, "none", eps).double(), expected_none, rtol=1e-6, atol=1e-6)
    # equal rewards: zero advantage, not NaN
    assert advantages(rewards, 4, "group_std", eps)[4:8].eq(0).all()


def test_collate_masks_completion_tokens_only(tmp_path, tokenizer):
    rows = [{"prompt": "Q: 12+30=", "completion": c, "reward": r, "group": 0} for c, r in ((" 42\n", 1.0), (" 41\n", 0.0))]
    groups = read_rollouts(_write(tmp_path / "r.jsonl", rows), tokenizer, 16)
    batch, labels = Collate(16, pad_id=1, grpo=GRPO())(groups, range(1))
    for i, c in enumerate(groups[0]):
        prompt = tokenizer.encode("Q: 12+30=", add_bos=True, add_eos=False)
        completion = tokenizer.encode(rows[i]["completion"], add_bos=False, add_eos=True)
        assert c.tokens == prompt + completion
        n = len(c.tokens)
        assert batch["input"][i, : n - 1].tolist() == c.tokens[:-1]
        assert batch["input"][i, n - 1 :].eq(1).all()
        valid = labels[i] != IGNORE_INDEX
        assert valid.sum() == len(completion)
        assert labels[i, valid].tolist() == completion
        # the first completion target is predicted from the last prompt token
        assert valid.nonzero()[0].item() == len(prompt) - 1
    assert torch.equal(batch["labels"], labels)
    assert batch["rollouts"].rewards.tolist() == [1.0, 0.0]
    assert batch["rollouts"].advantages[0] > 0 > batch["rollouts"].advantages[1]
    assert batch["rollouts"].loss_weights.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "fixed_horizon"])
def test_loss_weights_turn_the_token_mean_into_each_mode(mode):
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 7, 1, 12, 5])
    token_losses = [torch.randn(n, generator=g, dtype=torch.float64) for n in lens.tolist()]
    horizon = 16
    w = loss_weights(lens, mode, horizon).double()
    # what torchtitan computes: sum of weighted token losses / global completion tokens
    got = sum(wi * l.sum() for wi, l in zip(w, token_losses)) / lens.sum()
    expected = {
        "token_mean": torch.cat(token_losses).mean(),
        "seq_mean_token_mean": torch.stack([l.mean() for l in token_losses]).mean(),
        "seq_mean_token_sum": torch.stack([l.sum() for l in token_losses]).mean(),
        "fixed_horizon": torch.cat(token_losses).sum() / (len(lens) * horizon),
    }[mode]
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def _groups(n, size=2):
    return [[Completion([g, i, 7], 1, float(i), f"f:{g}") for i in range(size)] for g in range(n)]


def _dataset(groups, rank, world, gpm=1, grad_accum=1, seed=3):
    plan = BatchPlan(group_size=len(groups[0]), groups_per_microbatch=gpm, grad_accum=grad_accum,
                     dp_rank=rank, dp_world_size=world)
    return RolloutDataset(groups, plan, Collate(4, 0, GRPO()), seed)


def _group_ids(batch):
    inputs, _ = batch
    return inputs["input"][::2, 0].tolist()  # token 0 of each completion is its group id


def _take(ds, n):
    it = iter(ds)
    return [_group_ids(next(it)) for _ in range(n)]


@pytest.mark.parametrize("n_groups, world, gpm, grad_accum", [(12, 2, 1, 1), (11, 2, 2, 1), (9, 2, 1, 2), (13, 1, 2, 2)])
def test_dp_sharding_is_disjoint_and_complete(n_groups, world, gpm, grad_accum):
    groups = _groups(n_groups)
    per_step = gpm * world * grad_accum
    steps = 3 * n_groups // per_step  # a few epochs
    streams = [_take(_dataset(groups, r, world, gpm, grad_accum), steps * grad_accum) for r in range(world)]
    seen = []
    for s in range(steps):
        # a step's groups in stream order: microbatch-major, then rank
        step = [g for j in range(grad_accum) for r in range(world) for g in streams[r][s * grad_accum + j]]
        assert len(step) == per_step
        seen.extend(step)
    # every epoch is a permutation: each group once before any group twice
    for e in range(len(seen) // n_groups):
        assert sorted(seen[e * n_groups : (e + 1) * n_groups]) == list(range(n_groups))


def test_shuffle_is_deterministic_per_seed_and_epoch():
    ds = _dataset(_groups(20), 0, 1)
    assert ds.epoch_order(0) == _dataset(_groups(20), 0, 1).epoch_order(0)
    assert ds.epoch_order(0) != ds.epoch_order(1)
    assert ds.epoch_order(0) != _dataset(_groups(20), 0, 1, seed=4).epoch_order(0)


def test_state_dict_resumes_at_the_same_row():
    groups = _groups(5)
    straight = _take(_dataset(groups, 1, 2, grad_accum=2), 12)  # crosses epoch boundaries
    ds = _dataset(groups, 1, 2, grad_accum=2)
    it = iter(ds)
    first = [_group_ids(next(it)) for _ in range(7)]  # stops mid-step
    resumed = _dataset(groups, 1, 2, grad_accum=2)
    resumed.load_state_dict(ds.state_dict())
    assert first + _take(resumed, 5) == straight


def test_batch_std_uses_the_whole_global_batch():
    groups = [[Completion([g, i], 1, float(r), "f") for i, r in enumerate(rs)] for g, rs in enumerate([(0, 1), (0, 3)])]
    cfg = GRPO(advantage_norm="batch_std")
    a0 = Collate(4, 0, cfg)(groups, range(0, 1))[0]["rollouts"].advantages
    a1 = Collate(4, 0, cfg)(groups, range(1, 2))[0]["rollouts"].advantages
    std = torch.tensor([0.0, 1.0, 0.0, 3.0]).std().item()
    assert torch.cat([a0, a1]).tolist() == pytest.approx([-0.5 / std, 0.5 / std, -1.5 / std, 1.5 / std], rel=1e-4)
