"""Prompts in, checked once against the model: token ids in its vocabulary, lengths within its
context (refused with the limit, or cut from the left only when asked), stop strings that can fit.

After this the decode loop trusts its feeds (``Engine.run_trusted``) and checks nothing per token.
"""

from __future__ import annotations

import logging
import reprlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from slimml.errors import ConfigError, FeedError, SlimmlError
from slimml.runtime.engine.kv_cache import takes_logits_index
from slimml.runtime.tasks.generation.chat import folder_json
from slimml.runtime.tasks.generation.config import GenerationConfig, is_int
from slimml.runtime.tasks.inputs.text import listed
from slimml.runtime.tasks.limits import Limits, tokenized

if TYPE_CHECKING:
    from tokenizers import Tokenizer

GENERATION_CONFIG = "generation_config.json"  # the artifact's copy of the source's (convert lists it)
_EOS_TOKENS = ("</s>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>", "<eos>", "<|end_of_text|>", "<end_of_turn>",
               "<|return|>", "<|call|>")  # the last two: harmony's (gpt-oss) ends of a reply and of a tool call
_untruncated: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TextEncoder -> its tokenizer, no truncation
_special_tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TextEncoder -> its special tokens by text


@dataclass
class Prompts:
    """Checked prompts: ``ids`` per prompt, how many new tokens fit (``steps``), and the ids that end one."""

    ids: list[list[int]]
    texts: bool  # the prompts came as text (so the answers go back as text)
    steps: int  # passes to run at most: max_new_tokens, or fewer where the context ends
    end_ids: frozenset[int]  # the end-of-sequence id(s), stop_token_ids, and stop strings that are special tokens
    pad_id: int
    tokenizer: Tokenizer | None
    constraints: list | None = None  # one structured.Constraint per prompt, with config.response_format
    held_ids: frozenset[int] = frozenset()  # what min_new_tokens holds back: end_ids less the stop strings (they still stop)
    row_steps: list[int] | None = None  # with truncate, each prompt's own room where they differ (steps: the most)


