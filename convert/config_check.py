"""Refuse a model config the installed transformers would misread.

transformers ignores config keys it does not know and falls back to its defaults. A config
written by a newer transformers can hold settings under new names: transformers 5 keeps RoPE
under ``rope_parameters``, which 4.57 ignores, falling back to ``rope_theta = 10000``. SmolLM2
(``rope_theta`` 100000) converted that way is +8% perplexity while every check comparing the
artifact with the (equally misread) torch model passes. So a key that this transformers does
not know, in a config from a newer transformers, stops the conversion with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slimml.errors import ArtifactError, SlimmlError, SourceError

# keys that change nothing in the computation, whatever the version that wrote them
_HARMLESS = {
    "transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path", "_model_name_or_path",
    "auto_map", "model_type", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "_attn_implementation_autoset", "initializer_range", "quantization_config", "layer_types",
}

# keys newer transformers writes, and where the installed version wants what they hold
_MOVES = {
    "rope_parameters": "copy rope_parameters.rope_theta to a top-level \"rope_theta\" (and any other "
                       "rope_parameters entries, with rope_type, to \"rope_scaling\")",
}


def check_config(folder: str | Path) -> None:
    """Raise :class:`SourceError` when ``folder/config.json`` holds keys the installed transformers ignores.

    Only configs written by a newer transformers than the installed one are checked for unknown
    keys (older ones are what this version was written to read); ``rope_parameters`` without a
    top-level ``rope_theta`` is refused whatever the version, since it always means a misread RoPE.

    Raises:
        SourceError: one line naming the keys and the fix (upgrade transformers, or move the key).
    """
    path = Path(folder) / "config.json"
    config = _read(path)
    import transformers

    installed = transformers.__version__
    wrote = str(config.get("transformers_version") or "")
    _check_model_type(path, config, wrote, installed)
    _check_quantized(path, config)
    _check_classifier_pad(path, config)
    unknown = _unknown_keys(config)
    dangerous = [k for k in unknown if k in _MOVES]
    if "rope_parameters" in config and "rope_theta" not in config and "rope_parameters" not in dangerous:
        if _known_keys(config.get("model_type")) is not None and not _knows(config.get("model_type"), "rope_parameters"):
            # (a model type transformers does not know, its own code's: the exporter says what it does)
            dangerous.append("rope_parameters")
    if not dangerous and not (unknown and _newer(wrote, installed)):
        return
    keys = dangerous or unknown
    fixes = "; ".join(_move(k, config) for k in keys if k in _MOVES)
    by = f"transformers {wrote}" if wrote else "another transformers version"
    raise SourceError(
        f"{path} was written by {by} and holds {', '.join(repr(k) for k in keys)}, which the installed "
        f"transformers {installed} ignores, so the model would be converted wrongly with its defaults. Edit "
        f"config.json: {fixes or 'translate those keys to what this version reads, or remove them'}, or install the "
        f"transformers that wrote it (pip install 'transformers>={wrote or 5}'; the fused and torch exporters work with it)."
    )


def _move(key: str, config: dict[str, Any]) -> str:
    """Where the installed transformers wants what ``key`` holds: for a ``rope_parameters`` with one
    entry per layer type (transformers 5's Gemma 3), each type's theta has its own 4.57 key."""
    nested = config.get("rope_parameters") if key == "rope_parameters" else None
    if not (isinstance(nested, dict) and any(isinstance(v, dict) for v in nested.values())):
        return _MOVES[key]
    if not str(config.get("model_type", "")).startswith("gemma3"):
        return ("rope_parameters holds one entry per layer type: copy each type's values to the keys this "
                "version's config class reads for that type")
    return ("copy rope_parameters.full_attention.rope_theta to a top-level \"rope_theta\" (its other entries, "
            "with rope_type, to \"rope_scaling\") and rope_parameters.sliding_attention.rope_theta to "
            "\"rope_local_base_freq\"")


def _read(path: Path) -> dict[str, Any]:
    """``config.json`` as a dict; a file that is not a JSON object is refused in one line."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SourceError(f"{path} cannot be read ({e.strerror or type(e).__name__}); check its permissions.") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise SourceError(f"{path} is not valid JSON{where}; fix it, or save the model again with "
                          "`model.save_pretrained(folder)`.") from None
    if not isinstance(config, dict):
        raise SourceError(f"{path} holds a JSON {type(config).__name__}, not an object of config keys; save the "
                          "model again with `model.save_pretrained(folder)`.")
    return config


