"""Rollout files -> a checked index of whole groups; rows are read back lazily, a batch at a time.

Formats: JSONL (one JSON object per line) and Parquet. Layouts: flat rows (one completion per
row, joined into groups by `group`) and grouped rows (a prompt with all its completions). Field
names, the token layout and the EOS rule are in docs/rollouts.md.

One pass over the file checks and tokenizes every row, and keeps per completion only what
batching needs: where its row is (byte offset or Parquet row), its slot in a grouped row, its
reward, its completion and prompt lengths and the completion tokens in the loss: 28 bytes (37 during the
pass, with the group key and a flag).
A batch re-reads and re-tokenizes only its own rows.

Simplifications:
1. Flat-row group ids are kept as 64-bit hashes. Two ids that collide (odds ~3e-8 for a million
   groups) make one group of twice the size, which the group-size check rejects.
2. A Parquet row group is the unit of reading: a batch decodes each row group it touches.
3. Every group has the same size, so a microbatch is a fixed number of whole groups.
"""

import hashlib
import json
import math
import os
from array import array
from dataclasses import dataclass
from itertools import groupby

import numpy as np
from torchtitan.tools.logging import logger

FORMATS = ("jsonl", "parquet")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
FIELDS = ("prompt", "prompt_ids", "completion", "completion_ids", "reward", "group",
          "completions", "completions_ids", "rewards", "logprobs", "ref_logprobs")
GROUPED_FIELDS = ("completions", "completions_ids", "rewards")  # any of these: the file has grouped rows
MAX_QUOTED = 5  # problems quoted in the log when rows are skipped
PARQUET_BATCH_ROWS = 1024


class RolloutError(ValueError):
    """A rollout row that cannot be trained on; the message names the file, the line (or row) and the field."""


class BadRow(Exception):
    """What is wrong with a row, before the row's location is added."""


@dataclass
class Completion:
    tokens: list[int]  # prompt + completion token ids
    prompt_len: int
    reward: float
    logprobs: list[float] | None = None  # behaviour log-prob per completion token, NaN where unknown
    ref_logprobs: list[float] | None = None  # the reference model's, NaN where unknown
    # per completion token: 1 the model's, 0 a tool turn's (never trained on); None: every token is the model's
    tool_mask: list[int] | None = None
    # an MoE sampler's routing (R3): [len(tokens) - 1, layers, k] int16, the experts of each input position
    routed_experts: np.ndarray | None = None

    @property
    def loss_length(self) -> int:
        """The completion tokens in the loss: the model's own."""
        n = len(self.tokens) - self.prompt_len
        return n if self.tool_mask is None else sum(self.tool_mask)


def _field(value, name: str, types: tuple, what: str):
    """`value` if it is there and its type is exactly one of `types` (a bool is not an int here)."""
    if value is None:
        raise BadRow(f"missing field '{name}'")
    if type(value) not in types:
        raise BadRow(f"field '{name}' has type {type(value).__name__}, not {what}")
    return value


def _number(value, name: str) -> float:
    _field(value, name, (int, float), "a number")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise BadRow(f"field '{name}' is {value}, not a finite number")
    return number


def _list(value, name: str) -> list:
    return _field(value, name, (list,), "a list")


def _one_of(row: dict, text_name: str, ids_name: str) -> tuple[object, str, bool]:
    """The value of whichever of the text / token-id fields the row gives, its name, and whether it is ids."""
    text, ids = row.get(text_name), row.get(ids_name)
    if text is not None and ids is not None:
        raise BadRow(f"fields '{text_name}' and '{ids_name}' are both given; give one")
    if ids is not None:
        return ids, ids_name, True
    if text is None:
        raise BadRow(f"missing field '{text_name}' (or '{ids_name}')")
    return text, text_name, False


