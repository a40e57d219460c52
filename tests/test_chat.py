"""Conversational prompts: plugin.data.chat renders message lists as transformers' apply_chat_template does, rollout
and prompt files take them, errors name file, line and field, and reward functions get TRL's conversational shapes.

The bundled 2,048-token tokenizer gets a template of our own that uses what real templates use (tojson, namespace,
loopcontrols, raise_exception, bos_token); SmolLM2's own template is checked in test_smollm2.py.
"""

import json
import shutil

import numpy as np
import pytest

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from conftest import REPO
from plugin.data.chat import ChatTemplate
from plugin.data.prompts import Prompt, load_prompts
from plugin.data.rewards import reward_completions
from plugin.data.rollouts import Encoder, RolloutError, index_rollouts
from test_data import VOCAB, write

# Qwen-like: a default system message, a namespace, tojson of a non-ASCII/HTML value, {% break %}, an unknown role raises
TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system=false) %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = true %}{% break %}{% endif %}{% endfor %}"
    "{% if not ns.system %}<|sys|>{{ {'note': 'défaut <b>&</b>'} | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n  {{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi {{ x }} {% y %}  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c\n\nd"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "naïve 日本語 🤖", "name": "extra keys pass through"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """The bundled tokenizer with TEMPLATE in its tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    shutil.copytree(REPO / "plugin/assets/tokenizer", folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))
    return folder


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return HuggingFaceTokenizer(str(tok_dir))


def encoder(tokenizer, folder, seq_len=128, template=""):
    return Encoder(tokenizer, VOCAB, seq_len, template, ChatTemplate.from_folder(str(folder)))


def test_renders_as_transformers(tok_dir, tokenizer):
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle: pip install -e '.[dev]'")
    oracle = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    chat, enc = ChatTemplate.from_folder(str(tok_dir)), encoder(tokenizer, tok_dir)
    for messages in CHATS:
        text = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat.render(messages) == text
        ids = oracle.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert enc.prompt({"prompt": messages}) == ids["input_ids"]
    assert chat.render(CHATS[0]) == ('<|begin_of_text|><|sys|>{"note": "défaut <b>&</b>"}\n'
                                     "<|user|>\n  What is 2 + 3?<|end_of_text|>\n<|assistant|>\n")


def test_chat_template_jinja_file_wins_and_a_named_list_gives_the_default(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
         "eos_token": {"content": "</s>", "special": True}}))
    assert ChatTemplate.from_folder(str(tmp_path)).render(CHATS[0]) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_folder(str(tmp_path)).render(CHATS[0]) == "J"


def test_rollout_rows_take_message_prompts_and_format_strings_keep_working(tmp_path, tokenizer, tok_dir):
    rows = [{"prompt": CHATS[0], "completion": " 5", "reward": 1.0, "group": 0},
            {"prompt": CHATS[0], "completion": " 6", "reward": 0.0, "group": 0},
            {"prompt": "2+3=", "completion": " 5", "reward": 1.0, "group": 1},
            {"prompt": "2+3=", "completion": " 4", "reward": 0.0, "group": 1}]
    rendered = ChatTemplate.from_folder(str(tok_dir)).render(CHATS[0])
    # Parquet cannot hold text and lists in one column: its file has the message rows only
    for path in (write(tmp_path / "r.jsonl", rows), write(tmp_path / "r.parquet", rows[:2] * 2)):
        c = index_rollouts(path, encoder(tokenizer, tok_dir, template="Q: {prompt}")).read(np.arange(4))
        # a rendered chat gets no extra BOS: the template writes its own {{ bos_token }}
        assert c[0].tokens[: c[0].prompt_len] == tokenizer.encode(rendered, add_bos=False, add_eos=False)
        assert c[0].tokens[: c[0].prompt_len].count(tokenizer.bos_id) == 1
    assert c[2].tokens[: c[2].prompt_len] == c[0].tokens[: c[0].prompt_len]
    c = index_rollouts(write(tmp_path / "r.jsonl", rows), encoder(tokenizer, tok_dir, template="Q: {prompt}")).read(
        np.arange(4))
    assert c[2].tokens[: c[2].prompt_len] == tokenizer.encode("Q: 2+3=", add_bos=True, add_eos=False)


@pytest.mark.parametrize("prompt, message", [
    ({"role": "user", "content": "x"}, r"field 'prompt' has type dict, not str or a list of messages"),
    ([], r"field 'prompt' is an empty list of messages"),
    (["hi"], r"field 'prompt\[0\]' has type str, not a message"),
    ([{"role": "user"}], r"field 'prompt\[0\]' has no 'content'"),
    ([{"content": "x"}], r"field 'prompt\[0\]' has no 'role'"),
    ([{"role": "user", "content": ["x"]}], r"field 'prompt\[0\].content' has type list, not str"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "x"}],
     r"field 'prompt': the chat template of .* raised: unknown role tool"),
])
def test_bad_message_lists_name_file_line_and_field(tmp_path, tokenizer, tok_dir, prompt, message):
    path = write(tmp_path / "p.jsonl", [{"prompt": CHATS[0]}, {"prompt": prompt}])
    with pytest.raises(RolloutError, match=rf"{path}:2: {message}"):
        load_prompts(path, encoder(tokenizer, tok_dir), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")
    rollouts = write(tmp_path / "r.jsonl", [{"prompt": prompt, "completions": ["a", "b"], "rewards": [0, 1]}])
    with pytest.raises(RolloutError, match=rf"{rollouts}:1: {message}"):
        index_rollouts(rollouts, encoder(tokenizer, tok_dir))


def test_a_tokenizer_without_a_chat_template_is_named_when_a_row_needs_one(tmp_path, tokenizer):
    folder = REPO / "plugin/assets/tokenizer"
    path = write(tmp_path / "p.jsonl", [{"prompt": "text is fine"}, {"prompt": CHATS[0]}])
    with pytest.raises(RolloutError, match=rf"{path}:2: field 'prompt' is a list of messages, which needs a chat "
                                           rf"template, and {folder} \(\[model\] hf_assets_path\) has none"):
        load_prompts(path, encoder(tokenizer, folder), tokenizer, fmt="auto", max_new_tokens=4, on_error="raise")


def test_reward_functions_get_trls_conversational_shapes(tmp_path, tokenizer, tok_dir):
    path = write(tmp_path / "p.jsonl", [{"prompt": CHATS[1], "answer": 5}, {"prompt": "2+3=", "answer": 5}])
    prompts, _ = load_prompts(path, encoder(tokenizer, tok_dir), tokenizer, fmt="auto", max_new_tokens=4,
                              on_error="raise")
    assert prompts[0].text == CHATS[1] and prompts[1].text == "2+3="
    assert reward_completions(prompts, ["5", "6"]) == [[{"role": "assistant", "content": "5"}], "6"]
    assert reward_completions([Prompt([1], CHATS[0], {}, "")], [""]) == [[{"role": "assistant", "content": ""}]]
