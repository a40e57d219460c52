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
    grpo_config.validate_job(cfg)
    cfg = parse("--grpo.beta", "0.1", "--grpo.logprob_chunk_size", "8")
    assert cfg.grpo.beta == 0.1 and cfg.grpo.logprob_chunk_size == 8


def test_every_field_has_a_default_and_a_docstring():
    source = (REPO / "plugin/config.py").read_text()
    for section in (grpo_config.GRPO, grpo_config.ReferenceModel, grpo_config.RolloutData, grpo_config.Online):
        for f in dataclasses.fields(section):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
            # the line after the field is its one-line docstring
            lines = source.splitlines()
            i = next(i for i, l in enumerate(lines) if l.strip().startswith(f"{f.name}:"))
            assert lines[i + 1].strip().startswith('"""'), f.name


@pytest.mark.parametrize(
    "section, values, message",
    [
        ("GRPO", dict(kl_estimator="k4"), r"\[grpo\] kl_estimator = 'k4' is not one of \['k1', 'k2', 'k3'\]"),
        ("GRPO", dict(loss_aggregation="sum"), r"\[grpo\] loss_aggregation = 'sum' is not one of"),
        ("GRPO", dict(advantage_norm="rank"), r"\[grpo\] advantage_norm = 'rank' is not one of"),
        ("GRPO", dict(clip_low=1.0), r"\[grpo\] clip_low = 1.0 must be in \[0, 1\)"),
        ("GRPO", dict(clip_high=-0.1), r"\[grpo\] clip_high = -0.1 must be >= 0"),
        ("GRPO", dict(beta=-1.0), r"\[grpo\] beta = -1.0 must be"),
        ("GRPO", dict(temperature=0.0), r"\[grpo\] temperature = 0.0 must be > 0"),
        ("GRPO", dict(group_size=1), r"\[grpo\] group_size = 1 must be 0"),
        ("GRPO", dict(importance_sampling_level="sequence", use_bias_correction_kl=True),
         r"\[grpo\] use_bias_correction_kl = true is not supported with \[grpo\] importance_sampling_level"),
        ("GRPO", dict(kl_max=-1.0), r"\[grpo\] kl_max = -1.0 must be >= 0"),
        ("GRPO", dict(kl_log_ratio_clamp=-1.0), r"\[grpo\] kl_log_ratio_clamp = -1.0 must be >= 0"),
        ("GRPO", dict(logprob_chunk_size=-1), r"\[grpo\] logprob_chunk_size = -1 must be >= 0"),
        ("RolloutData", dict(format="csv"), r"\[rollout_data\] format = 'csv' is not one of"),
        ("RolloutData", dict(on_error="ignore"), r"\[rollout_data\] on_error = 'ignore' is not one of"),
        ("RolloutData", dict(chat_template="User: {question}"), r"\[rollout_data\] chat_template = .* one field is \{prompt\}"),
        ("RolloutData", dict(chat_template="no field"), r"\[rollout_data\] chat_template"),
        ("RolloutData", dict(chat_template="{prompt} }"), r"\[rollout_data\] chat_template"),
    ],
)
def test_bad_values_name_the_key(section, values, message):
    with pytest.raises(ValueError, match=message):
        getattr(grpo_config, section)(**values)


def test_bad_toml_value_fails_while_parsing(tmp_path):
    """A value from the TOML file is checked when the config is built, before anything else runs."""
    toml = (REPO / "train_configs/debug_cpu.toml").read_text().replace('kl_estimator = "k3"', 'kl_estimator = "k4"')
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    from torchtitan.config import ConfigManager

    with pytest.raises(ValueError, match=r"\[grpo\] kl_estimator = 'k4' is not one of"):
        ConfigManager().parse_args(["--job.config_file", str(path)])


def test_bad_cli_value_names_the_key(capsys):
    for args, message in (
        (["--grpo.kl_estimator", "k4"], "invalid choice 'k4' for argument '--grpo.kl-estimator'"),
        (["--grpo.clip_low", "1.0"], "[grpo] clip_low = 1.0 must be in [0, 1)"),
    ):
        with pytest.raises(SystemExit):
            parse(*args)
        assert message in " ".join(capsys.readouterr().err.replace("│", " ").split()), args


