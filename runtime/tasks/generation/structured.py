"""Answers held to a format: JSON (any object, or one that a JSON Schema describes), a regular
expression, or a Lark grammar.

``GenerationConfig.response_format`` takes OpenAI's shapes (``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``) and two of slimml's
(``{"type": "regex", "regex": "..."}``, ``{"type": "grammar", "grammar": "<Lark>"}``). Each step,
the tokens that cannot continue the format are masked out before sampling (their logits set to
-inf), and the end-of-sequence ids are allowed only once the format is complete, so the answer
parses. The masks come from llguidance (Microsoft's Rust library, which llama.cpp and vLLM use
for the same job): about 0.03 ms a step for a 49k vocabulary.

Whitespace between JSON tokens is bounded as llama.cpp's JSON grammar bounds it (one space, or a
newline and up to 20 spaces or tabs): a small model left free to add whitespace can fill its
answer with it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from slimml.errors import ConfigError
from slimml.runtime.tasks.limits import shown

FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
JSON_OPTIONS = {"whitespace_pattern": r"(?:[ ]?|\n[ \t]{0,20})"}  # llguidance's custom separators mis-mask "\":"

_tokenizers: dict[int, tuple[Any, list, dict]] = {}  # id(tokenizer) -> (tokenizer, its tokens' bytes, {(vocab, ends): LLTokenizer})
_PER_TOKENIZER = 8  # the (vocab, end ids) views kept of one tokenizer, the newest
_lock = threading.Lock()


def grammar_of(response_format: dict[str, Any] | None) -> str | None:
    """llguidance's grammar for ``response_format`` (None: free text), checked: a shape, a schema,
    a regex or a grammar that cannot be used is refused in one line that names the fix."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):  # the CLI's --response-format json is a word; here it is OpenAI's object
        raise ConfigError(f"response_format must be a dict, as OpenAI's: {{'type': 'json_object'}}, {{'type': "
                          f"'json_schema', 'json_schema': {{'schema': ...}}}}, {{'type': 'regex', 'regex': ...}} or "
                          f"{{'type': 'grammar', 'grammar': ...}}; got {type(response_format).__name__} "
                          f"{shown(response_format)}.")
    if not isinstance(response_format, dict) or response_format.get("type") not in FORMATS:
        kind = response_format.get("type") if isinstance(response_format, dict) else response_format
        raise ConfigError(f"response_format type {shown(kind)} is not known; use one of {', '.join(FORMATS)} "
                          '(e.g. {"type": "json_object"}).')
    kind = response_format["type"]
    if kind == "text":
        return None
    llg = _llguidance()
    if kind == "json_object":
        grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConfigError('response_format json_schema needs {"type": "json_schema", "json_schema": {"name": ..., '
                              '"schema": {...}}}: the schema as a JSON object under json_schema.schema.')
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"response_format's JSON Schema cannot be read ({_line(str(e))}); fix the schema.") from None
    else:
        source = response_format.get(kind)
        if not isinstance(source, str) or not source:
            raise ConfigError(f'response_format {kind} needs the {kind} as a string: {{"type": "{kind}", "{kind}": "..."}}.')
        grammar = (llg.LLMatcher.grammar_from_regex(source) if kind == "regex"
                   else llg.LLMatcher.grammar_from_lark(source))
    error = llg.LLMatcher.validate_grammar(grammar)
    if not error and _admits_nothing(grammar):  # valid, yet no text matches it: the answer would be empty
        error = "no text matches it: a definition that refers only to itself, for one"
    if error:
        what = {"json_object": "JSON", "json_schema": "JSON Schema", "regex": "regular expression", "grammar": "Lark grammar"}
        refused = ConfigError(f"response_format's {what[kind]} cannot be used ({_line(error)}); fix it, or leave "
                              "response_format out.")
        refused.detail = _line(error)  # llguidance's words alone, for a caller that says it its own way (tools)
        raise refused
    return grammar


