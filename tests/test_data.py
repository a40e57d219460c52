import json
import logging
import re
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO, parse_config
from plugin.config import GRPO
from plugin.data.batch import BatchPlan, Collate, advantages, loss_weights
from plugin.data.loader import RolloutDataset, build_rollout_dataloader
from plugin.job import GRPOJob
from plugin.data.rollouts import Encoder, RolloutError, index_rollouts

PADDED = GRPO(padding_free=False)  # the layout checks below read row b as completion b

VOCAB = 2048  # the bundled tokenizer's and the llama3 debugmodel's


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))


def write(path, rows) -> str:
    """Rows as JSONL (a str row is written verbatim) or, for a .parquet path, as Parquet with 3-row row groups."""
    if path.suffix == ".parquet":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path, row_group_size=3)
    else:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def index(path, tokenizer, seq_len=32, template="", **kwargs):
    return index_rollouts(path, Encoder(tokenizer, VOCAB, seq_len, template), **kwargs)


def flat(group, reward, completion=" 3\n", prompt="Q: 1+2=", **extra):
    return {"prompt": prompt, "completion": completion, "reward": reward, "group": group, **extra}


ROWS = [flat(0, 1.0), flat(0, 0.0, " 4\n"), flat(1, 0.0, " 5\n", "Q: 2+3="), flat(1, 1.0, " 5 is it\n", "Q: 2+3=")]


def as_grouped(rows):
    groups = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"prompt": r["prompt"], "completions": [], "rewards": [], "group": r["group"]})
        g["completions"].append(r["completion"])
        g["rewards"].append(r["reward"])
    return list(groups.values())


def as_ids(rows, tokenizer):
    out = []
    for r in rows:
        r = dict(r)
        r["prompt_ids"] = tokenizer.encode(r.pop("prompt"), add_bos=True, add_eos=False)
        if "completion" in r:
            r["completion_ids"] = tokenizer.encode(r.pop("completion"), add_bos=False, add_eos=True)
        else:
            r["completions_ids"] = [tokenizer.encode(c, add_bos=False, add_eos=True) for c in r.pop("completions")]
        out.append(r)
    return out


# ---- formats ----


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("layout", ["flat", "grouped", "flat_ids", "grouped_ids"])
def test_formats_and_layouts_read_the_same_completions(tmp_path, tokenizer, suffix, layout):
    rows = as_grouped(ROWS) if layout.startswith("grouped") else ROWS
    if layout.endswith("ids"):
        rows = as_ids(rows, tokenizer)
    idx = index(write(tmp_path / f"r{suffix}", rows), tokenizer)
    assert (idx.num_groups, idx.group_size, idx.grouped) == (2, 2, layout.startswith("grouped"))
    assert idx.rewards.tolist() == [r["reward"] for r in ROWS]
    got = idx.read(np.arange(4))
    for c, r in zip(got, ROWS):
        prompt = tokenizer.encode(r["prompt"], add_bos=True, add_eos=False)
        assert c.tokens == prompt + tokenizer.encode(r["completion"], add_bos=False, add_eos=True)
        assert c.prompt_len == len(prompt) and c.reward == r["reward"] and c.logprobs is None
    assert idx.lengths.tolist() == [len(c.tokens) - c.prompt_len for c in got]
    assert idx.nbytes == 28 * 4  # offset, slot, reward, length, prompt length, loss length per completion


def test_rows_of_a_group_need_not_be_adjacent_and_groups_keep_file_order(tmp_path, tokenizer):
    rows = [flat("b", 0.0), flat(7, 1.0), flat("b", 1.0), flat("7", 0.0), flat(7, 0.0), flat("7", 1.0)]
    idx = index(write(tmp_path / "r.jsonl", rows), tokenizer)
    # 7 and "7" are different groups; order of first appearance: "b", 7, "7"
    assert idx.rewards.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    starts = np.cumsum([0] + [len(json.dumps(r)) + 1 for r in rows])
    assert idx.offsets.tolist() == starts[[0, 2, 1, 4, 3, 5]].tolist()