def _logprobs(value, name: str, given: int, total: int) -> list[float]:
    """Behaviour (or reference) log-probs for `given` row tokens, NaN-padded to `total` (an appended EOS has none)."""
    value = _list(value, name)
    if len(value) not in (given, total):
        extra = f" ({total} with the appended EOS)" if total != given else ""
        raise BadRow(f"field '{name}' has {len(value)} values, the completion has {given} tokens{extra}")
    out = []
    for v in value:
        if v is None:
            out.append(math.nan)  # unknown (so is NaN): the loss treats the token as on-policy
        elif (type(v) is float and not math.isinf(v)) or (type(v) is int and abs(v) < 2**53):
            out.append(float(v))
        else:
            raise BadRow(f"field '{name}' holds {v!r}, not a finite log-prob or null")
    return out + [math.nan] * (total - len(out))


def report(problems: list[str], on_error: str, error: str) -> None:
    """A bad row's error: raised with on_error = "raise", else quoted in `problems` (the first few) for the log."""
    if on_error == "raise":
        raise RolloutError(error) from None
    if len(problems) < MAX_QUOTED:
        problems.append(error)


def _group_key(row: dict) -> int:
    """A flat row's `group` as a 64-bit hash: an int and its decimal string stay different groups."""
    value = _field(row.get("group"), "group", (int, str), "str or int")
    data = (b"i:" if type(value) is int else b"s:") + str(value).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Encoder:
    """Row fields -> token ids, with the checks that need tokens: vocabulary and length."""

    def __init__(self, tokenizer, vocab_size: int, seq_len: int, chat_template: str = "", chat=None,
                 tools: list | None = None, stop_text: str | None = None):
        """`chat_template`: the format string text prompts go into; `chat`: the tokenizer's ChatTemplate
        (plugin.data.chat), which renders message-list prompts, showing the model `tools` ([online] tools,
        plugin.generation.tools' Tool list); `stop_text`: the text of the stop id that ends an assistant turn (multi-turn
        completions given as messages)."""
        self.tokenizer, self.vocab_size, self.seq_len, self.chat_template = tokenizer, vocab_size, seq_len, chat_template
        self.chat, self.tools, self.stop_text = chat, tools or [], stop_text
        self.schemas = [t.schema for t in self.tools] or None  # None: the template renders no tools
        self.bos_id, self.eos_id = getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)
        self._last_prompt: tuple[str | None, list[int]] = (None, [])

    def _text_ids(self, text: str) -> list[int]:
        hf = getattr(self.tokenizer, "tokenizer", None)
        if hf is not None:
            # torchtitan's HuggingFaceTokenizer.encode keeps the post-processor's specials (e.g. a
            # BOS) even with add_bos=False; a completion must not get one
            return hf.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_bos=False, add_eos=False)

    def _ids(self, value, name: str) -> list[int]:
        value = _list(value, name)
        if not all(type(t) is int for t in value):
            raise BadRow(f"field '{name}' is not a list of integer token ids")
        self._check_vocab(value, name)
        return value

    def _check_vocab(self, ids: list[int], name: str) -> None:
        if not ids:
            raise BadRow(f"field '{name}' is empty")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise BadRow(f"field '{name}' has token id {hi if hi >= self.vocab_size else lo}, "
                       f"outside the model's vocabulary [0, {self.vocab_size})")

    def prompt(self, row: dict) -> list[int]:
        """Prompt ids: `prompt_ids` as given; a text `prompt` through the format-string template, with BOS in
        front; a message-list `prompt` through the tokenizer's chat template, as transformers tokenizes it."""
        value, name, is_ids = _one_of(row, "prompt", "prompt_ids")
        if is_ids:
            return self._ids(value, name)
        if value == self._last_prompt[0]:  # the rows of a group repeat their prompt
            return self._last_prompt[1]
        if isinstance(value, list):
            if self.chat is None:
                raise BadRow(f"field '{name}' is a list of messages, and this run has no chat template to render it")
            # no BOS added: a template that wants one writes {{ bos_token }} (transformers adds no specials either)
            ids = self._text_ids(self.chat.render(value, name, tools=self.schemas))
        else:
            value = _field(value, name, (str,), "str or a list of messages")
            ids = self._text_ids(self.chat_template.format(prompt=value) if self.chat_template else value)
            if self.bos_id is not None and ids[:1] != [self.bos_id]:
                ids = [self.bos_id] + ids
        self._check_vocab(ids, "prompt")
        self._last_prompt = (value, ids)
        return ids

    def completion(self, prompt: list[int], value, name: str, is_ids: bool, reward: float, logprobs, ref_logprobs,
                   at: str = "", prompt_messages=None) -> Completion:
        """Token ids as given, text tokenized with EOS appended, or a multi-turn trajectory (a message list after
        a message-list prompt) rendered by the chat template, its tool turns masked; `at` is "[k]" for a grouped
        row's k-th."""
        name += at
        tool_mask = None
        if is_ids:
            ids = self._ids(value, name)
        elif isinstance(value, list):
            ids, tool_mask = self._trajectory(prompt_messages, value, name)
        else:
            if type(value) is not str:  # not _field: a null in a grouped row's list is no missing field
                raise BadRow(f"field '{name}' has type {type(value).__name__}, not str")
            if not value:
                raise BadRow(f"field '{name}' is empty")
            ids = self._text_ids(value)
            self._check_vocab(ids, name)
        given = len(ids)
        if not is_ids and tool_mask is None and self.eos_id is not None:
            ids.append(self.eos_id)
        if len(prompt) + len(ids) - 1 > self.seq_len:  # the input drops the last token
            raise BadRow(f"field '{name}': prompt + completion is {len(prompt) + len(ids)} tokens, "
                       f"more than [training] seq_len + 1 = {self.seq_len + 1}")
        behaviour = None if logprobs is None else _logprobs(logprobs, f"logprobs{at}", given, len(ids))
        ref = None if ref_logprobs is None else _logprobs(ref_logprobs, f"ref_logprobs{at}", given, len(ids))
        return Completion(prompt + ids, len(prompt), reward, behaviour, ref, tool_mask)

    def _trajectory(self, prompt_messages, messages: list, name: str) -> tuple[list[int], list[int]]:
        """A multi-turn completion's ids, each piece tokenized on its own as the sampler appends them (plugin.data.chat's
        trajectory_segments), and its tool mask: 0 on the template's and the tools' tokens."""
        if not isinstance(prompt_messages, list):
            raise BadRow(f"field '{name}' is a list of messages (a multi-turn trajectory), which needs the prompt as "
                         "a list of messages too")
        if self.chat is None or self.stop_text is None:
            raise BadRow(f"field '{name}' is a list of messages, and this run has no chat template to render it")
        ids, mask = [], []
        for text, trained in self.chat.trajectory_segments(prompt_messages, messages, self.schemas, self.stop_text):
            piece = self._text_ids(text)
            ids += piece
            mask += [int(trained)] * len(piece)
        self._check_vocab(ids, name)
        return ids, mask

    def flat(self, row: dict) -> Completion:
        reward = _number(row.get("reward"), "reward")
        value, name, is_ids = _one_of(row, "completion", "completion_ids")
        return self.completion(self.prompt(row), value, name, is_ids, reward, row.get("logprobs"),
                               row.get("ref_logprobs"), prompt_messages=row.get("prompt"))

    def grouped(self, row: dict) -> list[Completion]:
        value, name, is_ids = _one_of(row, "completions", "completions_ids")
        items, rewards = _list(value, name), _list(row.get("rewards"), "rewards")
        if not items:
            raise BadRow(f"field '{name}' is empty")
        if len(rewards) != len(items):
            raise BadRow(f"field 'rewards' has {len(rewards)} values for {len(items)} completions")
        rewards = [_number(r, f"rewards[{k}]") for k, r in enumerate(rewards)]
        per_completion = {}
        for field in ("logprobs", "ref_logprobs"):
            lists = row.get(field)
            if lists is not None and len(_list(lists, field)) != len(items):
                raise BadRow(f"field '{field}' has {len(lists)} lists for {len(items)} completions")
            per_completion[field] = lists or [None] * len(items)
        logprobs, ref_logprobs = per_completion["logprobs"], per_completion["ref_logprobs"]
        prompt = self.prompt(row)
        return [self.completion(prompt, item, name, is_ids, rewards[k], logprobs[k], ref_logprobs[k], f"[{k}]",
                                row.get("prompt")) for k, item in enumerate(items)]