class _Bytes:
    """A tokenizer of single bytes and an end token (256), for asking a grammar what it allows."""

    tokens = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids = [256]
    eos_token_id = 256
    bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def _admits_nothing(grammar: str) -> bool:
    """Whether no text at all matches ``grammar`` (llguidance then allows only the end token from
    the start, without the grammar being complete: a JSON Schema whose ``$ref`` is itself)."""
    llg = _llguidance()
    global _byte_tokenizer
    if _byte_tokenizer is None:
        _byte_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=[256])
    matcher = llg.LLMatcher(_byte_tokenizer, grammar, log_level=0)
    if matcher.is_error() or matcher.is_accepting():
        return False
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:256]
    return not allowed.any()


_byte_tokenizer: Any = None


class Constraint:
    """One answer held to a grammar: masks each step's scores, follows each chosen token."""

    def __init__(self, grammar: str, tokenizer: Any, vocab: int, ends: frozenset[int]):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer, vocab, ends), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"response_format cannot be used with this model's tokenizer "
                              f"({_line(self.matcher.get_error())}); fix it, or leave response_format out.")

    def mask(self, scores: np.ndarray, logits: np.ndarray) -> None:
        """Set the (vocab,) ``scores`` of the tokens that cannot come next to -inf, in place. Where
        the other processors left no allowed token (``min_new_tokens`` holding back the end that
        the complete format needs), the format wins: the allowed tokens get their ``logits`` back.
        A matcher that failed (a token it did not allow was forced on it) masks nothing."""
        if self.matcher.is_error():
            return
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: len(scores)].view(bool)
        if not allowed.any():
            return
        scores[~allowed] = -np.inf
        if not np.isfinite(scores[allowed]).any():
            scores[allowed] = logits[allowed]

    def consume(self, token: int) -> None:
        if not self.matcher.is_error():
            self.matcher.consume_token(int(token))

    def forced(self, k: int) -> list[int]:
        """Up to ``k`` tokens the format allows nothing else than, next (a JSON key, the text
        between two fields, a call's name), as llguidance tokenizes them; the model may still
        split that text otherwise (the loop then drops the rest)."""
        if k <= 0 or self.matcher.is_error() or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:k]


def ll_tokenizer(tokenizer: Any, vocab: int, ends: frozenset[int]) -> Any:
    """llguidance's view of a ``tokenizers.Tokenizer``: each token's own bytes
    (:class:`~slimml.runtime.tasks.generation.detokenize.TokenBytes`), its special tokens, and the
    ids that end an answer; made once (~0.3 s for 49k tokens). Not llguidance's own reading of the
    tokenizer's JSON: a GGUF vocabulary as transformers writes it (a byte-level BPE whose decoder
    also carries byte fallback) came out of that with every space-led token's bytes wrong."""
    key = (vocab, tuple(sorted(ends)))
    with _lock:
        held = _tokenizers.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:  # the tokenizer is kept alive with its views: its id stays its own
            from slimml.runtime.tasks.generation.detokenize import TokenBytes

            piece = TokenBytes(tokenizer)  # read once a tokenizer, whatever the views made of it
            held = _tokenizers[id(tokenizer)] = (tokenizer, [piece(i) for i in range(tokenizer.get_vocab_size())], {})
        _, pieces, views = held
        made = views.pop(key, None)
        if made is None:
            llg = _llguidance()
            made = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, pieces, vocab, ends)), n_vocab=vocab,
                                   eos_token=sorted(ends) or None)
            while len(views) >= _PER_TOKENIZER:
                views.pop(next(iter(views)))  # the least recently used
        views[key] = made
        return made


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer."""

    def __init__(self, tokenizer: Any, pieces: list[bytes], vocab: int, ends: frozenset[int]):
        self.tokenizer = tokenizer
        self.tokens = pieces[:vocab] + [b""] * (vocab - len(pieces))  # logits past the vocabulary: never text
        self.special_token_ids = sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special and i < vocab)
        self.eos_token_id = min(ends) if ends else None
        self.bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ConfigError("response_format needs the llguidance package: pip install llguidance "
                          "(slimml installs it; a trimmed environment may lack it).") from None
    return llguidance


def _line(text: str) -> str:
    first = " ".join(text.strip().split())
    return first if len(first) <= 200 else first[:197] + "..."
