"""gpt-oss GGUF in, read by slimml itself: the file's tensors as the Hugging Face folder OpenAI ships.

transformers 4.57 does not read gpt-oss from GGUF, and 5.24 fails on every gpt-oss file with YaRN (all of
them: it reads ``rope.scaling.*`` values from the wrong part of the field). llama.cpp's converter
(``conversion/gpt_oss.py``) writes the model so that the inverse is a renaming plus two layouts:

- the experts' gate and up come as two stacked tensors (experts, inter, hidden); OpenAI interleaves
  them, gate on even and up on odd output rows, in one ``gate_up_proj`` (and its bias);
- MXFP4 experts (GGML type 39: per block of 32 values one E8M0 scale byte, then 16 bytes whose low
  nibbles are values 0-15 and high nibbles 16-31) become OpenAI's ``_blocks`` (two codes a byte, low
  nibble first) and ``_scales`` (the same byte: ``2 ** (scale - 127)``), code for code, so the fused
  exporter decodes the file's own values and nothing is quantized twice;
- float experts (an F16/F32/BF16 file) are stored as OpenAI's float layout, (experts, in, out).

Other tensors of any GGML type are dequantized to float32 by gguf-py. The tokenizer is a byte-level
BPE from the file's vocabulary and merges with the pre-tokenizer its ``tokenizer.ggml.pre`` names (the
o200k pattern for ``gpt-4o``), its special tokens, and the file's chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import SourceError

ARCH = "gpt-oss"
MXFP4 = 39  # GGMLQuantizationType.MXFP4
# llama.cpp's GPT4O pre-tokenizer (llama-vocab.cpp), the split in gpt-oss's own tokenizer.json
_O200K = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
))
_PRE_TOKENIZERS = {"gpt-4o": _O200K}
_STOPS = ("<|return|>", "<|call|>", "<|endoftext|>")  # gpt-oss's generation_config.json stops
_NAMES = {  # llama.cpp's name in a block -> transformers' (gpt-oss)
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"attn_{a}.{k}": f"self_attn.{b}_proj.{k}" for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
       for k in ("weight", "bias")},
}


def gpt_oss_folder(path: Path, folder: Path) -> None:
    """Write the gpt-oss GGUF at ``path`` as a Hugging Face folder: config, safetensors (one file a layer), tokenizer."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    config = _config(reader, tensors)
    folder.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    _save(folder / "model-top.safetensors", {hf: _float(tensors[g]) for hf, g in top.items() if g in tensors}, index)
    for i in range(config["num_hidden_layers"]):
        _save(folder / f"model-layer{i:03d}.safetensors", _layer(tensors, i, _all_mxfp4(tensors)), index)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    _tokenizer(reader, folder, config)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """GptOssConfig's values from the file's fields (llama.cpp's ``set_gguf_parameters``, inverted)."""
    def need(key: str) -> Any:
        value = _field(reader, f"{ARCH}.{key}")
        if value is None:
            raise SourceError(f"the gpt-oss GGUF has no {ARCH}.{key} field; re-make it with a current llama.cpp "
                              "(convert_hf_to_gguf.py), or convert the original Hugging Face folder.")
        return value

    layers, experts = int(need("block_count")), int(need("expert_count"))
    if "blk.0.ffn_gate_exps.weight" not in tensors:
        raise SourceError("the gpt-oss GGUF has no experts in its first layer (blk.0.ffn_gate_exps); download or re-make the file.")
    vocab = int(tensors["token_embd.weight"].shape[-1])
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": vocab,
        "hidden_size": int(need("embedding_length")), "intermediate_size": int(need("expert_feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": int(need("attention.head_count_kv")), "head_dim": int(need("attention.key_length")),
        "num_local_experts": experts, "num_experts_per_tok": int(need("expert_used_count")),
        "sliding_window": int(need("attention.sliding_window")),
        # llama.cpp's swa pattern for gpt-oss: even layers windowed, odd ones full (the Hugging Face config's order)
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": int(need("context_length")), "rope_theta": float(need("rope.freq_base")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")), "hidden_act": "silu",
        "attention_bias": True, "tie_word_embeddings": "output.weight" not in tensors, "swiglu_limit": 7.0,
        "initializer_range": 0.02, "router_aux_loss_coef": 0.9, "output_router_logits": False, "use_cache": True,
        "attention_dropout": 0.0, "torch_dtype": "float32",
    }
    if _field(reader, f"{ARCH}.rope.scaling.type") == "yarn":
        config["rope_scaling"] = {
            "rope_type": "yarn", "factor": float(need("rope.scaling.factor")),
            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
            "beta_fast": float(_field(reader, f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(_field(reader, f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    if _all_mxfp4(tensors):  # (a file that mixes types has its experts written as floats)
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    for key in ("bos", "eos", "padding"):
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    return config


def _all_mxfp4(tensors: dict[str, Any]) -> bool:
    return all(t.tensor_type == MXFP4 for name, t in tensors.items() if name.endswith("_exps.weight"))


def _float(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(t.data, t.tensor_type), np.float32)


def _layer(tensors: dict[str, Any], i: int, mxfp4: bool) -> dict[str, np.ndarray]:
    """Layer ``i``'s tensors under transformers' gpt-oss names; ``mxfp4``: the experts as OpenAI's MXFP4 blocks."""
    blk, out = f"blk.{i}.", {}
    for g, hf in _NAMES.items():
        for name in (blk + g, blk + g.removesuffix(".weight")):  # (the sinks: without ".weight" in early files)
            if name in tensors:
                out[f"model.layers.{i}.{hf}"] = _float(tensors[name])
                break
    missing = [hf for hf in _NAMES.values() if f"model.layers.{i}.{hf}" not in out and not hf.endswith("bias")]
    if missing:
        raise SourceError(f"the gpt-oss GGUF has no {missing[0]} for layer {i} (llama.cpp's blk.{i}.*); download or re-make the file.")
    pre = f"model.layers.{i}.mlp.experts."
    gate, up, down = (tensors[f"{blk}ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
    if mxfp4:  # gate/up rows interleaved, as OpenAI stores them: (experts, 2 inter, hidden / 32, ...)
        (gb, gs), (ub, us) = _openai_mxfp4(gate), _openai_mxfp4(up)
        out[pre + "gate_up_proj_blocks"] = _interleave(gb, ub, axis=1)
        out[pre + "gate_up_proj_scales"] = _interleave(gs, us, axis=1)
        out[pre + "down_proj_blocks"], out[pre + "down_proj_scales"] = _openai_mxfp4(down)
    else:  # float experts: (experts, in, out)
        out[pre + "gate_up_proj"] = _interleave(_float(gate), _float(up), axis=1).transpose(0, 2, 1).copy()
        out[pre + "down_proj"] = _float(down).transpose(0, 2, 1).copy()
    out[pre + "gate_up_proj_bias"] = _interleave(_float(tensors[f"{blk}ffn_gate_exps.bias"]),
                                                 _float(tensors[f"{blk}ffn_up_exps.bias"]), axis=1)
    out[pre + "down_proj_bias"] = _float(tensors[f"{blk}ffn_down_exps.bias"])
    return out


def _interleave(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
    """``a`` on even and ``b`` on odd indices of ``axis``."""
    return np.stack((a, b), axis=axis + 1).reshape(*a.shape[:axis], 2 * a.shape[axis], *a.shape[axis + 1:])


def _openai_mxfp4(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """A GGML MXFP4 tensor's raw blocks as OpenAI's ``_blocks`` (..., blocks, 16) and ``_scales`` (..., blocks)."""
    raw = np.asarray(t.data, np.uint8)
    raw = raw.reshape(*raw.shape[:-1], raw.shape[-1] // 17, 17)
    scales, qs = raw[..., 0].copy(), raw[..., 1:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # GGML: values 0-15 low nibbles, 16-31 high
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales


def _save(path: Path, tensors: dict[str, np.ndarray], index: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    index.update({name: path.name for name in tensors})


def _tokenizer(reader: Any, folder: Path, config: dict[str, Any]) -> None:
    """A fast tokenizer from the file's byte-level BPE: vocabulary, merges, the pre-tokenizer it names, special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise SourceError(f"the gpt-oss GGUF's tokenizer is {_field(reader, 'tokenizer.ggml.model')!r}, where gpt-oss "
                          "has a byte-level BPE ('gpt2'); re-make the file with llama.cpp's convert_hf_to_gguf.py.")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=True)
    tok = Tokenizer(bpe)
    pattern = _PRE_TOKENIZERS.get(str(_field(reader, "tokenizer.ggml.pre")))
    split = [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)] if pattern else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([*split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not split)])
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind in (3, 4)])
    name = {k: tokens[config[f"{k}_token_id"]] for k in ("bos", "eos", "pad") if config.get(f"{k}_token_id") is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in name.items()})
    template = _field(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = str(template)
    fast.save_pretrained(str(folder))
    # the answer ends at eos and at OpenAI's own stops (its generation_config's); not at <|end|> (a GGUF's
    # eot), which closes each message of the harmony format, the reasoning before the answer among them
    ends = [config["eos_token_id"]] if "eos_token_id" in config else []
    ends += [i for i, t in enumerate(tokens) if t in _STOPS and types[i] in (3, 4) and i not in ends]
    GenerationConfig(bos_token_id=config.get("bos_token_id"), eos_token_id=ends or None,
                     pad_token_id=config.get("pad_token_id")).save_pretrained(str(folder))