def _parse_json(raw: bytes) -> dict | BadRow:
    try:
        row = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        return BadRow(f"not valid JSON ({getattr(e, 'msg', e)})")
    if not isinstance(row, dict):
        return BadRow(f"expected a JSON object, got {type(row).__name__}")
    return row


class JsonlFile:
    grouped: bool | None = None  # known once a row is read

    def __init__(self, path: str):
        self.path = path

    def where(self, line: int) -> str:
        return f"{self.path}:{line}"

    def where_offset(self, offset: int) -> str:
        """`where` of the row at a byte offset: counts the lines before it (only for a few messages)."""
        lines, done = 1, 0
        with open(self.path, "rb") as f:
            while done < offset:
                chunk = f.read(min(2**24, offset - done))
                lines, done = lines + chunk.count(b"\n"), done + len(chunk)
        return self.where(lines)

    def scan(self):
        """(line, byte offset, row or BadRow) for every non-blank line."""
        with open(self.path, "rb") as f:
            offset = 0
            for line, raw in enumerate(f, start=1):
                if raw.strip():
                    yield line, offset, _parse_json(raw)
                offset += len(raw)

    def read(self, offsets) -> dict[int, dict | BadRow]:
        rows = {}
        with open(self.path, "rb") as f:
            for offset in sorted(set(offsets)):
                f.seek(offset)
                rows[offset] = _parse_json(f.readline())
        return rows