def test_choices_are_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    assert "k1,k2,k3" in out.replace(" ", "") or "{k1,k2,k3}" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--grpo.logprob_chunk_size", "5"], r"\[grpo\] logprob_chunk_size = 5 must be a multiple of"),
        (["--grpo.logprob_chunk_tokens", "7"], r"\[grpo\] logprob_chunk_tokens = 7 must be a multiple of"),
        (["--parallelism.pipeline_parallel_degree", "2"], r"pipeline_parallel_degree = 2: pipeline parallelism is not supported"),
        (["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--activation_checkpoint.mode", "selective"],
         r"set \[activation_checkpoint\] mode = \"none\""),
        (["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--activation_checkpoint.mode", "full"],
         r"set \[activation_checkpoint\] mode = \"none\""),
        (["--parallelism.context_parallel_degree", "2"], r"context_parallel_degree = 2: context parallelism is not supported"),
        (["--validation.enable", "--online.reward_funcs", "m:f"], r"\[validation\] enable = true evaluates on a "
         r"held-out prompt file: set \[validation\] dataset_path"),
        (["--validation.enable", "--validation.dataset_path", "p.jsonl"],
         r"\[validation\] enable = true scores .* with \[online\] reward_funcs"),
        (["--validation.enable", "--validation.dataset_path", "p.jsonl", "--online.reward_funcs", "m:f",
          "--online.num_generations_eval", "4"],
         r"\[online\] num_generations_eval = 4 with \[online\] eval_temperature = 0 \(greedy\) draws identical"),
        # a separate generator (plugin.generation.remote)
        (["--online.max_staleness", "1"], r"\[online\] max_staleness = 1 needs a separate generator"),
        (["--online.enable", "--online.reward_funcs", "m:f", "--online.generator_mode", "local",
          "--online.max_staleness", "1"], r"\[online\] max_staleness = 1 trains on batches drawn by older weights: "
         r"set \[online\] behavior_logprobs = \"sampler\""),
        (["--online.generator_mode", "local"], r"\[online\] generator_mode = \"local\" samples online batches"),
        (["--online.enable", "--online.reward_funcs", "m:f", "--online.generator_mode", "remote"],
         r"\[online\] generator_mode = \"remote\" needs \[online\] generator_port"),
        (["--online.enable", "--online.reward_funcs", "m:f", "--online.generator_mode", "remote",
          "--online.generator_port", "29600", "--online.generator_host", "no-such-host.invalid"],
         r"\[online\] generator_host = 'no-such-host.invalid' does not resolve"),
        (["--online.enable", "--online.reward_funcs", "m:f", "--online.generator_mode", "local",
          "--online.generator_devices", "4096"], r"\[online\] generator_devices = \[4096\]: cores \[4096\] are not"),
        (["--checkpoint.enable", "--checkpoint.initial_load_path", "outputs/no_such_run/step-60", "--job.dump_folder",
          "/nonexistent_dump"], r"\[checkpoint\] initial_load_path = 'outputs/no_such_run/step-60' is not a folder"),
    ],
)
def test_bad_combinations_name_the_keys(overrides, message):
    with pytest.raises(ValueError, match=message):
        grpo_config.validate_job(parse(*overrides))


def test_validate_job_runs_once_at_start_up(monkeypatch):
    """The job's checks run once, when the first of the GRPO TrainSpec's builders asks for the job's GRPOJob."""
    import plugin.job
    import plugin.scoring.loss
    import plugin.runtime.metrics

    calls = []
    monkeypatch.setattr(plugin.job, "validate_job", lambda cfg: calls.append(cfg))
    cfg = parse()
    plugin.scoring.loss.build_grpo_loss(cfg)
    plugin.scoring.loss.build_grpo_loss(cfg)
    plugin.job.GRPOJob.of(cfg)
    assert calls == [cfg]


