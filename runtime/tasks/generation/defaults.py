"""A decoder's own sampling settings: what its source's ``generation_config.json`` (the artifact's
copy) says, applied where the caller says nothing, as transformers' ``generate()``,
onnxruntime-genai and vLLM apply them (Qwen2.5-Instruct ships ``do_sample`` with temperature 0.7,
top-k 20, top-p 0.8 and a repetition penalty of 1.05; a model that says nothing decodes greedily)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

from slimml.errors import ConfigError
from slimml.runtime.tasks.generation.config import GenerationConfig, is_int
from slimml.runtime.tasks.limits import shown

TRANSFORMERS_TOP_K = 50  # transformers' GenerationConfig default: sampling keeps the 50 most likely tokens
# read where the file samples (do_sample), as transformers reads them
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
_UNAPPLIED = ("encoder_repetition_penalty", "num_beam_groups", "penalty_alpha", "diversity_penalty")
# named in the same warning whatever their value: banned and forced tokens, and lengths (generate()'s own
# max_new_tokens applies; a chat model's 2,048 or its context would run every call that long)
_IGNORED = ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias", "forced_bos_token_id",
            "forced_eos_token_id", "max_new_tokens", "max_length", "min_length")
_read: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its file's settings, for generate)


def file_settings(model: Any) -> dict[str, Any]:
    """The sampling fields the artifact's ``generation_config.json`` sets, as
    :class:`GenerationConfig` fields: ``repetition_penalty``, ``no_repeat_ngram_size``, ``num_beams`` (with
    ``length_penalty`` and ``early_stopping``; not with ``do_sample``), ``do_sample`` (only where true), and
    ``temperature``/``top_k``/``top_p``/``min_p``/``typical_p``/``epsilon_cutoff``/``eta_cutoff``,
    which apply where the generation samples
    (:meth:`GenerationConfig.of`: a file that does not sample decodes greedily, whatever
    temperature it also names, and samples at that temperature when a caller asks
    ``do_sample=True``, as transformers reads it). A value out of range is left out, with a
    warning; read once per loaded model (hash-checked as read)."""
    try:
        return dict(_read[model])
    except (KeyError, TypeError):
        pass
    from slimml.runtime.tasks.generation.chat import folder_json
    from slimml.runtime.tasks.generation.prompts import GENERATION_CONFIG

    folder = getattr(model, "folder", None)
    raw = folder_json(folder, GENERATION_CONFIG, model.manifest) if folder is not None else {}
    found: dict[str, Any] = {}
    if raw.get("repetition_penalty") not in (None, 1, 1.0):
        found["repetition_penalty"] = raw["repetition_penalty"]
    if raw.get("no_repeat_ngram_size") not in (None, 0):  # greedy or sampled, as transformers applies it
        found["no_repeat_ngram_size"] = raw["no_repeat_ngram_size"]
    if raw.get("min_new_tokens") not in (None, 0):  # the end held back: without it a reply could be empty
        found["min_new_tokens"] = raw["min_new_tokens"]
    if raw.get("num_beams") not in (None, 0, 1):  # beam search, where the generation does not sample
        if raw.get("do_sample") in (True, 1):
            logging.getLogger("slimml").warning("slimml: %s's generation_config.json sets num_beams=%r with do_sample "
                                                "(beam sampling), which slimml does not do; it samples without beams.",
                                                model.manifest.name, raw["num_beams"])
        else:
            found.update({k: raw[k] for k in ("num_beams", "length_penalty", "early_stopping") if raw.get(k) is not None})
    sample = raw.get("do_sample")
    if sample in (True, 1) and not isinstance(sample, float):  # 1: as transformers reads it, true
        found["do_sample"] = True
    elif sample not in (None, False, 0):
        logging.getLogger("slimml").warning("slimml: %s's generation_config.json sets do_sample=%r, not true or false; "
                                            "it is read as false (pass do_sample=True to sample).", model.manifest.name, sample)
    # where the file samples, or a caller turns sampling on (do_sample=True), as transformers reads them
    found.update({k: raw[k] for k in _SAMPLING if raw.get(k) is not None})
    if "top_k" in raw and raw["top_k"] is None:  # transformers: null is no top-k (not its default of 50)
        found["top_k"] = 0
    kept: dict[str, Any] = {}
    for name, value in found.items():  # each checked alone, so one bad value leaves the others
        try:
            if (isinstance(value, bool) and name != "do_sample" or name == "top_k" and not is_int(value)
                    or name == "temperature" and found.get("do_sample") and isinstance(value, (int, float))
                    and value <= 0):  # transformers refuses 0 where the file samples; elsewhere 0 writes "greedy"
                raise ConfigError(name)
            GenerationConfig(**{name: value})
            kept[name] = value
        except (ConfigError, TypeError):
            logging.getLogger("slimml").warning("slimml: %s's generation_config.json sets %s=%r, which is not a usable "
                                                "value; it is left out (pass %s= to generate() to set it).",
                                                model.manifest.name, name, value, name)
    unapplied = [f"{k}={raw[k]!r}" for k in _UNAPPLIED if raw.get(k) not in (None, 0, 0.0, 1.0, 1)]
    unapplied += [f"{k}={shown(raw[k])}" for k in _IGNORED if raw.get(k) not in (None, [], {})]
    if unapplied:
        lengths = any(raw.get(k) is not None for k in ("max_new_tokens", "max_length", "min_length"))
        logging.getLogger("slimml").warning("slimml: %s's generation_config.json sets %s, which slimml's decoder "
                                            "generation does not apply; its other settings apply%s.",
                                            model.manifest.name, ", ".join(unapplied),
                                            " (pass max_new_tokens= to set the length)" if lengths else "")
    try:
        _read[model] = kept
    except TypeError:  # not weakly referable: read again next time
        pass
    return dict(kept)


def model_settings(model: Any) -> dict[str, Any]:
    """What ``generate``, ``stream`` and ``chat`` take where their caller says nothing: the file's
    settings (:func:`file_settings`), over transformers' own default of sampling among the
    ``TRANSFORMERS_TOP_K`` most likely tokens."""
    return {"top_k": TRANSFORMERS_TOP_K, **file_settings(model)}