def test_chat_template_wraps_text_prompts_with_one_bos(tmp_path, tokenizer):
    path = write(tmp_path / "r.jsonl", ROWS)
    (c,) = index(path, tokenizer, template="User: {prompt}\nAssistant:").read(np.arange(1))
    expected = tokenizer.encode("User: Q: 1+2=\nAssistant:", add_bos=True, add_eos=False)
    assert c.tokens[: c.prompt_len] == expected
    (c,) = index(path, tokenizer, template="<|begin_of_text|>{prompt}").read(np.arange(1))
    assert c.tokens[: c.prompt_len] == tokenizer.encode("Q: 1+2=", add_bos=True, add_eos=False)


def test_format_from_suffix(tmp_path, tokenizer):
    path = write(tmp_path / "r.txt", ROWS)
    with pytest.raises(ValueError, match=r"suffix '.txt' names no rollout format.*\[rollout_data\] format"):
        index(path, tokenizer)
    assert index(path, tokenizer, fmt="jsonl").num_groups == 2


def test_behaviour_logprobs_align_with_labels(tmp_path, tokenizer):
    ids = tokenizer.encode(" 3\n", add_bos=False, add_eos=False)
    n = len(ids)
    rows = [
        flat(0, 1.0, logprobs=[-0.5] * n),  # text: the appended EOS has no behaviour log-prob
        flat(0, 0.0, logprobs=[-0.25] * n + [-0.125]),  # text, EOS included
        {"prompt_ids": [0, 5, 6], "completion_ids": ids, "reward": 1.0, "group": 1, "logprobs": [-1.0, None, -2.0][:n]},
        {"prompt_ids": [0, 5, 6], "completion_ids": ids, "reward": 0.0, "group": 1},  # none given: on-policy
    ]
    assert n == 2  # " 3" and "\n" are one token each in the bundled tokenizer
    idx = index(write(tmp_path / "r.jsonl", rows), tokenizer)
    batch = idx.read(np.arange(4))
    assert [c.logprobs for c in batch][3] is None
    inputs, labels = Collate(16, 1, PADDED, 2)(torch.from_numpy(idx.rewards), torch.from_numpy(idx.lengths).long(),
                                               [0, 1, 2, 3], batch)
    old = inputs["rollouts"].old_logprobs
    mask = labels != IGNORE_INDEX
    assert old[0, mask[0]].tolist()[:2] == [-0.5, -0.5] and math.isnan(old[0, mask[0]][2])
    assert old[1, mask[1]].tolist() == [-0.25, -0.25, -0.125]
    assert old[2, mask[2]].tolist()[0] == -1.0 and math.isnan(old[2, mask[2]][1])
    assert old[3].isnan().all() and old[~mask].isnan().all()
    # a batch without behaviour log-probs carries none
    inputs, _ = Collate(16, 1, PADDED, 2)(torch.from_numpy(idx.rewards), torch.from_numpy(idx.lengths).long(),
                                          [3], batch[3:])
    assert inputs["rollouts"].old_logprobs is None


@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "grouped"])
def test_reference_logprobs_align_with_labels(tmp_path, tokenizer, grouped):
    """`ref_logprobs` reaches the Rollouts only when every token of every completion has one."""
    ids = tokenizer.encode(" 3\n", add_bos=False, add_eos=False)
    rows = [
        flat(0, 1.0, ref_logprobs=[-0.5, -0.75, -0.125]),  # EOS included
        flat(0, 0.0, ref_logprobs=[-0.25, -0.375, -1.5]),
        flat(1, 1.0, ref_logprobs=[-1.0, -2.0]),  # the appended EOS has none
        flat(1, 0.0, ref_logprobs=[-1.0, None, -2.0]),  # a null: unknown
    ]
    idx = index(write(tmp_path / "r.jsonl", as_grouped_with(rows, "ref_logprobs") if grouped else rows), tokenizer)
    batch = idx.read(np.arange(4))
    assert [len(c.ref_logprobs) for c in batch] == [len(ids) + 1] * 4
    collate = Collate(16, 1, PADDED, 2)
    rewards, lens = torch.from_numpy(idx.rewards), torch.from_numpy(idx.lengths).long()
    inputs, labels = collate(rewards, lens, [0, 1], batch[:2])
    ref, mask = inputs["rollouts"].ref_logprobs, labels != IGNORE_INDEX
    assert ref[0, mask[0]].tolist() == [-0.5, -0.75, -0.125] and ref[1, mask[1]].tolist() == [-0.25, -0.375, -1.5]
    assert (ref[~mask] == 0).all()
    for rows_ in ([2, 3], [0, 2], [0, 3]):  # one token without a value: the reference model scores the microbatch
        inputs, _ = collate(rewards, lens, rows_, [batch[i] for i in rows_])
        assert inputs["rollouts"].ref_logprobs is None


