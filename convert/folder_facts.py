"""What a Hugging Face folder says, read without loading the model: the task its config names,
the facts the runtime keeps, the tokenizer and chat template the artifact ships, a classifier's
labels, the preprocessor, and how an encoder-decoder's generation starts and stops."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from slimml.convert.sources import max_seq_length
from slimml.errors import ConfigError, ExportError, SlimmlError

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"


def hf_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict ({} where it is missing or not JSON)."""
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


SEARCH_KEYS = ("max_length", "min_length", "max_new_tokens", "min_new_tokens", "num_beams", "length_penalty",
               "early_stopping", "no_repeat_ngram_size", "repetition_penalty", "renormalize_logits", "do_sample", "temperature",
               "top_k", "top_p")


def seq2seq_spec(folder: Path) -> dict[str, Any]:
    """How generation starts and stops, from generation_config.json (else config.json), as
    transformers' generate reads them (Whisper's: as its own generate builds its prompt)."""
    config = hf_config(folder)
    gen = {}
    if (folder / "generation_config.json").is_file():
        gen = json.loads((folder / "generation_config.json").read_text())

    def pick(key, first=True):
        value = gen.get(key, config.get(key))
        return value[0] if first and isinstance(value, list) and value else value

    start = pick("decoder_start_token_id")
    if start is None:  # transformers' fallback is the bos token
        start = pick("bos_token_id")
    if start is None:
        start = pick("pad_token_id") or 0
    eos = pick("eos_token_id", first=False)  # an id, or a list of them (each ends the answer)
    if isinstance(eos, list):
        eos = [int(e) for e in eos] if len(eos) > 1 else (int(eos[0]) if eos else None)
    forced, prompt = [], None
    named: dict[str, int] = {}
    if gen.get("no_timestamps_token_id") is not None:  # Whisper: its forced ids are the decoder's prompt
        prompt, named = _whisper_prompt(gen, config)
    bos = pick("forced_bos_token_id")  # BART-large-cnn's <s>, mBART-50's target language: the first token made
    if bos is not None:
        forced.append([1, int(bos)])
    spec = {"decoder_start_token_id": int(start), "eos_token_id": eos,
            "pad_token_id": pick("pad_token_id"), "forced_ids": forced}
    if prompt is not None:
        spec["prompt_ids"] = prompt
        languages = gen.get("lang_to_id") or {}
        if languages and prompt[0] is None:
            spec["language_ids"] = sorted(int(i) for i in languages.values())
            spec.update(named)
    limit = config.get("max_target_positions") or config.get("max_decoder_position_embeddings") or config.get("max_position_embeddings")
    if isinstance(limit, int) and limit > 0 and config.get("model_type") not in _RELATIVE_POSITIONS:
        spec["max_positions"] = limit
    last = pick("forced_eos_token_id")  # BART's and Marian's: the end token when the length runs out
    if last is not None:
        spec["forced_eos_token_id"] = int(last)
    bad = gen.get("bad_words_ids", config.get("bad_words_ids"))
    if bad:  # Marian's [[pad]]: token sequences generate never completes
        spec["bad_words_ids"] = [[int(t) for t in w] for w in bad if w]
    search = {key: pick(key) for key in SEARCH_KEYS if pick(key) is not None}  # beams, lengths: BART-cnn's, Marian's
    if search:
        spec["search"] = search
    for key, name in (("suppress_tokens", "suppress_ids"), ("begin_suppress_tokens", "begin_suppress_ids")):
        ids = gen.get(key, config.get(key))
        if ids:  # Whisper's: tokens never emitted, and tokens not emitted first
            spec[name] = [int(i) for i in ids]
    return spec


_RELATIVE_POSITIONS = ("t5", "mt5", "umt5", "longt5")  # relative attention: no table of positions to run past