class ParquetFile:
    def __init__(self, path: str, every_column: bool = False):
        self.path = path
        meta = self._open().metadata
        names = meta.schema.to_arrow_schema().names
        # a rollout file's other columns are never decoded; a prompt file's all reach the reward functions
        self.columns = None if every_column else [c for c in names if c in FIELDS]
        self.grouped = any(c in names for c in GROUPED_FIELDS)
        self.starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        self.largest_row_group = max((meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)), default=0)

    def where(self, row: int) -> str:
        return f"{self.path}: row {row}"

    where_offset = where  # a Parquet row's offset is its row number

    def _open(self):
        import pyarrow.parquet as pq

        # pre-buffering keeps every row group read so far in memory until the file is closed
        return pq.ParquetFile(self.path, pre_buffer=False)

    def scan(self):
        row = 0
        for batch in self._open().iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=self.columns):
            for values in batch.to_pylist():
                yield row, row, values
                row += 1

    def read(self, offsets) -> dict[int, dict]:
        file, rows = self._open(), {}
        wanted = sorted(set(int(o) for o in offsets))
        # each row group a batch touches is decoded once
        for rg, members in groupby(wanted, key=lambda o: int(np.searchsorted(self.starts, o, side="right")) - 1):
            table = file.read_row_group(rg, columns=self.columns)
            for o in members:
                rows[o] = table.slice(o - int(self.starts[rg]), 1).to_pylist()[0]
        return rows


def rollout_format(path: str, fmt: str = "auto") -> str:
    """The file format: `fmt` itself, or with "auto" the one its suffix names."""
    if fmt != "auto":
        return fmt
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"[training] dataset_path = {path!r}: the suffix {suffix!r} names no rollout format "
                         f"({', '.join(SUFFIXES)}); set [rollout_data] format to one of {list(FORMATS)}")
    return SUFFIXES[suffix]


