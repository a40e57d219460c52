"""plugin.data.evaluation: held-out prompts split over DP ranks, scored by the reward functions, eval/* figures,
the completions file, and greedy decoding through the sampler. torchrun runs with it are in test_smollm2.py."""

import json
from types import SimpleNamespace

import pytest
import torch

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO, build_model, parse_config
from plugin.data.evaluation import EVAL_BATCH, GRPOEvaluator, build_grpo_evaluator
from plugin.data.online import sample_key
from plugin.generation.engine import build_sampler
from plugin.generation.sampler import Samples
from test_data import write


class KeySampler:
    """Completion of key k: [k % 5 + 10] * (k % 3 + 1) and EOS; records its calls."""

    def __init__(self, eos):
        self.eos, self.calls = eos, []

    def generate(self, prompts, keys, turns=None):
        self.calls.append(len(prompts))
        comps = [[k % 5 + 10] * (k % 3 + 1) + [self.eos] for k in keys]
        return Samples(comps, [[-0.5] * len(c) for c in comps], [False] * len(comps))


class Logger:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, metrics))


def evaluator(tmp_path, *overrides, dp_rank=0, dp_world_size=1, n_prompts=5):
    rows = [{"prompt": f"Q: {i}", "target": i} for i in range(n_prompts)]
    path = write(tmp_path / "heldout.jsonl", rows)
    cfg = parse_config("--validation.enable", "--validation.dataset_path", path, "--validation.local_batch_size", "2",
                       "--online.reward_funcs", "reward_fns:length,reward_fns:unit_on_even_target",
                       "--job.dump_folder", str(tmp_path), "--training.steps", "7", "--online.max_new_tokens", "4",
                       *overrides)
    tok = HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer"))
    pd = SimpleNamespace(dp_enabled=False, tp_enabled=False)
    ev = build_grpo_evaluator(cfg, dp_world_size, dp_rank, tok, pd, SimpleNamespace(logger=Logger()))
    ev.sampler, ev.model = KeySampler(tok.eos_id), "the model"
    return ev, tok


def test_rounds_split_prompts_over_ranks_with_equal_calls(tmp_path):
    ev, _ = evaluator(tmp_path, dp_rank=1, dp_world_size=2)
    assert ev._rounds() == [[2, 3], []]  # 5 prompts, 2 per rank per call: the second call has only rank 0's
    assert evaluator(tmp_path, dp_rank=0, dp_world_size=2)[0]._rounds() == [[0, 1], [4]]
    ev, _ = evaluator(tmp_path, "--validation.steps", "1")
    assert ev._rounds() == [[0, 1]]
    assert [ev.should_validate(s) for s in range(1, 8)] == [True, False, False, False, False, False, True]


def test_figures_and_completions_file(tmp_path):
    ev, tok = evaluator(tmp_path, "--online.num_generations_eval", "2", "--online.eval_temperature", "0.7",
                        "--online.eval_log_completions")
    ev.validate(["the model"], step=3)
    assert ev.sampler.calls == [4, 4, 2]  # 2 prompts x 2 completions per call
    ((step, m),) = ev.metrics_processor.logger.logged
    keys = [sample_key(0, EVAL_BATCH, i, g) for i in range(5) for g in range(2)]
    lengths = [k % 3 + 2 for k in keys]  # with EOS: the `length` reward
    even = [1.0 if i % 2 == 0 else 0.5 for i in range(5) for _ in range(2)]
    assert step == 3
    assert m["eval/reward/length_mean"] == pytest.approx(sum(lengths) / 10)
    assert m["eval/reward/unit_on_even_target_mean"] == pytest.approx(sum(even) / 10)
    assert m["eval/reward_mean"] == pytest.approx((sum(lengths) + sum(even)) / 10)
    assert m["eval/full_reward_share"] == pytest.approx(0.6)  # length >= 1 always; the even targets 0, 2, 4
    assert m["eval/completion_length_mean"] == pytest.approx(sum(lengths) / 10)
    assert m["eval/truncated_share"] == 0
    rows = [json.loads(l) for l in (tmp_path / "eval" / "step-000003-dp0.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [f"Q: {i}" for i in range(5) for _ in range(2)]
    assert rows[1]["completion_ids"] == [keys[1] % 5 + 10] * (keys[1] % 3 + 1) + [tok.eos_id]
    assert rows[1]["rewards"] == {"length": lengths[1], "unit_on_even_target": 1.0}
    ev.validate(["the model"], step=4)  # the same keys every time: only the policy changes the draws
    assert ev.metrics_processor.logger.logged[1][1]["eval/reward_mean"] == m["eval/reward_mean"]


def test_missing_file_names_the_validation_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"\[validation\] dataset_path = '.*nope.jsonl': no such prompt file"):
        cfg = parse_config("--validation.enable", "--validation.dataset_path", str(tmp_path / "nope.jsonl"),
                           "--online.reward_funcs", "reward_fns:length")
        build_grpo_evaluator(cfg, 1, 0, HuggingFaceTokenizer(str(REPO / "plugin/assets/tokenizer")),
                             SimpleNamespace(dp_enabled=False, tp_enabled=False), None)


def test_greedy_temperature_draws_the_argmax():
    """The sampler at temperature 0 gives what an argmax loop over full forwards gives, on the debug model."""
    model, *_ = build_model("--training.seq_len", "16")
    prompts = [[1, 50, 60, 70], [1, 9], [1, 300, 301]]
    sampler = build_sampler(model, kv_cache=True, max_new_tokens=8, stop_ids=[2], temperature=0.0,
                            pad_id=0)
    samples = sampler.generate(prompts, [5, 6, 7])
    with torch.no_grad():
        for prompt, completion in zip(prompts, samples.completions):
            tokens = list(prompt)
            for _ in completion:
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
                if tokens[-1] == 2:
                    break
            assert tokens[len(prompt):] == completion
    # other keys, the same draws
    assert sampler.generate(prompts, [1, 2, 3]).completions == samples.completions
