"""The seam of the rollout engines, and the no-cache oracle the built-in engine is judged against.

`Sampler` is what the online dataset and evaluation call, whatever engine they hold: the built-in one
(plugin.generation.engine), vLLM (plugin.generation.vllm) or `NoCacheSampler` here, which re-runs the whole
sequence per new token. Every engine follows `resume_turns` for tool turns. The built-in engine and the
oracle draw with the same noise, so they pick the same tokens.

1. Full vocabulary at `temperature`, no top-k/top-p: the log-probs are exact.
2. Gumbel-max with float32 noise hashed from (key, token index, global vocab id): a sequence's
   draws depend on its key alone, not on the rank layout or the batch it shares. Under TP each
   rank scores its own vocab shard; one all-reduce of per-row candidates picks the token.
3. Every step goes through `model(...)` or `model.hidden_states(...)`, so FSDP's hooks run; compiled
   blocks run eagerly (`compile_decode` compiles the built-in engine's decode step itself).
4. The host looks at the stops every `check_every` steps: finished sequences leave the batch there,
   and between checks they keep decoding (discarded).
"""

import math
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication

from plugin.generation.sampling import _int64, local_vocab, row_seeds, sample_sharded
from plugin.runtime import internals


@dataclass
class Samples:
    completions: list[list[int]]  # new token ids per sequence; includes the stop id if one was drawn
    logprobs: list[list[float]]  # the sampler's log-prob of each new token, at the temperature (NaN: a tool token)
    truncated: list[bool]  # True: reached max_new_tokens without drawing a stop id (or a tool result would overflow it)
    # with `turns`: 1 where the model drew the token, 0 where a tool turn appended it; None: every token is drawn
    tool_mask: list[list[int]] | None = None
    # an MoE policy whose routing is captured ([moe] router_replay = "R3"): per sequence, the experts each input
    # position (prompt + completion but its last token) was routed to, [positions, layers, k] int16; else None
    routed_experts: list | None = None


class Turns(Protocol):
    """What a multi-turn row does after a turn that ended with a stop id (plugin.generation.tools' ToolTurns)."""

    def resume(self, rows: list[int], completions: list[list[int]], room: list[int]) -> list[list[int] | None]:
        """For each row, the ids to append before it generates again (a tool turn), or None: it is finished.

        `completions`: each row's completion so far, its turn's stop id last; `room`: the most ids that may be
        appended with one new token left in the budget. Ids longer than `room` end the row as truncated, without
        them: the caller rolls its own record of that turn back. Every rank calls it at once (TP peers alike).
        """
        ...


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None = None) -> Samples:
        """A completion for each of `prompts` (token ids, chat template applied), drawn with `keys[i]`.

        Every rank of the job calls it at once, each with its own prompts (TP peers with the same ones). With
        `turns`, a row whose turn ends with a stop id may get ids appended (`resume_turns`) and go on.
        The draws depend on the keys, the prompts and the weights only: not on the batch, the engine's
        slots or the rank layout (vLLM: on its seeding, docs/vllm.md)."""
        ...


@dataclass
class TurnOutcome:
    """What `resume_turns` decided for the rows whose turn ended with a stop id."""

    resumed: dict[int, list[int]] = field(default_factory=dict)  # row -> the ids appended after its stop id
    truncated: list[int] = field(default_factory=list)  # rows whose tool result would overflow the budget: ended


def resume_turns(turns: Turns, rows: list[int], completions: list[list[int]], max_new_tokens: int) -> TurnOutcome:
    """The tool-turn rule of every engine: `turns` says which rows go on after their stop id, with which ids.

    `completions`: each row's completion so far, its stop id last. A row may append at most what leaves one
    new token in the budget; a longer result ends the row as truncated, without it (the caller rolls its own
    record of that turn back). Rows that `turns` answers None for are finished."""
    room = [max_new_tokens - 1 - len(c) for c in completions]
    outcome = TurnOutcome()
    for b, more, fits in zip(rows, turns.resume(rows, completions, room), room):
        if more is None:
            continue
        if len(more) > fits:
            outcome.truncated.append(b)
        else:
            outcome.resumed[b] = list(more)
    return outcome