@dataclass
class RolloutIndex:
    """Where each completion of every valid group is, its reward and its length; group-major.

    Completion k of group g is entry g * group_size + k of every array.
    """

    path: str
    source: "JsonlFile | ParquetFile"
    encoder: Encoder
    grouped: bool
    group_size: int
    offsets: np.ndarray  # [N] int64: the row's byte offset (JSONL) or row number (Parquet)
    slots: np.ndarray  # [N] int32: the completion's position in a grouped row; 0 for flat rows
    rewards: np.ndarray  # [N] float32
    lengths: np.ndarray  # [N] int32: completion tokens, including an appended EOS
    prompt_lengths: np.ndarray  # [N] int32: prompt tokens (a padding-free batch is balanced by prompt + completion)
    loss_lengths: np.ndarray  # [N] int32: completion tokens in the loss (a multi-turn one's tool turns are not)
    rows: int  # rows in the file
    skipped_rows: int
    skipped_groups: int
    stamp: tuple[int, int] = (0, 0)  # the file's (size, mtime_ns) when the indexing pass began

    def check_unchanged(self) -> None:
        """Stop with the file's name if it is no longer the file that was indexed: its rows would be other rows."""
        st = os.stat(self.path)
        if (st.st_size, st.st_mtime_ns) != self.stamp:
            raise RolloutError(
                f"{self.path}: the rollout file changed after it was indexed at start-up (size {self.stamp[0]} -> "
                f"{st.st_size} bytes, modified since); restart the run to index it again"
            )

    @property
    def num_groups(self) -> int:
        return len(self.offsets) // self.group_size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.offsets, self.slots, self.rewards, self.lengths, self.prompt_lengths,
                                      self.loss_lengths))

    def read(self, items: np.ndarray) -> list[Completion]:
        """The completions at index entries `items`, read from the file and tokenized again."""
        self.check_unchanged()
        rows = self.source.read(self.offsets[items])
        parsed: dict[int, list[Completion]] = {}  # a grouped row is encoded once for all its slots
        out = []
        for i in items:
            offset = int(self.offsets[i])
            try:
                if offset not in parsed:
                    row = rows[offset]
                    if isinstance(row, BadRow):
                        raise row
                    parsed[offset] = self.encoder.grouped(row) if self.grouped else [self.encoder.flat(row)]
                c = parsed[offset][self.slots[i]]
            except BadRow as e:
                raise RolloutError(f"{self.path} (row at {offset}): {e}; the file changed after it was indexed") from None
            if len(c.tokens) - c.prompt_len != self.lengths[i]:
                raise RolloutError(f"{self.path} (row at {offset}): the completion changed after the file was indexed")
            out.append(c)
        return out


class _Columns:
    """Growable per-completion arrays of the indexing pass: the index's 28 bytes, the group key and ok."""

    def __init__(self):
        self.offset, self.key = array("q"), array("Q")
        self.slot, self.reward, self.length, self.prompt_length = array("i"), array("f"), array("i"), array("i")
        self.loss_length, self.ok = array("i"), array("b")

    def add(self, offset: int, key: int, slot: int, reward: float, length: int, ok: bool, prompt_length: int = 0,
            loss_length: int = 0) -> None:
        for column, value in zip((self.offset, self.key, self.slot, self.reward, self.length, self.prompt_length,
                                  self.loss_length, self.ok),
                                 (offset, key, slot, reward, length, prompt_length, loss_length, ok)):
            column.append(value)

    def numpy(self, name: str, dtype) -> np.ndarray:
        return np.frombuffer(getattr(self, name), dtype=dtype) if len(self.ok) else np.zeros(0, dtype)


