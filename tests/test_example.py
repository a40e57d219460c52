import json
from pathlib import Path

import pytest
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from plugin import example

REPO = Path(__file__).resolve().parents[1]
TRAIN_FILE = REPO / "data" / "arith_rollouts.jsonl"
HELDOUT_FILE = REPO / "data" / "arith_heldout.jsonl"


def read_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(str(example.TOKENIZER_DIR))


@pytest.mark.parametrize(
    "prompt, completion, expected",
    [
        ("Q: 37+45=", " 82\n", 1.0),
        ("Q: 0+0=", " 0\n", 1.0),
        ("Q: 12-40=", " -28\n", 1.0),
        ("Q: 99+99=", " 198\n", 1.0),
        ("Q: 37+45=", " 83\n", 0.0),
        ("Q: 37+45=", " 28\n", 0.0),
        ("Q: 12-40=", " 28\n", 0.0),
        # Malformed: the right number in the wrong shape still scores 0.
        ("Q: 37+45=", " 82", 0.0),
        ("Q: 37+45=", "82\n", 0.0),
        ("Q: 37+45=", "  82\n", 0.0),
        ("Q: 37+45=", " 82 \n", 0.0),
        ("Q: 37+45=", " 82\n\n", 0.0),
        ("Q: 37+45=", "\t82\n", 0.0),
        ("Q: 37+45=", " 082\n", 0.0),
        ("Q: 0+0=", " -0\n", 0.0),
        ("Q: 37+45=", " +82\n", 0.0),
        ("Q: 37+45=", " 82 is the answer\n", 0.0),
        ("Q: 37+45=", " The answer is 82\n", 0.0),
        ("Q: 37+45=", " 82\nQ: 1+1= 2\n", 0.0),
        ("Q: 37+45=", " 82.0\n", 0.0),
        ("Q: 37+45=", "", 0.0),
    ],
)
def test_reward(prompt, completion, expected):
    assert example.reward(prompt, completion) == expected


def test_reward_rejects_foreign_prompt():
    with pytest.raises(ValueError):
        example.reward("Q: 3*4=", " 12\n")


def test_generate_rollouts_deterministic_and_grouped():
    rows = example.generate_rollouts(n_groups=50, group_size=5, seed=7)
    assert rows == example.generate_rollouts(n_groups=50, group_size=5, seed=7)
    assert rows != example.generate_rollouts(n_groups=50, group_size=5, seed=8)

    groups: dict[int, list[dict]] = {}
    for row in rows:
        assert set(row) == {"prompt", "completion", "reward", "group"}
        assert row["reward"] == example.reward(row["prompt"], row["completion"])
        groups.setdefault(row["group"], []).append(row)
    assert sorted(groups) == list(range(50))
    for members in groups.values():
        assert len(members) == 5
        assert len({m["prompt"] for m in members}) == 1
        assert {m["reward"] for m in members} == {0.0, 1.0}
    # Each group is a different prompt.
    assert len({members[0]["prompt"] for members in groups.values()}) == 50


def test_generate_rollouts_rejects_singleton_groups():
    with pytest.raises(ValueError):
        example.generate_rollouts(n_groups=4, group_size=1, seed=0)


def test_prompt_pools_partition_the_prompt_space():
    train, heldout = example.prompt_pool("train"), example.prompt_pool("heldout")
    assert len(train) + len(heldout) == 2 * 100 * 100
    assert not set(train) & set(heldout)
    assert all(example.is_heldout(p) for p in heldout)
    # crc32 % 8 should hold out roughly an eighth.
    assert 2000 < len(heldout) < 3000


@pytest.mark.parametrize("path, n_groups", [(TRAIN_FILE, 512), (HELDOUT_FILE, 64)])
def test_committed_files_are_valid(path, n_groups):
    rows = read_rows(path)
    assert len(rows) == n_groups * 4
    groups: dict[int, list[dict]] = {}
    for row in rows:
        assert row["reward"] == example.reward(row["prompt"], row["completion"])
        groups.setdefault(row["group"], []).append(row)
    assert len(groups) == n_groups
    assert all(len({m["reward"] for m in members}) >= 2 for members in groups.values())


def test_committed_heldout_disjoint_from_train():
    train_prompts = {row["prompt"] for row in read_rows(TRAIN_FILE)}
    heldout_prompts = {row["prompt"] for row in read_rows(HELDOUT_FILE)}
    assert len(train_prompts) == 512
    assert len(heldout_prompts) == 64
    assert not train_prompts & heldout_prompts
    assert not any(example.is_heldout(p) for p in train_prompts)


@pytest.mark.parametrize(
    "path, split, groups, seed",
    [(TRAIN_FILE, "train", 512, 0), (HELDOUT_FILE, "heldout", 64, 1)],
)
def test_committed_files_match_cli(tmp_path, path, split, groups, seed):
    out = tmp_path / path.name
    example.main(
        ["rollouts", "--split", split, "--out", str(out), "--groups", str(groups),
         "--group-size", "4", "--seed", str(seed)]
    )
    assert out.read_bytes() == path.read_bytes()


def test_tokenizer_loads_in_torchtitan(tokenizer):
    assert tokenizer.get_vocab_size() == 2048
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    assert tokenizer.token_to_id(example.PAD_TOKEN) == 2
    # BOS/EOS only when asked for, as torchtitan's text datasets do.
    text = "Q: 37+45= 82\n"
    plain = tokenizer.encode(text)
    assert tokenizer.decode(plain) == text
    assert tokenizer.encode(text, add_bos=True, add_eos=True) == [0, *plain, 1]
    # The answer is one token after its space, so the policy learns a number, not digits.
    assert tokenizer.tokenizer.encode(" 82").tokens == ["Ġ82"]


def test_tokenizer_covers_rollout_files(tokenizer):
    longest = 0
    for path in (TRAIN_FILE, HELDOUT_FILE):
        for row in read_rows(path):
            text = row["prompt"] + row["completion"]
            ids = tokenizer.encode(text, add_bos=True, add_eos=True)
            assert max(ids) < 2048
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
            longest = max(longest, len(ids))
    assert longest == 14


def test_tokenizer_cli_is_reproducible(tmp_path):
    example.main(["tokenizer", "--out", str(tmp_path)])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (example.TOKENIZER_DIR / name).read_bytes()