def prepare(model: Any, prompts: Any, config: GenerationConfig, raw_text: bool = False) -> Prompts:
    """Encode and check ``prompts`` (texts or token id lists) for ``model`` under ``config``.

    ``raw_text``: the texts are rendered chat templates, which carry their own special tokens
    (encoded without adding any, as transformers' ``apply_chat_template`` does).
    """
    text = model.text
    tok = untruncated(text) if text is not None else None
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = listed(prompts)  # a numpy array of texts, a Series; a 2-D id array stays an array
    texts = isinstance(prompts, (list, tuple)) and len(prompts) > 0 and all(isinstance(p, str) for p in prompts)
    limits = getattr(model, "limits", None) or Limits()  # model.limits, raised for trusted input
    if texts:
        if tok is None:
            raise SlimmlError(f"the artifact {model.folder} has no tokenizer, so it cannot read text: pass token ids "
                              "instead (model.generate([[1, 2, 3]]) in Python), or re-convert it from a folder that has its "
                              "tokenizer (tokenizer.json) to give it text.")
        check_unicode(prompts)
        # bounded before tokenizing, never cut silently
        texts_in = limits.check_prompts(list(prompts), model.engine.max_sequence_length, config.truncate)
        ids = [e.ids for e in tokenized(lambda: tok.encode_batch(texts_in, add_special_tokens=not raw_text))]
    else:
        ids = _id_lists(prompts)
    if not ids:
        raise FeedError("generate() needs at least one non-empty prompt; give a text or a list of token ids.")
    empty = next((i for i, p in enumerate(ids) if len(p) == 0), None)
    if empty is not None:
        which = "the prompt" if len(ids) == 1 else f"prompt {empty}"
        raise FeedError(f"{which} has no tokens; every prompt needs at least one (give it some text, or drop it).")
    if isinstance(config.seed, tuple) and len(config.seed) != len(ids):
        raise ConfigError(f"seed has {len(config.seed)} values for {len(ids)} prompts; give one per prompt, or one integer.")
    engine = model.engine
    vocab = engine.vocab_size
    if vocab is not None:
        for i, p in enumerate(ids):
            bad = next((k for k, t in enumerate(p) if not 0 <= t < vocab), None)
            if bad is not None:
                raise FeedError(f"prompt {i} has token id {p[bad]} at position {bad}, outside the model's vocabulary "
                                f"of {vocab}; use ids in [0, {vocab}).")
    named_ids = (("logit_bias", [t for t, _ in config.logit_bias or ()]), ("stop_token_ids", config.stop_token_ids),
                 ("eos_token_id", _ids(config.eos_token_id)), ("pad_token_id", _ids(config.pad_token_id)))
    for name, named in named_ids:
        far = [t for t in named if vocab is not None and t >= vocab]
        if far:
            raise ConfigError(f"{name} names token {far[0]}, outside the model's vocabulary of {vocab}; use ids in "
                              f"[0, {vocab}).")
    if config.stop and tok is None:
        raise SlimmlError(f"stop strings are matched on the text, but the artifact {model.folder} has no tokenizer; "
                          "use stop_token_ids instead.")
    context = engine.max_sequence_length
    steps, row_steps = config.max_new_tokens, None
    if context is not None:
        ids = [_fit(i, p, context, config) for i, p in enumerate(ids)]
        for i, s in enumerate(config.stop):
            n = len(tokenized(lambda: tok.encode(s, add_special_tokens=False)).ids)
            if n > context:
                raise FeedError(f"stop string {i} is {n} tokens long, longer than the model's context of {context} "
                                "tokens, so it can never appear; shorten it.")
        if config.truncate:  # cut to leave room: fewer new tokens where the context ends, each prompt's own
            rooms = [min(steps, context - len(p)) for p in ids]
            steps, row_steps = max(rooms), (rooms if len(set(rooms)) > 1 else None)
    # before any pass: prompt + max_new_tokens within the positions (unless truncating), and rows x
    # tokens within the call's budget (model.limits, raised for trusted input)
    limits.check_generate([len(p) for p in ids], steps, None if config.truncate else context, engine.vocab_size,
                          indexed=takes_logits_index(engine), context=context, beams=config.num_beams)
    held = frozenset(end_ids(model, config, tok))
    ends = held | (special_stops(tok, config.stop) if tok is not None else frozenset())
    constraints = None
    if config.grammar is not None:  # here, on the caller's thread: a format this tokenizer cannot follow fails now
        from slimml.runtime.tasks.generation.structured import Constraint

        if tok is None:
            raise ConfigError(f"response_format holds the answer's text to a format, but the artifact {model.folder} has "
                              "no tokenizer; re-convert it from a folder with its tokenizer, or leave response_format out.")
        constraints = [Constraint(config.grammar, tok, vocab or tok.get_vocab_size(), ends) for _ in ids]
    return Prompts(ids=ids, texts=texts, steps=steps, end_ids=ends, pad_id=pad_id(model, config), tokenizer=tok,
                   constraints=constraints, held_ids=held, row_steps=row_steps)


def check_unicode(texts: list[str]) -> None:
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad decode upstream
            raise FeedError(f"prompt {i} is not valid Unicode ({e.reason} at position {e.start}); decode your input "
                            "with errors='replace' or clean it first.") from None


def untruncated(text: Any) -> Tokenizer:
    """The TextEncoder's tokenizer without its truncation (a prompt too long is refused or cut
    here, never silently by the tokenizer), made once per encoder."""
    tok = _untruncated.get(text)
    if tok is None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(text.tokenizer.to_str())
        tok.no_truncation()
        tok.no_padding()
        _untruncated[text] = tok
    return tok


def end_ids(model: Any, config: GenerationConfig, tok: Tokenizer | None) -> set[int]:
    """The ids that end a prompt: ``config.eos_token_id``, else the end ids the model names
    (the artifact's ``generation_config.json`` ``eos_token_id``, an id or a list as transformers
    reads it, and the manifest's ``eos_token``/``eos_token_id``) and, as llama.cpp's
    end-of-generation set, every known end token of the vocabulary (a chat model's turn ends with
    ``<|im_end|>`` or ``<|eot_id|>`` though its eos is another); with ``config.stop_token_ids``."""
    eos = config.eos_token_id
    if eos is None:
        spec = model.manifest.tokenizer or {}
        folder = getattr(model, "folder", None)  # only a file the manifest lists, hash-checked as it is read
        generation = folder_json(folder, GENERATION_CONFIG, model.manifest) if folder is not None else {}
        eos = set(_ids(spec.get("eos_token_id"))) | set(_ids(generation.get("eos_token_id")))
        if tok is not None:
            named = [spec["eos_token"]] if isinstance(spec.get("eos_token"), str) else []
            eos |= {tok.token_to_id(t) for t in [*named, *_EOS_TOKENS]} - {None}
    return set(_ids(eos)) | set(config.stop_token_ids)