def _to_keys(keys: Sequence[int], device) -> torch.Tensor:
    for i, k in enumerate(keys):
        if not -(1 << 63) <= k < 1 << 64:
            raise ValueError(f"key {i} = {k} is not a 64-bit integer")
    return torch.tensor([_int64(k) for k in keys], dtype=torch.int64, device=device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _distributed() -> bool:
    """Whether a default process group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _max_rank(value: int, device) -> int:
    """The largest `value` over the ranks of the default process group."""
    if not _distributed():
        return value
    x = torch.tensor([value], device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return int(x.item())


def _any_rank(flag: bool, device) -> bool:
    """Whether `flag` is set on any rank of the default process group."""
    return bool(_max_rank(int(flag), device))


def max_prompt_tokens(seq_len: int, max_new_tokens: int) -> int:
    """The longest prompt that can be sampled from: its last new token is drawn at position
    len(prompt) + max_new_tokens - 2, and RoPE covers positions below [training] seq_len (the
    model's max_seq_len); also the longest whose completion fits a training sequence of seq_len + 1."""
    return seq_len + 1 - max_new_tokens


def check_prompts(prompts: list[list[int]], keys: list[int], max_seq_len: int, max_new_tokens: int, device) -> None:
    """Raise on every rank if a prompt on any rank cannot be sampled from, rather than leave peers waiting."""
    if len(keys) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(keys)} keys")
    error, limit = None, max_prompt_tokens(max_seq_len, max_new_tokens)
    for i, p in enumerate(prompts):
        if not 1 <= len(p) <= limit:
            error = (f"prompt {i} has {len(p)} tokens: it needs 1 to {limit} with max_new_tokens = {max_new_tokens} "
                     f"and RoPE positions below {max_seq_len} (the model's max_seq_len, [training] seq_len)")
            break
    if _any_rank(error is not None, device):
        raise ValueError(error or "a prompt on another rank cannot be sampled from (see that rank's error)")


@contextmanager
def generation_mode(model: nn.Module):
    """No grad, compiled blocks run eagerly, FSDP's parameters stay gathered across forwards; clean after.

    The root's own groups are left alone: torchtitan's root holds no parameters, and FSDP
    already keeps a root's gathered after forward. Every group's own reshard-after-forward
    setting is put back, everything is resharded at the end, and the root's per-iteration
    records reset, so the training forward that follows starts clean.
    """
    groups = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    saved = [(m, internals.reshards_after_forward(m)) for m in groups]
    for m in groups:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()  # gathered before the first forward too: the CPU's packed linears read the whole weights
    try:
        # fullgraph-compiled blocks would recompile for every new shape and for the swapped modules;
        # qwen3's TP plan makes the RoPE table a Replicate DTensor, which plain positions then index
        with torch.no_grad(), torch.compiler.set_stance("force_eager"), implicit_replication():
            yield
    finally:
        for m, reshard in saved:
            m.set_reshard_after_forward(reshard, recurse=False)
        internals.end_forward_only_iteration(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


class _BaseSampler:
    def __init__(self, model: nn.Module, *, max_new_tokens: int, stop_ids: Sequence[int], temperature: float,
                 pad_id: int, max_num_seqs: int = 0, check_every: int = 0,
                 autocast: Callable[[], AbstractContextManager] = nullcontext, compile_decode: bool = False):
        """`max_new_tokens` >= 1 and `temperature` >= 0 (0: greedy): [online] and [grpo] check them.

        autocast: the training forward's autocast (torchtitan's maybe_enable_amp), so generation
        computes in the trainer's dtype. The built-in engine's own (the oracle has no cache and no
        decode step to cap or compile): max_num_seqs, its KV cache slots (0: the call's rows);
        check_every, decode steps between the stop checks, the only host syncs of its decode loop (0: every step on
        a CPU, where a check syncs nothing and a finished row's steps until it are waste; 8 on a GPU);
        compile_decode, its decode step under torch.compile.
        """
        self.model, self.max_new_tokens, self.temperature, self.pad_id = model, max_new_tokens, temperature, pad_id
        self.autocast, self.compile_decode = autocast, compile_decode
        self._capture = None  # plugin.model.moe.Capture of the call in progress, when the routing is captured
        self.tp = model.scoring.seq_shards  # sequence parallel shards the sequence dim over the TP ranks
        self.max_seq_len = model.model_args.max_seq_len  # the RoPE table's length
        self.device = next(model.parameters()).device
        self.stop_ids, self.max_num_seqs = list(stop_ids), max_num_seqs
        self.check_every = check_every or (1 if self.device.type == "cpu" else 8)

    def _at(self, rows: torch.Tensor, positions: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Where the next forward's tokens sit, for a routing capture: token `source[i]` (default i) of the
        forward's input, flattened, is row `rows[i]`'s input at `positions[i]`."""
        if self._capture is not None:
            self._capture.at(rows, positions, source)

    def _positions(self, length: int, start: int = 0) -> torch.Tensor:
        """(1, length) positions from `start`; padding past the RoPE table reuses its last row."""
        return torch.arange(start, start + length, device=self.device).clamp_max(self.max_seq_len - 1)[None]

    def _padded(self, prompts: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] prompts, right-padded (or cut) to `length`."""
        out = torch.full((len(prompts), length), self.pad_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            out[b, :min(len(p), length)] = torch.tensor(p[:length])
        return out.to(self.device)


class NoCacheSampler(_BaseSampler):
    """The oracle: every step, one forward of each unfinished row's whole sequence, right-padded; rows of the
    default group's ranks step together. Rows in their turn draw until none is left on any rank; then
    `resume_turns` says which go on, and the next round draws those."""

    def generate(self, prompts: list[list[int]], keys: list[int], turns: Turns | None = None) -> Samples:
        check_prompts(prompts, keys, self.max_seq_len, self.max_new_tokens, self.device)
        n, N, tp, dev = len(prompts), self.max_new_tokens, self.tp, self.device
        # host: each row's whole sequence; row n fills a forward up to the TP degree (an empty rank still joins
        # every collective of its peers), its draws discarded
        seqs = [list(p) for p in prompts] + [[self.pad_id]]
        keys_t = _to_keys(list(keys) + [0], dev)
        out = Samples([[] for _ in range(n)], [[] for _ in range(n)], [True] * n,
                      [[] for _ in range(n)] if turns is not None else None)
        routing = getattr(self.model, "routing", None)
        captures = routing is not None and routing.captures_samples
        length = max(map(len, seqs)) + N + tp + 1
        with generation_mode(self.model), self.autocast(), \
                routing.capturing(n + 1, length, dev) if captures else nullcontext() as capture:
            self._capture = capture
            try:
                active = list(range(n))  # rows in their turn
                while True:
                    self._round(seqs, keys_t, active, out)
                    if turns is None:
                        break
                    stopped = [b for b in active if out.completions[b] and out.completions[b][-1] in self.stop_ids]
                    outcome = resume_turns(turns, stopped, [list(out.completions[b]) for b in stopped], N)
                    for b in stopped:
                        out.truncated[b] = b in outcome.truncated
                    for b, more in outcome.resumed.items():
                        seqs[b] += more
                        out.completions[b] += more
                        out.logprobs[b] += [math.nan] * len(more)
                        out.tool_mask[b] += [0] * len(more)
                    active = list(outcome.resumed)
                    if not _any_rank(bool(active), dev):
                        break
            finally:
                self._capture = None
        if captures:  # each sequence's input positions: its prompt and completion but the last token
            out.routed_experts = [capture.row(b, len(p) + len(c) - 1)
                                  for b, (p, c) in enumerate(zip(prompts, out.completions))]
        return out

    def _round(self, seqs: list[list[int]], keys_t: torch.Tensor, active: list[int], out: Samples) -> None:
        """Draw for the `active` rows until each stops or fills the budget, in step with every rank's rows."""
        N, tp, dev = self.max_new_tokens, self.tp, self.device
        live = list(active)
        for b in live:
            out.truncated[b] = True  # until it draws a stop id
        while _any_rank(bool(live), dev):
            rows = live + [len(seqs) - 1] * (_round_up(max(len(live), 1), tp) - len(live))  # padding: discarded
            lengths = torch.tensor([len(seqs[b]) for b in rows], device=dev)
            total = _round_up(max(len(seqs[b]) for b in rows), tp)
            tokens = self._padded([seqs[b] for b in rows], total)
            self._at(torch.tensor(rows, device=dev).repeat_interleave(total), torch.arange(total, device=dev).repeat(len(rows)))
            logits = self.model(tokens, positions=self._positions(total))  # [B', total, V], vocab-sharded under TP
            index = torch.arange(len(rows), device=dev)
            if isinstance(logits, DTensor):  # each row's last position, on the local vocab shard
                local_vocab(logits)  # raises for placements the sampler cannot read
                V = logits.shape[-1]
                logits = DTensor.from_local(logits.to_local()[index, lengths - 1], logits.device_mesh,
                                            _row_placements(logits), run_check=False, shape=(len(rows), V),
                                            stride=(V, 1))
            else:
                logits = logits[index, lengths - 1]
            local, shard = local_vocab(logits)
            cols = torch.tensor([len(out.completions[b]) if b < len(out.completions) else 0 for b in rows], device=dev)
            token, logprob = sample_sharded(local, shard, row_seeds(keys_t[rows], cols), self.temperature)
            still = []
            for b, t, lp in zip(live, token.tolist(), logprob.tolist()):
                seqs[b].append(t)
                out.completions[b].append(t)
                out.logprobs[b].append(lp)
                if out.tool_mask is not None:
                    out.tool_mask[b].append(1)
                if t in self.stop_ids:
                    out.truncated[b] = False
                elif len(out.completions[b]) < N:
                    still.append(b)
            live = still


def _row_placements(logits: DTensor) -> list:
    """A [B, V] row pick's placements from [B, T, V] logits': a vocab shard stays one."""
    return [Shard(1) if isinstance(p, Shard) else p for p in logits.placements]