READ_QUANTIZED = ("mxfp4",)  # quantized checkpoints whose weights slimml decodes itself (gpt-oss's experts)


def _check_quantized(path: Path, config: dict[str, Any]) -> None:
    """Refuse a checkpoint quantized by a method slimml does not decode (GPTQ, AWQ, bitsandbytes,
    FP8...): transformers needs that method's own kernels to load it (GPTQ failed inside transformers
    with "name 'QuantizeConfig' is not defined"), and its integer weights are not the model's."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return
    method = str(quant.get("quant_method") or "unnamed")
    if method.lower() in READ_QUANTIZED:
        return
    bits = f", {quant['bits']}-bit" if isinstance(quant.get("bits"), int) else ""
    raise SourceError(f"{path.parent} is a {method}-quantized checkpoint (config.json's quantization_config{bits}); "
                      "slimml converts float checkpoints (float32, float16, bfloat16) and GGUF files: convert the "
                      "float model it was quantized from (then --quantize int4-weights or int8), or its GGUF file.")


def _check_classifier_pad(path: Path, config: dict[str, Any]) -> None:
    """Refuse a decoder's sequence classifier without ``pad_token_id``: it scores each text at its last
    token before the padding, found by that id, so transformers cannot run a batch of it (4.57's export
    failed with "unordered_map::at", and optimum-onnx asked for a --pad_token_id slimml does not have)."""
    import inspect

    import transformers

    if config.get("pad_token_id") is not None:
        return
    for name in config.get("architectures") or []:
        if not isinstance(name, str) or not name.endswith("ForSequenceClassification"):
            continue
        try:
            reads_pad = "pad_token_id" in inspect.getsource(getattr(transformers, name).forward)
        except (AttributeError, ImportError, OSError, TypeError):  # a class this transformers lacks: the loader says so
            continue
        if reads_pad:
            eos = config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            hint = f" (its eos id, {eos}, where the tokenizer has no pad token)" if isinstance(eos, int) else ""
            raise SourceError(f"{path.parent} is a {name}, which scores each text at its last token before the padding, "
                              "found by pad_token_id, and its config.json sets none; set \"pad_token_id\" in config.json to "
                              f"the tokenizer's pad id{hint}, then convert again.")


def _check_model_type(path: Path, config: dict[str, Any], wrote: str, installed: str) -> None:
    """Refuse a config without ``model_type``, or with one the installed transformers does not know
    (code the folder brings itself, ``auto_map``, is the exporter's to judge)."""
    if "auto_map" in config:
        return
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SourceError(f"{path} has no \"model_type\", so transformers cannot tell which model it is; add it "
                          "(e.g. \"model_type\": \"llama\"), or save the model again with `model.save_pretrained(folder)`.")
    from transformers import CONFIG_MAPPING

    if model_type in CONFIG_MAPPING:
        return
    by = f", written by transformers {wrote}," if wrote else ""
    raise SourceError(
        f"{path}{by} names model_type {model_type!r}, which the installed transformers {installed} does not know; "
        f"install a transformers that knows it (pip install -U transformers; slimml's fused and torch exporters work "
        "with transformers 5), or export it to ONNX yourself and convert the .onnx file."
    )


def _unknown_keys(config: dict[str, Any]) -> list[str]:
    """Top-level keys that the installed config class neither declares nor sets by default."""
    known = _known_keys(config.get("model_type"))
    if known is None:
        return []
    return sorted(k for k in config if k not in known and k not in _HARMLESS)


def _known_keys(model_type: Any) -> set[str] | None:
    from transformers import AutoConfig, PretrainedConfig

    try:
        cls_config = AutoConfig.for_model(str(model_type))
    except Exception:  # a model type this transformers does not know: the exporter says so
        return None
    known = set(cls_config.to_dict()) | set(PretrainedConfig().to_dict())
    known |= set(getattr(type(cls_config), "attribute_map", {}))
    import inspect

    known |= set(inspect.signature(type(cls_config).__init__).parameters)
    return known


def _knows(model_type: Any, key: str) -> bool:
    known = _known_keys(model_type)
    return known is not None and key in known


def _newer(wrote: str, installed: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(wrote).release[:2] > Version(installed).release[:2]
    except InvalidVersion:
        return False


def check_tokenizer(folder: str | Path) -> None:
    """Raise :class:`SourceError` when the folder's ``tokenizer.json`` or chat template is broken,
    before anything is exported (a model folder without them takes token ids, and has no chat).

    Raises:
        SourceError: one line naming the file, what is wrong, and the fix.
    """
    folder = Path(folder)
    tokenizer = folder / "tokenizer.json"
    if tokenizer.is_file():
        try:
            from tokenizers import Tokenizer

            Tokenizer.from_file(str(tokenizer))
        except Exception as e:  # tokenizers' own parse error, e.g. "EOF while parsing an object at line 1"
            why = (str(e).splitlines() or [type(e).__name__])[0][:160]
            raise SourceError(f"{tokenizer} is not a tokenizer the tokenizers library can read ({why}); save it "
                              "again with `tokenizer.save_pretrained(folder)`, or delete it to convert a model that "
                              "takes token ids only.") from None
    template, where = _chat_template(folder)
    if template is None:
        return
    from slimml.runtime.tasks.generation.chat import ChatTemplate

    try:  # compiled as the artifact's chat() will compile it (transformers' extensions and globals)
        chat = ChatTemplate(template, _special_tokens(folder), where=f"the chat template in {where}")
    except ArtifactError as e:  # "... does not parse (line N: why); fix the template or re-convert ..."
        message = str(e).split("; fix the template")[0]
        raise SourceError(f"{message}; fix it, or remove it to convert the model without a chat template.") from None
    try:  # a template may refuse some conversations (a system role), never a lone user message (bos_token given)
        chat.render([{"role": "user", "content": "Hello"}])
    except SlimmlError as e:
        if "(UndefinedError:" in str(e):  # a name the tokenizer's files may give at run time: chat() words it then
            return
        why = str(e).split(" failed to render these messages ", 1)[-1].split("; fix the messages")[0]
        raise SourceError(f"the chat template in {where} cannot render even one user message {why}; fix it, or "
                          "remove it to convert the model without a chat template.") from None


def check_generation_config(folder: str | Path) -> None:
    """Raise :class:`SourceError` when the folder's ``generation_config.json`` is not a JSON object
    or its ``eos_token_id`` is not ids: the artifact carries it, and generate stops at those ids.

    Raises:
        SourceError: one line naming the file, what is wrong, and the fix.
    """
    path = Path(folder) / "generation_config.json"
    config = _json_object(path, "fix it (`model.generation_config.save_pretrained(folder)` writes one), or remove it "
                                "to decode with slimml's defaults and the model's own end token")
    if config is None:
        return
    value = config.get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(type(i) is int for i in ids):  # old Llamas write -1 for "none": left as it is
        raise SourceError(f"{path}: eos_token_id is {json.dumps(value)[:60]}, not a token id or a list of them; fix "
                          "it (the ids are in tokenizer.json), or remove the key.")


def _special_tokens(folder: Path) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings, from tokenizer_config.json (and special_tokens_map.json)."""
    special: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            raw = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for key, value in raw.items() if isinstance(raw, dict) else ():
            value = value.get("content") if isinstance(value, dict) else value
            if key.endswith("_token") and isinstance(value, str):
                special[key] = value
    return special


def _chat_template(folder: Path) -> tuple[str | None, Path]:
    """The chat template as transformers finds it: ``chat_template.jinja``, else tokenizer_config.json's."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace"), path
    path = folder / "tokenizer_config.json"
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None, path  # transformers words a broken tokenizer_config.json itself
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return (template, path) if isinstance(template, str) and template.strip() else (None, path)


TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def check_tokenizer_files(folder: str | Path) -> None:
    """Raise :class:`SourceError` when a JSON file transformers reads the tokenizer with is not a JSON
    object: the tokenizer would not load, and the artifact would ship without one."""
    for name in TOKENIZER_JSON:
        _json_object(Path(folder) / name, "restore it (save the tokenizer again with `tokenizer.save_pretrained(folder)`), "
                                          "or delete it")


def _json_object(path: Path, fix: str) -> dict | None:
    """The JSON object in ``path`` (None where there is no such file), or one SourceError ending in ``fix``."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise SourceError(f"{path} is not valid JSON ({why}); {fix}.") from None
    if not isinstance(value, dict):
        raise SourceError(f"{path} holds a JSON {type(value).__name__}, not an object of settings; {fix}.")
    return value