def special_stops(tok: Tokenizer, stop: tuple[str, ...]) -> set[int]:
    """Ids of the stop strings that are special tokens (``"<|eot_id|>"``): the text leaves special
    tokens out, so such a stop string is matched by its id."""
    if not stop:
        return set()
    special = _specials(tok)
    return {special[s] for s in stop if s in special}


def special_tokens(text: Any) -> dict[str, int]:
    """The special tokens of a model's tokenizer (its TextEncoder, ``model.text``) by their text
    (none without one); read once per encoder."""
    if text is None:
        return {}
    found = _special_tokens.get(text)
    if found is None:
        found = _special_tokens[text] = _specials(untruncated(text))
    return found


def _specials(tok: Tokenizer) -> dict[str, int]:
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def _ids(v: Any) -> list[int]:
    """A token id or a list of them (as generation_config.json writes ``eos_token_id``) as a list."""
    if is_int(v):
        return [int(v)] if v >= 0 else []
    if isinstance(v, (list, tuple, set, frozenset)):
        return [int(i) for i in v if is_int(i) and i >= 0]
    return []


def pad_id(model: Any, config: GenerationConfig) -> int:
    """The id that pads shorter prompts (masked out, so any id the embedding table holds): the
    config's, else the tokenizer's where the table holds it (a GGUF file's tokenizer, as transformers
    rebuilds it, may add ``<pad>`` past the model's rows: a batch failed in its Gather), else 0."""
    if config.pad_token_id is not None:
        return config.pad_token_id
    pad, vocab = int((model.manifest.tokenizer or {}).get("pad_id") or 0), model.engine.vocab_size
    return pad if vocab is None or pad < vocab else 0


def _id_lists(prompts: Any) -> list[list[int]]:
    if isinstance(prompts, np.ndarray):
        if prompts.ndim != 2 or prompts.dtype.kind not in "iu":
            raise FeedError(f"prompts as an array must be 2-D integer token ids, got {prompts.ndim}-D {prompts.dtype}; "
                            "pass a list of id lists for prompts of different lengths.")
        return prompts.astype(np.int64).tolist()
    if isinstance(prompts, (list, tuple)) and prompts and all(is_int(t) for t in prompts):
        raise FeedError("prompts is one list of token ids; wrap it in a list ([[1, 2, 3]]): a list of id lists is a "
                        "batch of prompts.")
    listed = isinstance(prompts, (list, tuple))
    encoded = next((p for p in (prompts if listed else [prompts]) if hasattr(p, "keys")), None)
    if encoded is not None and "input_ids" in encoded:  # transformers 5's apply_chat_template: a BatchEncoding
        raise FeedError(f"prompts hold a {type(encoded).__name__} (a tokenizer's output, as transformers 5's "
                        "apply_chat_template returns it); pass its token ids: enc['input_ids'], wrapped as [ids] for one "
                        "prompt, or model.chat(messages) to render the template here.")
    texts = listed and any(isinstance(p, str) for p in prompts)  # then the odd one out is what is not a text
    odd = [p for p in prompts if not isinstance(p, str if texts else (list, tuple, np.ndarray))] if listed else []
    if not listed or odd:  # (a None among them too: it was read as "none found", then iterated)
        got = (f"a list of texts holding {reprlib.repr(odd[0])}" if texts else f"a list holding {reprlib.repr(odd[0])}") \
            if listed else type(prompts).__name__
        raise FeedError(f"prompts must be a text, a list of texts, or a list of token id lists, got {got}.")
    out = []
    for i, p in enumerate(prompts):
        if not all(is_int(t) for t in p):
            raise FeedError(f"prompt {i} has a token id that is not an integer; pass whole numbers, or texts.")
        out.append([int(t) for t in p])
    return out


def _fit(i: int, ids: list[int], context: int, config: GenerationConfig) -> list[int]:
    """``ids`` if at least one new token fits after it in ``context``; else refused, or, with
    ``truncate``, its last tokens: room for max_new_tokens, but never less than half the context."""
    if len(ids) < context:
        return ids
    if not config.truncate:
        raise FeedError(f"prompt {i} has {len(ids)} tokens; the model's context is {context}, which leaves no room "
                        f"for new tokens; shorten it to at most {context - 1} tokens or pass truncate=True (slimml generate --truncate).")
    keep = context - min(config.max_new_tokens, context // 2)
    logging.getLogger("slimml").warning("slimml: prompt %d has %d tokens, past the model's context of %d; kept its last %d "
                                        "(truncate=True), the first %d dropped.", i, len(ids), context, keep, len(ids) - keep)
    return ids[-keep:]