def _whisper_prompt(gen: dict, config: dict) -> tuple[list[int | None], dict[str, int]]:
    """The tokens Whisper's generate puts after the start token (transformers'
    ``_retrieve_init_tokens``, transcribing without timestamps), and what applies to a language
    named at run time. The forced ids from position 1 on (read only where the config names no
    ``task`` or ``language``, as transformers reads them; None: the language, named by the caller
    or detected from the first step's logits over the language ids), the config's task, then
    ``<|notimestamps|>``. The second value holds ``language_id``, the language the config names
    (a fine-tune's ``language="german"``: used where the caller names none), and
    ``language_task_id``, the task put after a named language where the prompt has none
    (transformers puts transcribe there; a detected language gets none)."""
    task, language = gen.get("task"), gen.get("language")
    tasks, languages = gen.get("task_to_id") or {}, gen.get("lang_to_id") or {}
    prompt: list[int | None] = []
    if task is None and language is None:  # transformers ignores the forced ids where either is set
        forced = gen.get("forced_decoder_ids")
        forced = sorted((config.get("forced_decoder_ids") if forced is None else forced) or [], key=lambda x: x[0])
        for position, token in forced:
            if position != len(prompt) + 1:
                break
            prompt.append(None if token is None else int(token))
    named: dict[str, int] = {}
    if language is not None and languages:  # (without language ids there is nothing to name: as English-only models)
        named["language_id"] = _language_token(language, languages)
    if languages and (not prompt or prompt[0] is None):
        prompt[:1] = [None]  # named (by the caller or the config) or detected, as transformers does with their ids
    if task in tasks:  # replaces the task id the forced ids gave
        prompt = [t for t in prompt if t not in tasks.values()] + [int(tasks[task])]
    elif task is not None and tasks:  # (a config without task ids names a task it cannot put in a prompt: as transformers' 4.57)
        raise ConfigError(f"the generation config's task {task!r} is not one of its task_to_id ({', '.join(tasks) or 'none'}); "
                          "set task to one of them (or remove it) in generation_config.json, then convert again.")
    if not prompt or prompt[-1] != gen["no_timestamps_token_id"]:
        prompt.append(int(gen["no_timestamps_token_id"]))
    if languages and prompt[0] is None:  # a language named (by the caller or the config): transformers drops the forced
        task_named = int(tasks[task]) if task in tasks else int(tasks["transcribe"]) if "transcribe" in tasks else None
        if task_named is not None and [task_named, prompt[-1]] != prompt[1:]:  # ids, and puts its task, else transcribe
            named["language_task_id"] = task_named
    return (prompt if languages else [t for t in prompt if t is not None]), named  # no ids to detect among: none


def _language_token(language: Any, languages: dict[str, int]) -> int:
    """The id of the language a Whisper generation config names (``"german"``, ``"de"`` or
    ``"<|de|>"``), as transformers' ``language_to_id`` reads it."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    word = language.lower() if isinstance(language, str) else None
    token = (word if word in languages else f"<|{TO_LANGUAGE_CODE[word]}|>" if word in TO_LANGUAGE_CODE
             else f"<|{word}|>" if word in TO_LANGUAGE_CODE.values() else None)
    if token not in languages:
        raise ConfigError(f"the generation config's language {language!r} is not one of this model's languages (its "
                          "lang_to_id); set language to one of them, such as \"german\" or \"de\" (or remove it) in "
                          "generation_config.json, then convert again.")
    return int(languages[token])


def preprocessor_file(folder: Path, onnx_path: Path) -> tuple[Path | None, str | None]:
    """The source's preprocessor config, when the graph takes pixels or audio features and the folder
    has one, and an image processor's only where slimml makes the same pixels from it; else None
    and, for an image processor slimml does not reproduce or a config the folder lacks, why (one line)."""
    import onnx

    path = folder / PREPROCESSOR_FILE
    if not path.is_file() and not _reads_pixels_or_sound(folder):  # a text model: its graph need not be read
        return None, None
    inputs = {i.name for i in onnx.load(str(onnx_path), load_external_data=False).graph.input}
    if not path.is_file():  # said now, not when the first image or recording is refused
        takes = next((n for n in ("pixel_values", "input_features") if n in inputs), None)
        return None, (None if takes is None else
                      f"the source has no {PREPROCESSOR_FILE}, so the artifact's {takes} input takes arrays only (run({takes}=...)), "
                      f"not {'images' if takes == 'pixel_values' else 'recordings'}; put the model's {PREPROCESSOR_FILE} in "
                      "the folder and convert again")
    if "pixel_values" in inputs:
        from slimml.convert.check_images import preprocessing_gap

        if (gap := preprocessing_gap(folder, path)) is not None:
            return None, (f"{gap}; its config is not shipped: make the pixels with transformers' processor and call "
                          "run(pixel_values=...)")
    return (path if inputs & {"pixel_values", "input_features"} else None), None


def _reads_pixels_or_sound(folder: Path) -> bool:
    """Whether the folder's config describes images or audio in (``num_channels``, ``image_size``, a
    ``vision_config``, ``num_mel_bins``): where a missing preprocessor config is worth a note."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # not known: the graph says
    keys = ("num_channels", "image_size", "vision_config", "num_mel_bins", "feature_size")
    return isinstance(config, dict) and any(k in config for k in keys)


