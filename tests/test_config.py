import dataclasses

import pytest

from conftest import REPO, parse_config
from plugin import config as grpo_config


parse = parse_config


def test_sections_merge_with_defaults():
    cfg = parse()
    assert cfg.grpo.beta == 0.04 and cfg.grpo.kl_estimator == "k3"
    assert cfg.reference_model.compile is False
    assert (cfg.rollout_data.format, cfg.rollout_data.on_error, cfg.rollout_data.chat_template) == ("auto", "raise", "")
    grpo_config.validate(cfg)
    cfg = parse("--grpo.beta", "0.1", "--grpo.logprob_chunk_size", "8")
    assert cfg.grpo.beta == 0.1 and cfg.grpo.logprob_chunk_size == 8


def test_every_field_has_a_default_and_a_docstring():
    source = (REPO / "plugin/config.py").read_text()
    for section in (grpo_config.GRPO, grpo_config.ReferenceModel, grpo_config.RolloutData):
        for f in dataclasses.fields(section):
            assert f.default is not dataclasses.MISSING, f.name
            # the line after the field is its one-line docstring
            lines = source.splitlines()
            i = next(i for i, l in enumerate(lines) if l.strip().startswith(f"{f.name}:"))
            assert lines[i + 1].strip().startswith('"""'), f.name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--grpo.kl_estimator", "k4"], r"\[grpo\] kl_estimator = 'k4' is not one of"),
        (["--grpo.loss_aggregation", "sum"], r"\[grpo\] loss_aggregation = 'sum' is not one of"),
        (["--grpo.advantage_norm", "rank"], r"\[grpo\] advantage_norm = 'rank' is not one of"),
        (["--grpo.clip_low", "1.0"], r"\[grpo\] clip_low = 1.0 must be in \[0, 1\)"),
        (["--grpo.clip_high", "-0.1"], r"\[grpo\] clip_high = -0.1 must be >= 0"),
        (["--grpo.beta", "-1"], r"\[grpo\] beta = -1.0 must be"),
        (["--grpo.temperature", "0"], r"\[grpo\] temperature = 0.0 must be > 0"),
        (["--grpo.group_size", "1"], r"\[grpo\] group_size = 1 must be 0"),
        (["--grpo.logprob_chunk_size", "5"], r"\[grpo\] logprob_chunk_size = 5 must be a multiple of"),
        (["--parallelism.pipeline_parallel_degree", "2"], r"pipeline_parallel_degree = 2: pipeline parallelism is not supported"),
        (["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--activation_checkpoint.mode", "selective"],
         r"set \[activation_checkpoint\] mode = \"none\""),
        (["--parallelism.context_parallel_degree", "2"], r"context_parallel_degree = 2: context parallelism is not supported"),
        (["--rollout_data.format", "csv"], r"\[rollout_data\] format = 'csv' is not one of"),
        (["--rollout_data.on_error", "ignore"], r"\[rollout_data\] on_error = 'ignore' is not one of"),
        (["--rollout_data.chat_template", "User: {question}"], r"\[rollout_data\] chat_template = .* one field is \{prompt\}"),
        (["--rollout_data.chat_template", "no field"], r"\[rollout_data\] chat_template"),
        (["--rollout_data.chat_template", "{prompt} }"], r"\[rollout_data\] chat_template"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo_config.validate(parse(*overrides))