def index_rollouts(path: str, encoder: Encoder, *, fmt: str = "auto", group_size: int = 0,
                   on_error: str = "raise") -> RolloutIndex:
    """Check and index every row of a rollout file.

    A bad row raises a RolloutError naming the file, line (or row) and field; with
    on_error = "skip" its whole group is left out instead, and the skipped rows are counted
    and logged. A group of one completion, or of another size than the rest (or than
    `group_size` when it is not 0), is a bad group.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[training] dataset_path = {path!r}: no such rollout file")
    st = os.stat(path)  # before the pass: a change during it shows at the first read
    source = JsonlFile(path) if rollout_format(path, fmt) == "jsonl" else ParquetFile(path)
    if isinstance(source, ParquetFile) and source.largest_row_group > 256 * 2**20:
        logger.warning(f"{path}: a row group of {source.largest_row_group / 2**20:.0f} MiB is decoded whole for "
                       "every batch that touches it; write the file with smaller row groups (docs/rollouts.md)")
    cols, problems, rows, orphans = _Columns(), [], 0, 0
    grouped = source.grouped
    for line, offset, row in source.scan():
        rows += 1
        key = None
        try:
            if isinstance(row, BadRow):
                raise row
            if grouped is None:
                grouped = any(name in row for name in GROUPED_FIELDS)
            # a grouped row is its own group; a flat row's key comes first so a bad row can spoil its group
            key = rows if grouped else _group_key(row)
            completions = encoder.grouped(row) if grouped else [encoder.flat(row)]
        except BadRow as e:
            report(problems, on_error, f"{source.where(line)}: {e}")
            if key is None:
                orphans += 1  # no group to spoil
            else:
                cols.add(offset, key, 0, math.nan, 0, ok=False)
            continue
        for slot, c in enumerate(completions):
            cols.add(offset, key, slot, c.reward, len(c.tokens) - c.prompt_len, ok=True, prompt_length=c.prompt_len,
                     loss_length=c.loss_length)
    if rows == 0:
        raise RolloutError(f"{path}: no rollout rows")

    keys, ok = cols.numpy("key", np.uint64), cols.numpy("ok", np.bool_)
    if len(keys) == 0:
        raise RolloutError(f"{path}: no valid groups; first problems:\n  " + "\n  ".join(problems))
    # Groups in order of first appearance. Usually each group is one run of adjacent rows, and
    # the runs need no more memory than one entry per group; otherwise group ids are sorted.
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    if len(np.unique(keys[starts])) == len(starts):
        gid, first, sizes = None, starts, np.diff(np.append(starts, len(keys)))
        spoiled = np.logical_or.reduceat(~ok, starts)
    else:
        _, first, inverse, sizes = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        gid, first, sizes = rank[inverse.ravel()], first[order], sizes[order]
        del inverse
        spoiled = np.bincount(gid[~ok], minlength=len(order)) > 0
    sized = ~spoiled & (sizes >= 2)
    expected = group_size or (int(np.bincount(sizes[sized]).argmax()) if sized.any() else 0)
    offsets = cols.numpy("offset", np.int64)
    for g in np.flatnonzero(~spoiled & (sizes != expected))[: MAX_QUOTED - len(problems)]:
        problem = _size_problem(source, grouped, int(offsets[first[g]]), int(sizes[g]), expected, group_size)
        report(problems, on_error, problem)
    keep = ~spoiled & (sizes == expected)
    if not keep.any():
        raise RolloutError(f"{path}: no valid groups of {expected or 'at least 2'} completions"
                           + ("; first problems:\n  " + "\n  ".join(problems) if problems else ""))

    # the kept groups' entries, group-major; adjacent groups that are all kept need no copy
    if gid is None:
        sel = slice(None) if keep.all() else np.repeat(keep, sizes)
    else:
        by_group = np.argsort(gid, kind="stable")  # a stable sort keeps each group's file order
        sel = by_group[keep[gid[by_group]]]
    skipped_groups = int((~keep).sum())
    skipped_rows = orphans + (skipped_groups if grouped else len(keys) - int(sizes[keep].sum()))
    if skipped_rows:
        logger.warning(
            f"{path}: skipped {skipped_rows} of {rows} rows ({skipped_groups} groups) as [rollout_data] "
            f"on_error = 'skip'; the first problems:\n  " + "\n  ".join(problems)
        )
    return RolloutIndex(
        path=path, source=source, encoder=encoder, grouped=bool(grouped), group_size=expected,
        offsets=offsets[sel], slots=cols.numpy("slot", np.int32)[sel],
        rewards=cols.numpy("reward", np.float32)[sel], lengths=cols.numpy("length", np.int32)[sel],
        prompt_lengths=cols.numpy("prompt_length", np.int32)[sel], loss_lengths=cols.numpy("loss_length", np.int32)[sel],
        rows=rows, skipped_rows=skipped_rows, skipped_groups=skipped_groups, stamp=(st.st_size, st.st_mtime_ns),
    )


def _size_problem(source, grouped: bool, offset: int, size: int, expected: int, group_size: int) -> str:
    """The message for a group of the wrong size, located at its first row."""
    row = source.read([offset])[offset]
    count = f"{size} completion{'s' * (size != 1)}"
    if grouped:
        what = f"field '{'completions_ids' if row.get('completions_ids') is not None else 'completions'}' has {count}"
    else:
        what = f"field 'group' = {row.get('group')!r}: the group (first row here) has {count}"
    if size < 2:
        need = "GRPO needs at least 2 to compare rewards"
    elif group_size:
        need = f"[grpo] group_size = {group_size}"
    else:
        need = f"the file's most common group size is {expected}, and every group must have one size"
    return f"{source.where_offset(offset)}: {what}; {need}"
