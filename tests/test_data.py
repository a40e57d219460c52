import json
import math

import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO
from plugin.data import (
    Collate,
    RolloutDataset,
    RolloutError,
    advantages,
    check_group_sizes,
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
    batch, labels = Collate(16, pad_id=1, group_size=2, norm="group_std", eps=1e-4)(groups[0])
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


def _groups(n, size=2):
    from plugin.data import Completion

    return [[Completion([g, i], 1, float(i), f"f:{g}") for i in range(size)] for g in range(n)]


def _take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("n_groups, world", [(10, 2), (11, 2), (9, 4)])
def test_dp_sharding_is_disjoint_and_complete(n_groups, world):
    groups = _groups(n_groups)
    per_rank = [RolloutDataset(groups, r, world, seed=3)._epoch_order(0) for r in range(world)]
    seen = sorted(g for order in per_rank for g in order)
    assert seen == list(range(n_groups))
    # groups stay whole and contiguous in each rank's stream
    stream = _take(RolloutDataset(groups, 0, world, seed=3), 2 * len(per_rank[0]))
    assert [c.tokens[0] for c in stream[::2]] == [c.tokens[0] for c in stream[1::2]] == per_rank[0]


def test_shuffle_is_deterministic_per_seed_and_epoch():
    groups = _groups(20)
    a, b = RolloutDataset(groups, 0, 1, seed=0), RolloutDataset(groups, 0, 1, seed=0)
    assert a._epoch_order(0) == b._epoch_order(0)
    assert a._epoch_order(0) != a._epoch_order(1)
    assert a._epoch_order(0) != RolloutDataset(groups, 0, 1, seed=1)._epoch_order(0)


def test_state_dict_resumes_at_the_same_row():
    groups = _groups(5)
    ds = RolloutDataset(groups, 0, 1, seed=0)
    straight = [c.where + str(c.tokens) for c in _take(ds, 24)]  # crosses two epoch boundaries
    ds = RolloutDataset(groups, 0, 1, seed=0)
    first = [c.where + str(c.tokens) for c in _take(ds, 14)]
    state = ds.state_dict()
    resumed = RolloutDataset(groups, 0, 1, seed=0)
    resumed.load_state_dict(state)
    assert first + [c.where + str(c.tokens) for c in _take(resumed, 10)] == straight