# every key of the plugin's sections, with a value out of its range ("" where any value is in range)
OUT_OF_RANGE = {
    "grpo": dict(clip_low=-0.1, clip_high=-1.0, dual_clip=0.5, behavior_ratio_cap=0.5, importance_sampling_level="seq",
                 entropy_coef=-1.0,
                 beta=float("inf"), kl_estimator="k0", use_bias_correction_kl="", kl_log_ratio_clamp=-1.0,
                 kl_max=-1.0, loss_aggregation="mean", horizon=-1, advantage_norm="std", advantage_eps=0.0,
                 group_size=1, temperature=-1.0, logprob_chunk_size=-2, logprob_chunk_tokens=-1,
                 logprob_chunk_mib=float("nan"), fused_policy_pass="", padding_free="", on_nonfinite="ignore"),
    "reference_model": dict(compile="", checkpoint_path="", checkpoint_format="", sync_steps=-1, sync_alpha="",
                            offload=""),
    "rollout_data": dict(format="", on_error="", chat_template="{other}", chat_template_path=""),
    "online": dict(enable="", num_generations=1, max_new_tokens=0, stop_token_ids=[-1], reward_funcs=["no_colon"],
                   reward_weights=[float("nan")], reward_model_max_token_len=0, num_iterations=0, kv_cache="",
                   log_completions="",
                   num_generations_eval=0, eval_temperature=-1.0, eval_log_completions="",
                   filter_groups="", max_num_gen_batches=-1, behavior_logprobs="vllm",
                   mask_truncated_completions="", max_num_seqs=-1, stop_check_every=-1, compile_decode="",
                   tools=["no_colon"], max_tool_calling_iterations=-2, tool_call_format="", tool_timeout=-1.0,
                   use_vllm="", vllm_mode="remote", vllm_tensor_parallel_size=-1, vllm_gpu_memory_utilization=1.5,
                   vllm_enable_sleep_mode="", vllm_max_model_length=-1, vllm_seed_per_request="",
                   generator_mode="server", generator_tensor_parallel_size=0, generator_host="", generator_port=70000,
                   generator_devices=[-1], generator_timeout=0.0, max_staleness=-1),
    "moe": dict(router_bias_update_rate=-1.0, router_replay="R1"),
}
SECTIONS = {"grpo": grpo_config.GRPO, "reference_model": grpo_config.ReferenceModel,
            "rollout_data": grpo_config.RolloutData, "online": grpo_config.Online, "moe": grpo_config.Moe}


def test_compile_decode_needs_the_kv_cache():
    with pytest.raises(ValueError, match=r"\[online\] compile_decode = True must be false with \[online\] kv_cache = false"):
        grpo_config.Online(kv_cache=False, compile_decode=True)


def test_the_fuzz_table_covers_every_key():
    for name, section in SECTIONS.items():
        assert set(OUT_OF_RANGE[name]) == {f.name for f in dataclasses.fields(section)}, name


@pytest.mark.parametrize("section, key", [(s, k) for s, keys in OUT_OF_RANGE.items() for k in keys])
@pytest.mark.parametrize("kind", ["wrong_type", "out_of_range", "empty"])
def test_every_key_rejects_bad_values_by_name(section, key, kind):
    """Each key set to a wrong type, an out-of-range and an empty value: the section names the key.

    Building the section is what torchtitan's config parser does with a TOML value, before any
    process group or model exists. Some keys accept any string, so "" or a path is no error there.
    """
    field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key)
    is_list = getattr(field.type, "__origin__", None) is list
    # [1] is a fine list[int]: a list key's wrong type is a scalar
    value = {"wrong_type": 7 if is_list else [1], "out_of_range": OUT_OF_RANGE[section][key], "empty": ""}[kind]
    if is_list:  # a list's bad item is named by its index
        with pytest.raises(ValueError, match=rf"\[{section}\] {key}(\[0\])? = "):
            SECTIONS[section](**{key: value})
        return
    if field.type is str and value == "":
        SECTIONS[section](**{key: value})  # "" means "none" for these: no checkpoint, no chat template
        return
    if (section, key) == ("reference_model", "sync_alpha") and kind != "wrong_type":
        value = {"out_of_range": 0.0, "empty": ""}[kind]
        with pytest.raises(ValueError, match=rf"\[{section}\] {key} = "):
            SECTIONS[section](sync_steps=2, **{key: value})
        return
    with pytest.raises(ValueError, match=rf"\[{section}\] {key} = "):
        SECTIONS[section](**{key: value})