def class_labels(folder: Path, task: str) -> list[str] | None:
    """``id2label`` as a list, for classifiers (a token classifier's labels are per token: kept too)."""
    if not task.endswith("classification") or task.startswith("zero-shot"):
        return None
    config = json.loads((folder / "config.json").read_text())
    if "id2label" not in config:  # transformers leaves its default out of config.json: two labels, so named
        return ["LABEL_0", "LABEL_1"]
    id2label = config.get("id2label") or {}
    try:
        ids = sorted(int(k) for k in id2label)
    except (TypeError, ValueError):
        return None
    if ids != list(range(len(ids))):
        return None
    return [str(id2label.get(str(i), id2label.get(i))) for i in ids]


_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model")


def tokenizer_info(folder: Path, onnx_dir: Path, pooling: dict | None) -> dict[str, Any] | None:
    """Make sure ``onnx_dir`` holds a fast ``tokenizer.json``; describe how to pad and truncate."""
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None  # no tokenizer (transformers 5 would build an empty one from the config)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:
        return None  # a model without a tokenizer takes arrays only
    if not getattr(tok, "is_fast", False):
        return None
    if not (onnx_dir / TOKENIZER_FILE).is_file():
        tok.save_pretrained(str(onnx_dir))
    if (folder / TOKENIZER_FILE).is_file() and not (onnx_dir / TOKENIZER_FILE).is_file():
        shutil.copy2(folder / TOKENIZER_FILE, onnx_dir / TOKENIZER_FILE)
    max_len = max_seq_length(folder) if pooling else None
    positions = usable_positions(folder)  # the text tower's, for two-tower models
    if not max_len:  # a tokenizer that names no length: the model's positions, as transformers' pipelines read them
        max_len = tok.model_max_length if 0 < tok.model_max_length < 100_000 else positions or 512
    if positions and positions < max_len:
        max_len = positions  # a tokenizer borrowed from a longer model must not overrun the positions
    pad_token = tok.pad_token or tok.eos_token
    pad_id = tok.convert_tokens_to_ids(pad_token) if pad_token is not None else 0
    info = {"file": TOKENIZER_FILE, "max_length": int(max_len), "pad_token": pad_token, "pad_id": int(pad_id)}
    for key in ("cls_token", "unk_token"):  # what question answering and token classification read
        value = getattr(tok, key, None)
        if isinstance(value, str) and value:
            info[key] = value
    if getattr(tok, "padding_side", "right") == "left":  # question answering: the context first (XLNet's way)
        info["padding_side"] = "left"
    if (folder / GENERATION_CONFIG_FILE).is_file():  # the end ids generate reads (Llama-3's eos is a list)
        shutil.copy2(folder / GENERATION_CONFIG_FILE, onnx_dir / GENERATION_CONFIG_FILE)
        info["generation_config"] = GENERATION_CONFIG_FILE
    return info | chat_entry(folder, onnx_dir, tok)


def chat_entry(folder: Path, onnx_dir: Path, tok: Any) -> dict[str, Any]:
    """The chat template (written to ``onnx_dir/chat_template.jinja``) and the bos/eos strings, for the
    manifest's tokenizer entry: ``{"chat_template": "chat_template.jinja", "bos_token", "eos_token"}``.

    The template comes from the folder's ``chat_template.jinja``, else ``tokenizer_config.json``
    (as transformers reads them); a model without one gets only the bos/eos strings it has.
    """
    entry: dict[str, Any] = {}
    template = getattr(tok, "chat_template", None)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        template = (folder / CHAT_TEMPLATE_FILE).read_text()
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if isinstance(template, str) and template.strip():
        (onnx_dir / CHAT_TEMPLATE_FILE).write_text(template)
        entry["chat_template"] = CHAT_TEMPLATE_FILE
    for key in ("bos_token", "eos_token"):
        value = getattr(tok, key, None)
        if isinstance(value, str) and value:
            entry[key] = value
    return entry