def as_grouped_with(rows, field):
    grouped = as_grouped(rows)
    for g in grouped:
        g[field] = [r[field] for r in rows if r["group"] == g["group"]]
    return grouped


# ---- validation: every problem, raised with file:line and field, or skipped and counted ----

TOO_LONG = " 3" * 40
BAD_ROWS = [
    # (a bad version of ROWS[1] (line 2), the message)
    ({k: v for k, v in ROWS[1].items() if k != "reward"}, "missing field 'reward'"),
    ({k: v for k, v in ROWS[1].items() if k != "prompt"}, "missing field 'prompt' (or 'prompt_ids')"),
    ({**ROWS[1], "reward": "1.0"}, "field 'reward' has type str, not a number"),
    ({**ROWS[1], "reward": True}, "field 'reward' has type bool"),
    ({**ROWS[1], "completion": 3}, "field 'completion' has type int, not str"),
    ({**ROWS[1], "reward": math.nan}, "field 'reward' is nan, not a finite number"),
    ({**ROWS[1], "reward": -math.inf}, "field 'reward' is -inf, not a finite number"),
    ({**ROWS[1], "completion": ""}, "field 'completion' is empty"),
    ({**ROWS[1], "completion": TOO_LONG}, "field 'completion': prompt + completion is 48 tokens, more than [training] seq_len + 1 = 33"),
    ({**ROWS[1], "logprobs": [-1.0]}, "field 'logprobs' has 1 values, the completion has 2 tokens (3 with the appended EOS)"),
    ({**ROWS[1], "logprobs": [-1.0, math.inf]}, "field 'logprobs' holds inf, not a finite log-prob"),
    ({**ROWS[1], "ref_logprobs": [-1.0]}, "field 'ref_logprobs' has 1 values, the completion has 2 tokens (3 with the appended EOS)"),
    ({**ROWS[1], "ref_logprobs": [-1.0, math.inf]}, "field 'ref_logprobs' holds inf, not a finite log-prob"),
    ({**ROWS[1], "ref_logprobs": "-1.0"}, "field 'ref_logprobs' has type str, not a list"),
    ({**ROWS[1], "prompt_ids": [0, 1]}, "fields 'prompt' and 'prompt_ids' are both given"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
]
BAD_IDS = [
    ({"prompt_ids": [0, 5], "completion_ids": [7, VOCAB], "reward": 0.0, "group": 0},
     f"field 'completion_ids' has token id {VOCAB}, outside the model's vocabulary [0, {VOCAB})"),
    ({"prompt_ids": [-1, 5], "completion_ids": [7], "reward": 0.0, "group": 0}, "field 'prompt_ids' has token id -1"),
    ({"prompt_ids": [0, 5], "completion_ids": [7, 8.0], "reward": 0.0, "group": 0},
     "field 'completion_ids' is not a list of integer token ids"),
    ({"prompt_ids": [0, 5], "completion_ids": [], "reward": 0.0, "group": 0}, "field 'completion_ids' is empty"),
]


@pytest.mark.parametrize("bad, message", BAD_ROWS + BAD_IDS)
def test_bad_row_raises_with_file_line_and_field(tmp_path, tokenizer, bad, message):
    path = write(tmp_path / "r.jsonl", [ROWS[0], bad, *ROWS[2:]])
    with pytest.raises(RolloutError) as e:
        index(path, tokenizer)
    assert str(e.value).startswith(f"{path}:2: ")
    assert message in str(e.value)


@pytest.mark.parametrize("bad, message", BAD_ROWS + BAD_IDS)
def test_bad_row_is_skipped_with_its_group_and_counted(tmp_path, tokenizer, bad, message, caplog):
    path = write(tmp_path / "r.jsonl", [ROWS[0], bad, *ROWS[2:]])
    with caplog.at_level(logging.WARNING):
        idx = index(path, tokenizer, on_error="skip")
    # group 0 (lines 1-2) is left out whole (without an unreadable line 2, its line 1 is a group of 1)
    assert (idx.num_groups, idx.skipped_rows, idx.skipped_groups) == (1, 2, 1)
    assert idx.rewards.tolist() == [0.0, 1.0]
    assert f"skipped {idx.skipped_rows} of 4 rows" in caplog.text and f"{path}:2: " in caplog.text
    assert message in caplog.text


def test_bad_parquet_row_names_the_row(tmp_path, tokenizer):
    path = write(tmp_path / "r.parquet", [ROWS[0], {**ROWS[1], "reward": math.nan}, *ROWS[2:]])
    with pytest.raises(RolloutError, match=r"r.parquet: row 1: field 'reward' is nan"):
        index(path, tokenizer)
    path = write(tmp_path / "r.parquet", [{k: v for k, v in r.items() if k != "reward" or i != 3} for i, r in enumerate(ROWS)])
    with pytest.raises(RolloutError, match=r"r.parquet: row 3: missing field 'reward'"):
        index(path, tokenizer)
    assert index(path, tokenizer, on_error="skip").rewards.tolist() == [1.0, 0.0]


GROUPED_BAD = [
    ({**as_grouped(ROWS)[1], "rewards": [0.0]}, "field 'rewards' has 1 values for 2 completions"),
    ({**as_grouped(ROWS)[1], "rewards": [0.0, math.nan]}, "field 'rewards[1]' is nan"),
    ({**as_grouped(ROWS)[1], "completions": [" 5\n", ""]}, "field 'completions[1]' is empty"),
    ({**as_grouped(ROWS)[1], "completions": " 5\n"}, "field 'completions' has type str, not a list"),
    ({**as_grouped(ROWS)[1], "completions": [" 5\n", TOO_LONG]}, "field 'completions[1]': prompt + completion is"),
    ({**as_grouped(ROWS)[1], "logprobs": [[-1.0]]}, "field 'logprobs' has 1 lists for 2 completions"),
    ({**as_grouped(ROWS)[1], "ref_logprobs": [[-1.0]]}, "field 'ref_logprobs' has 1 lists for 2 completions"),
    ({**as_grouped(ROWS)[1], "ref_logprobs": [[-1.0, True], [-1.0]]}, "field 'ref_logprobs[0]' holds True"),
]


@pytest.mark.parametrize("bad, message", GROUPED_BAD)
def test_bad_grouped_row(tmp_path, tokenizer, bad, message):
    path = write(tmp_path / "r.jsonl", [as_grouped(ROWS)[0], bad])
    with pytest.raises(RolloutError, match=re.escape(f"r.jsonl:2: {message}")):
        index(path, tokenizer)
    idx = index(path, tokenizer, on_error="skip")
    assert (idx.num_groups, idx.skipped_rows, idx.skipped_groups) == (1, 1, 1)


def test_group_sizes(tmp_path, tokenizer):
    # group "a": 3 rows, "b": 3 rows, "c": 2 rows (lines 3 and 8), "d": 1 row (line 9)
    rows = [flat(g, float(i % 2)) for i, g in enumerate("aacbbbacd")]
    path = write(tmp_path / "r.jsonl", rows)
    with pytest.raises(RolloutError, match=r"r.jsonl:3: field 'group' = 'c': the group \(first row here\) has 2 "
                                           r"completions; the file's most common group size is 3"):
        index(path, tokenizer)
    with pytest.raises(RolloutError, match=r"r.jsonl:1: field 'group' = 'a'.* has 3 completions; \[grpo\] group_size = 2"):
        index(path, tokenizer, group_size=2)
    idx = index(path, tokenizer, on_error="skip")
    assert (idx.num_groups, idx.group_size, idx.skipped_rows, idx.skipped_groups) == (2, 3, 3, 2)
    idx = index(path, tokenizer, on_error="skip", group_size=2)
    assert (idx.num_groups, idx.group_size, idx.skipped_rows, idx.skipped_groups) == (1, 2, 7, 3)
    rows = [flat("a", 1.0), flat("a", 0.0), flat("b", 1.0)]
    with pytest.raises(RolloutError, match=r"r1.jsonl:3: field 'group' = 'b'.* has 1 completion; GRPO needs at least 2"):
        index(write(tmp_path / "r1.jsonl", rows), tokenizer)
    grouped = [{**as_grouped(ROWS)[0], "completions": [" 3\n"], "rewards": [1.0]}, as_grouped(ROWS)[1]]
    with pytest.raises(RolloutError, match=r"r2.jsonl:1: field 'completions' has 1 completion; GRPO needs at least 2"):
        index(write(tmp_path / "r2.jsonl", grouped), tokenizer)


def test_nothing_left(tmp_path, tokenizer):
    with pytest.raises(RolloutError, match="no rollout rows"):
        index(write(tmp_path / "empty.jsonl", []), tokenizer)
    with pytest.raises(RolloutError, match="no valid groups"):
        index(write(tmp_path / "r.jsonl", [flat(0, math.nan), flat(0, 1.0)]), tokenizer, on_error="skip")
    with pytest.raises(FileNotFoundError, match=r"\[training\] dataset_path = .*nope.jsonl"):
        index(str(tmp_path / "nope.jsonl"), tokenizer)


@pytest.mark.parametrize("change", ["rewrite", "append", "touch"])
def test_changed_file_is_detected_when_read(tmp_path, tokenizer, change):
    """Any change to the file after indexing (size or modification time) stops the next read, naming the file."""
    path = write(tmp_path / "r.jsonl", ROWS)
    idx = index(path, tokenizer)
    assert len(idx.read(np.arange(2))) == 2
    if change == "rewrite":  # same rows, another reward: same size, new mtime
        write(tmp_path / "r.jsonl", [ROWS[0], {**ROWS[1], "reward": 1 - ROWS[1]["reward"]}, *ROWS[2:]])
    elif change == "append":
        with open(path, "a") as f:
            f.write(json.dumps(ROWS[0]) + "\n")
    else:
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(RolloutError, match=rf"{re.escape(str(path))}: the rollout file changed after it was indexed"):
        idx.read(np.arange(2))


# ---- config and the dataloader builder ----


def test_builder_skips_and_exposes_the_count(tmp_path, tokenizer):
    rows = [flat(g, float(i % 2)) for g in range(8) for i in range(4)]
    rows[5] = {**rows[5], "reward": math.inf}
    path = write(tmp_path / "r.jsonl", rows)
    with pytest.raises(RolloutError, match=r"r.jsonl:6: field 'reward' is inf"):
        build_rollout_dataloader(1, 0, tokenizer, parse_config("--training.dataset_path", path))
    cfg = parse_config("--training.dataset_path", path, "--rollout_data.on_error", "skip", "--training.local_batch_size",
                       "8")
    loader = build_rollout_dataloader(1, 0, tokenizer, cfg)
    assert loader.dataset.index.num_groups == 7
    assert GRPOJob.of(cfg).stats.reduce(None, torch.device("cpu"))["grpo/skipped_rows"] == 4
    inputs, labels = next(iter(loader))
    # padding-free by default: the 8 sequences' tokens in one row, rounded up to the TP degree (2)
    r = inputs["rollouts"]
    assert inputs["input"].shape == (1, -(-int(r.seq_lens.sum()) // 2) * 2) and r.advantages.shape == (8,)


# ---- advantages, loss weights, collate ----


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
    idx = index(write(tmp_path / "r.jsonl", rows), tokenizer, seq_len=16)
    batch = idx.read(np.arange(2))
    inputs, labels = Collate(16, 1, PADDED, 2)(torch.from_numpy(idx.rewards), torch.from_numpy(idx.lengths).long(),
                                               [0, 1], batch)
    prompt = tokenizer.encode("Q: 12+30=", add_bos=True, add_eos=False)
    for i, c in enumerate(batch):
        completion = tokenizer.encode(rows[i]["completion"], add_bos=False, add_eos=True)
        n = len(c.tokens)
        assert inputs["input"][i, : n - 1].tolist() == c.tokens[:-1]
        assert inputs["input"][i, n - 1 :].eq(1).all()
        valid = labels[i] != IGNORE_INDEX
        assert labels[i, valid].tolist() == completion
        # the first completion target is predicted from the last prompt token
        assert valid.nonzero()[0].item() == len(prompt) - 1
    assert torch.equal(inputs["labels"], labels)
    assert inputs["rollouts"].rewards.tolist() == [1.0, 0.0]
    assert inputs["rollouts"].advantages[0] > 0 > inputs["rollouts"].advantages[1]
    assert inputs["rollouts"].loss_weights.tolist() == [1.0, 1.0]


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


# ---- batching: whole groups, DP sharding, shuffling, resume ----


@pytest.fixture(scope="module")
def id_files(tmp_path_factory):
    """Pre-tokenized rollouts whose first prompt token is the group's number and first completion token its slot."""
    folder = tmp_path_factory.mktemp("ids")

    def make(n_groups, size=2):
        path = folder / f"g{n_groups}x{size}.jsonl"
        if not path.exists():
            write(path, [{"prompt_ids": [g], "completion_ids": [i, 7], "reward": float(i), "group": g}
                         for g in range(n_groups) for i in range(size)])
        return str(path)

    return make


def _dataset(path, tokenizer, rank, world, gpm=1, grad_accum=1, seed=3, cfg=None):
    idx = index(path, tokenizer, seq_len=4)
    plan = BatchPlan(group_size=idx.group_size, groups_per_microbatch=gpm, grad_accum=grad_accum,
                     dp_rank=rank, dp_world_size=world)
    return RolloutDataset(idx, plan, Collate(4, 0, cfg or PADDED, idx.group_size), seed)


def _group_ids(batch, size=2):
    inputs, _ = batch
    tokens = inputs["input"]
    # whole groups, in order: row k of a group is its completion k
    assert tokens[:, 1].tolist() == list(range(size)) * (len(tokens) // size)
    assert tokens[:, 0].view(-1, size).eq(tokens[::size, :1]).all()
    return tokens[::size, 0].tolist()


def _take(ds, n):
    it = iter(ds)
    return [_group_ids(next(it)) for _ in range(n)]


@pytest.mark.parametrize("n_groups, world, gpm, grad_accum", [(12, 2, 1, 1), (11, 2, 2, 1), (9, 2, 1, 2), (13, 1, 2, 2)])
def test_dp_sharding_is_disjoint_and_complete(id_files, tokenizer, n_groups, world, gpm, grad_accum):
    path = id_files(n_groups)
    per_step = gpm * world * grad_accum
    steps = 3 * n_groups // per_step  # a few epochs
    streams = [_take(_dataset(path, tokenizer, r, world, gpm, grad_accum), steps * grad_accum) for r in range(world)]
    seen = []
    for s in range(steps):
        # a step's groups in stream order: microbatch-major, then rank
        step = [g for j in range(grad_accum) for r in range(world) for g in streams[r][s * grad_accum + j]]
        assert len(step) == per_step
        seen.extend(step)
    # every epoch is a permutation: each group once before any group twice
    for e in range(len(seen) // n_groups):
        assert sorted(seen[e * n_groups : (e + 1) * n_groups]) == list(range(n_groups))


def test_padding_free_steps_hold_each_completion_once_balanced_by_tokens(tmp_path, tokenizer):
    """Every completion of a step lands in exactly one rank's microbatch, with the padded layout's advantages."""
    rows = [{"prompt_ids": [g], "completion_ids": [i] + [7] * (1 + (5 * g + 3 * i) % 9), "reward": float(i + g % 3),
             "group": g} for g in range(8) for i in range(2)]
    path = write(tmp_path / "r.jsonl", rows)
    world, grad_accum, steps = 2, 2, 4

    def microbatches(cfg, rank):
        idx = index(path, tokenizer, seq_len=12)
        plan = BatchPlan(group_size=2, groups_per_microbatch=1, grad_accum=grad_accum, dp_rank=rank, dp_world_size=world)
        it = iter(RolloutDataset(idx, plan, Collate(12, 0, cfg, 2, pack_multiple=2), seed=3))
        return [next(it)[0] for _ in range(steps * grad_accum)]

    def completions(batch):  # (group, member) -> (advantage, input tokens) of each completion
        r = batch["rollouts"]
        if not r.packed:
            return {tuple(batch["input"][b, :2].tolist()): (r.advantages[b].item(), int(r.seq_lens[b])) for b in range(len(r.seq_lens))}
        assert batch["input"].shape[1] % 2 == 0  # a multiple of pack_multiple
        starts = torch.nonzero(batch["positions"][0] == 0).view(-1)[: len(r.seq_lens)]
        return {tuple(batch["input"][0, s : s + 2].tolist()): (r.advantages[b].item(), int(r.seq_lens[b]))
                for b, s in enumerate(starts.tolist())}

    per_step = {}
    for cfg in (PADDED, GRPO()):
        mbs = [microbatches(cfg, rank) for rank in range(world)]
        per_step[cfg.padding_free] = []
        for step in range(steps):
            parts = [completions(mbs[rank][step * grad_accum + j]) for rank in range(world) for j in range(grad_accum)]
            assert sum(map(len, parts)) == len({k for p in parts for k in p}) == 8  # 4 groups of 2, each once
            per_step[cfg.padding_free].append({k: v for p in parts for k, v in p.items()})
            if cfg.padding_free:
                loads = [sum(n for _, n in p.values()) for p in parts]
                assert max(loads) - min(loads) <= max(n for p in parts for _, n in p.values())
    assert per_step[True] == per_step[False]  # the same completions per step, with the same advantages and lengths


def test_shuffle_is_deterministic_per_seed_and_epoch(id_files, tokenizer):
    path = id_files(20)
    ds = _dataset(path, tokenizer, 0, 1)
    assert ds.stream.epoch_order(0).tolist() == _dataset(path, tokenizer, 0, 1).stream.epoch_order(0).tolist()
    assert ds.stream.epoch_order(0).tolist() != ds.stream.epoch_order(1).tolist()
    assert ds.stream.epoch_order(0).tolist() != _dataset(path, tokenizer, 0, 1, seed=4).stream.epoch_order(0).tolist()


def test_state_dict_resumes_at_the_same_row(id_files, tokenizer):
    path = id_files(5)
    straight = _take(_dataset(path, tokenizer, 1, 2, grad_accum=2), 12)  # crosses epoch boundaries
    ds = _dataset(path, tokenizer, 1, 2, grad_accum=2)
    it = iter(ds)
    first = [_group_ids(next(it)) for _ in range(7)]  # stops mid-step
    resumed = _dataset(path, tokenizer, 1, 2, grad_accum=2)
    resumed.load_state_dict(ds.state_dict())
    assert first + _take(resumed, 5) == straight
    other = _dataset(id_files(6), tokenizer, 1, 2, grad_accum=2)
    with pytest.raises(RolloutError, match="6 valid groups, but the checkpoint's data position is in a stream of 5"):
        other.load_state_dict(ds.state_dict())


def test_batch_std_uses_the_whole_global_batch(tmp_path, tokenizer):
    rows = [{"prompt_ids": [g], "completion_ids": [i, 7], "reward": r, "group": g}
            for g, rs in enumerate([(0.0, 1.0), (0.0, 3.0)]) for i, r in enumerate(rs)]
    path = write(tmp_path / "r.jsonl", rows)
    adv = {}
    for rank in (0, 1):
        ds = _dataset(path, tokenizer, rank, 2, cfg=GRPO(advantage_norm="batch_std", padding_free=False))
        inputs, _ = next(iter(ds))
        adv[inputs["input"][0, 0].item()] = inputs["rollouts"].advantages.tolist()
    std = torch.tensor([0.0, 1.0, 0.0, 3.0]).std().item()
    assert adv[0] + adv[1] == pytest.approx([-0.5 / std, 0.5 / std, -1.5 / std, 1.5 / std], rel=1e-4)