# The head class a config names decides the task (the cache-free graph for decoders).
_TASK_BY_SUFFIX = [
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForMaskedLM", "fill-mask"),
    ("ForMultipleChoice", "multiple-choice"),
    ("ForImageClassification", "image-classification"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("MTModel", "text2text-generation"),  # Marian's MarianMTModel
    ("Model", "feature-extraction"),
]


def task_from_config(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") in ("whisper", "speech_to_text", "speech-encoder-decoder"):
        return "automatic-speech-recognition"
    archs = config.get("architectures") or []
    for arch in archs:
        for suffix, task in _TASK_BY_SUFFIX:
            if arch.endswith(suffix):
                return task
    raise ExportError(
        f"cannot tell the task of {folder} from its config.json (architectures: {archs}); pass --task, "
        "e.g. --task feature-extraction or --task text-generation."
    )


def config_facts(folder: Path) -> dict[str, Any]:
    """What the runtime may want to know without transformers: architecture and vocabulary size."""
    config = json.loads((folder / "config.json").read_text())
    keys = ("model_type", "vocab_size", "max_position_embeddings", "num_hidden_layers", "num_channels", "image_size",
            "max_source_positions")
    facts = {k: config[k] for k in keys if k in config}
    tokens = usable_positions(folder)
    if tokens:  # RoBERTa's 514 rows take 512 tokens: the runtime bounds a sequence by this, not the rows
        facts["max_tokens"] = tokens
    if isinstance(config.get("problem_type"), str):  # a classifier's scores: softmax, or sigmoid for multi-label
        facts["problem_type"] = config["problem_type"]
    st = config.get("sentence_transformers") if isinstance(config.get("sentence_transformers"), dict) else {}
    activation = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")  # a CrossEncoder's
    if isinstance(activation, str):
        facts["cross_encoder_activation"] = activation.rsplit(".", 1)[-1]
    for tower in ("text_config", "vision_config"):  # two-tower models (CLIP) keep them per tower
        sub = config.get(tower) or {}
        facts.update({k: sub[k] for k in keys[1:] if k in sub and k not in facts})
    if "num_channels" in facts and "image_size" not in facts:  # ResNet, ConvNeXt, RegNet: the processor sizes the pixels
        size = processed_size(folder)
        if size is not None:
            facts["image_size"] = list(size)
    return facts


def processed_size(folder: Path) -> tuple[int, int] | None:
    """(height, width) of the pixels the folder's image processor makes, where its config fixes them."""
    from slimml.runtime.tasks.inputs.image import ImageProcessor

    path = folder / PREPROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        return ImageProcessor.from_file(path).output_size
    except SlimmlError:  # a processor config slimml cannot read: said where the images are made
        return None


# Encoders whose position ids start after the padding id (RoBERTa's scheme): their table holds
# pad_token_id + 1 rows more than the tokens they read (514 rows, 512 tokens).
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "longformer", "luke",
                     "mpnet", "ibert", "markuplm", "esm", "roberta-prelayernorm", "xmod", "layoutlmv3", "lilt", "ernie_m",
                     "altclip_text_model", "clap_text_model"}


_POSITION_KEYS = ("max_position_embeddings", "n_positions")  # GPT-2, CTRL and OpenAI GPT name it n_positions


def usable_positions(folder: Path) -> int | None:
    """The most tokens the model's position table takes (None where it has no table)."""
    config = json.loads((folder / "config.json").read_text())
    if not any(key in config for key in _POSITION_KEYS) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a two-tower model: its text tower's table
    positions = next((config[key] for key in _POSITION_KEYS if key in config), None)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        return None
    if config.get("model_type") in _OFFSET_POSITIONS:
        pad = config.get("pad_token_id")
        positions -= (pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < positions - 1 else 1) + 1
    return positions


def is_causal_lm(folder: Path) -> bool:
    """Whether the folder's config names a causal LM (its task is text generation)."""
    return task_or_none(folder) == "text-generation"


def task_or_none(folder: Path) -> str | None:
    try:
        return task_from_config(folder)
    except ExportError:
        return None
