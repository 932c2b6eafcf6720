"""The manifest's optional records, each declared once: its fields, its JSON form and its checks.

A record is a dataclass. ``from_json`` builds it from the parsed manifest, ``to_json`` writes it
back, and ``problems`` lists every way a raw JSON value departs from the format (checked before
anything is built, so a hostile manifest gets one message naming each bad key). Keys this slimml
does not know are kept in ``extra`` and written back unchanged, so a newer writer's additions
survive a quantize by an older slimml.

Records also read as read-only mappings of their JSON form (``manifest.tokenizer["file"]``,
``manifest.seq2seq.get("forced_ids")``), so code written against the plain dicts of earlier
versions keeps working; new code uses the attributes.

The artifact-level assets (``tokenizer``, ``preprocessor``) are files beside the shards. In a
model of several components each component names the assets its inputs are made with
(``"assets": ["tokenizer"]``); :func:`derived_assets` is the one place that works this out for
artifacts written before that record existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

ASSETS = ("tokenizer", "preprocessor")  # the records that name a file a component's inputs are made with
POOLING_MODES = ("mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean", "none")  # sentence-transformers' names
PREPROCESSOR_KINDS = ("image", "audio")
DENSE_ACTIVATIONS = ("identity", "tanh", "relu", "sigmoid")  # a pooling's projections (sentence-transformers' Dense)


def is_int(v: Any, lo: int = 0, hi: int = 1 << 62) -> bool:
    """An int (not a bool) in ``[lo, hi)``: how the manifest's sizes and token ids are checked."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


def _token_id(v: Any) -> bool:
    return is_int(v, 0, 1 << 32)


@dataclass(eq=False)
class Record(Mapping):
    """Base of the manifest's records: JSON form, checks, and read-only mapping access."""

    KEY: ClassVar[str] = ""  # the record's key in manifest.json
    OMIT_EMPTY: ClassVar[tuple[str, ...]] = ()  # fields written only when not empty

    @classmethod
    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    def to_json(self) -> dict[str, Any]:
        out = {}
        for name in self.fields():
            value = getattr(self, name)
            if name in self.OMIT_EMPTY and not value:
                continue
            out[name] = value
        return {**out, **getattr(self, "extra", {})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Record:
        known = cls.fields()
        kwargs = {k: d[k] for k in known if k in d}
        if "extra" in {f.name for f in dataclasses.fields(cls)}:
            kwargs["extra"] = {k: v for k, v in d.items() if k not in known}
        return cls(**kwargs)

    @classmethod
    def coerce(cls, value: Any) -> Any:
        """``value`` as this record: a dict (from older code or a test) is built into one; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_json(value)
        return value  # not a record at all: validation reports it

    @classmethod
    def problems(cls, raw: Any, where: str) -> list[str]:
        """Every way ``raw`` (the parsed JSON value) departs from this record's format."""
        raise NotImplementedError

    # read-only mapping of the JSON form, for code that indexes records as dicts
    def __getitem__(self, key: str) -> Any:
        if key in self.fields():
            return getattr(self, key)
        return getattr(self, "extra", {})[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self.to_json() == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_json()!r})"


class _Checks:
    """Collects ``where what`` problems; ``need`` returns whether the condition held."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def need(self, ok: bool, where: str, what: str) -> bool:
        if not ok:
            self.found.append(f"{where} {what}")
        return ok


@dataclass(eq=False)
class Tokenizer(Record):
    """The shipped ``tokenizer.json`` and how texts are padded and truncated for the model."""

    KEY: ClassVar[str] = "tokenizer"
    OMIT_EMPTY: ClassVar[tuple[str, ...]] = ("chat_template",)
    file: str
    max_length: int | None = None  # truncate longer texts (the model's positions)
    pad_token: str | None = None
    pad_id: int | None = None
    chat_template: str | None = None  # a Jinja chat template file in the artifact (generation)
    extra: dict[str, Any] = field(default_factory=dict)  # keys a newer slimml wrote (special tokens, ...)

    @property
    def files(self) -> list[str]:
        """The artifact files this record names."""
        return [self.file] + ([self.chat_template] if self.chat_template else [])

    @classmethod
    def problems(cls, raw: Any, where: str = "tokenizer") -> list[str]:
        c = _Checks()
        if c.need(isinstance(raw, dict), where, "must be an object or null"):
            c.need(isinstance(raw.get("file"), str), f"{where}.file", "must be a string")
            c.need(raw.get("max_length") is None or is_int(raw.get("max_length"), 1, 1 << 31), f"{where}.max_length",
                   "must be an int from 1 to 2**31-1")
            c.need(raw.get("pad_id") is None or _token_id(raw.get("pad_id")), f"{where}.pad_id",
                   "must be a token id from 0 to 2**32-1")
            c.need(raw.get("pad_token") is None or isinstance(raw.get("pad_token"), str), f"{where}.pad_token",
                   "must be a string")
            for key in ("cls_token", "unk_token"):
                c.need(raw.get(key) is None or isinstance(raw.get(key), str), f"{where}.{key}", "must be a string")
            c.need(raw.get("padding_side") in (None, "left", "right"), f"{where}.padding_side", "must be left or right")
            c.need(raw.get("chat_template") is None or isinstance(raw.get("chat_template"), str),
                   f"{where}.chat_template", "must name a file in the artifact")
        return c.found


@dataclass(eq=False)
class Preprocessor(Record):
    """The shipped preprocessor config: how raw images or audio become the model's input tensors."""

    KEY: ClassVar[str] = "preprocessor"
    file: str
    kind: str  # "image" | "audio"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        """The artifact files this record names."""
        return [self.file]

    @classmethod
    def problems(cls, raw: Any, where: str = "preprocessor") -> list[str]:
        c = _Checks()
        if c.need(isinstance(raw, dict), where, "must be an object or null"):
            c.need(isinstance(raw.get("file"), str), f"{where}.file", "must be a string")
            c.need(raw.get("kind") in PREPROCESSOR_KINDS, f"{where}.kind", "must be \"image\" or \"audio\"")
        return c.found


@dataclass(eq=False)
class Pooling(Record):
    """How a chain's token states become one embedding per text (sentence-transformers style)."""

    KEY: ClassVar[str] = "pooling"
    OMIT_EMPTY: ClassVar[tuple[str, ...]] = ("prompts", "default_prompt", "dense", "truncate_dim")
    mode: str  # one of POOLING_MODES; "none": the model pools itself
    output: str  # the model output that is pooled
    normalize: bool = True  # after the projections, where there are any
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' prompts by name ("query": "query: ")
    default_prompt: str | None = None  # the prompt's name put before every text unless another is asked for
    # projections after pooling (sentence-transformers' Dense), in order: {"weight": file of the
    # (in, out) float32 matrix, "bias": file of the (out,) vector or null, "activation": one of
    # DENSE_ACTIVATIONS}; format version 3, which an older slimml refuses instead of skipping them
    dense: list[dict[str, Any]] = field(default_factory=list)
    # the embedding's first values kept, after the normalisation (sentence-transformers' truncate_dim,
    # a Matryoshka model's saved cut); format version 3
    truncate_dim: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_version(self) -> int:
        """The oldest manifest format version that computes this pooling right (a default prompt
        too: a slimml before it would embed every text without it; artifacts that recorded one
        under version 1 still load)."""
        return 3 if self.dense or self.truncate_dim or self.default_prompt else 1

    @property
    def files(self) -> list[str]:
        """The artifact files this record names (its projections' weights)."""
        return [layer[k] for layer in self.dense for k in ("weight", "bias") if layer.get(k)]

    @classmethod
    def problems(cls, raw: Any, where: str = "pooling") -> list[str]:
        c = _Checks()
        if c.need(isinstance(raw, dict), where, "must be an object or null"):
            c.need(raw.get("mode") in POOLING_MODES, f"{where}.mode", f"must be one of {', '.join(POOLING_MODES)}")
            c.need(isinstance(raw.get("output"), str), f"{where}.output", "must name a model output")
            c.need(isinstance(raw.get("normalize", True), bool), f"{where}.normalize", "must be true or false")
            prompts = raw.get("prompts", {})
            if c.need(isinstance(prompts, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()),
                      f"{where}.prompts", "must map prompt names to texts"):
                default = raw.get("default_prompt")
                c.need(default is None or default in prompts, f"{where}.default_prompt", "must name one of the prompts or be null")
            dense = raw.get("dense", [])
            if c.need(isinstance(dense, list) and all(isinstance(d, dict) for d in dense), f"{where}.dense",
                      "must be a list of projections"):
                for i, d in enumerate(dense):
                    c.need(isinstance(d.get("weight"), str), f"{where}.dense[{i}].weight", "must name a file")
                    c.need(d.get("bias") is None or isinstance(d.get("bias"), str), f"{where}.dense[{i}].bias",
                           "must name a file or be null")
                    c.need(d.get("activation") in DENSE_ACTIVATIONS, f"{where}.dense[{i}].activation",
                           f"must be one of {', '.join(DENSE_ACTIVATIONS)}")
            c.need(raw.get("truncate_dim") is None or is_int(raw.get("truncate_dim"), 1, 1 << 31), f"{where}.truncate_dim",
                   "must be an int >= 1 or null")
        return c.found


@dataclass(eq=False)
class ZeroShot(Record):
    """CLIP-style scoring: which components embed texts and images, the logit scale, and (SigLIP) a
    logit bias, each label's sigmoid for the softmax, and texts padded to a fixed length."""

    KEY: ClassVar[str] = "zero_shot"
    OMIT_EMPTY: ClassVar[tuple[str, ...]] = ("bias", "activation", "text_length")
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("softmax", "sigmoid")
    text: str  # component names
    image: str
    scale: float
    bias: float = 0.0  # added to the scaled cosine (SigLIP's logit_bias)
    activation: str | None = None  # None: softmax over the labels (CLIP); "sigmoid": each label alone (SigLIP)
    text_length: int | None = None  # texts padded to this many tokens (SigLIP: 64, as it was trained; no mask)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requires(self) -> list[str]:
        """The fields a slimml must apply to score (and embed texts) as the source does (format version 4)."""
        return [f"zero_shot.{k}" for k in self.OMIT_EMPTY if getattr(self, k)]

    @classmethod
    def problems(cls, raw: Any, where: str = "zero_shot", components: Any = ()) -> list[str]:
        c = _Checks()
        if c.need(isinstance(raw, dict), where, "must be an object or null"):
            c.need(all(isinstance(raw.get(k), str) and raw.get(k) in components for k in ("text", "image")), where,
                   "must name a text and an image component")
            for key in ("scale", "bias"):
                c.need((key == "bias" and raw.get(key) is None) or isinstance(raw.get(key), (int, float))
                       and not isinstance(raw.get(key), bool), f"{where}.{key}", "must be a number")
            c.need(raw.get("activation") in (None, *cls.ACTIVATIONS), f"{where}.activation",
                   f"must be one of {', '.join(cls.ACTIVATIONS)} or null")
            c.need(raw.get("text_length") is None or is_int(raw.get("text_length"), 1, 1 << 31), f"{where}.text_length",
                   "must be an int >= 1 or null")
        return c.found


@dataclass(eq=False)
class Seq2Seq(Record):
    """Encoder-decoder generation: how decoding starts and stops (as transformers' generate reads it)."""

    KEY: ClassVar[str] = "seq2seq"
    COMPONENTS: ClassVar[tuple[str, ...]] = ("encoder", "decoder", "decoder_with_past")
    OMIT_EMPTY: ClassVar[tuple[str, ...]] = ("suppress_ids", "begin_suppress_ids", "bad_words_ids", "search", "prompt_ids",
                                              "language_ids", "max_positions", "language_id", "language_task_id")
    SEARCH: ClassVar[dict[str, tuple[type, ...]]] = {  # generation_config.json's keys for how tokens are chosen
        "max_length": (int,), "min_length": (int,), "max_new_tokens": (int,), "min_new_tokens": (int,), "num_beams": (int,),
        "length_penalty": (int, float), "early_stopping": (bool, str), "no_repeat_ngram_size": (int,),
        "repetition_penalty": (int, float), "renormalize_logits": (bool,), "do_sample": (bool,), "temperature": (int, float),
        "top_k": (int,), "top_p": (int, float)}
    decoder_start_token_id: int
    eos_token_id: int | list[int] | None = None  # each of a list ends the answer
    pad_token_id: int | None = None
    prompt_ids: list[int | None] = field(default_factory=list)  # Whisper: after the start token (None: the detected language)
    language_ids: list[int] = field(default_factory=list)  # Whisper: the ids the language is detected among
    language_id: int | None = None  # Whisper: the language its generation config names (where the caller names none)
    language_task_id: int | None = None  # Whisper: the task put after a named language (transformers: transcribe)
    max_positions: int | None = None  # the decoder's table of positions (start tokens included)
    forced_ids: list[list[int]] = field(default_factory=list)  # [position, token id]: tokens forced at a step
    suppress_ids: list[int] = field(default_factory=list)  # never emitted (Whisper)
    begin_suppress_ids: list[int] = field(default_factory=list)  # not emitted first (Whisper)
    forced_eos_token_id: int | None = None  # made at the last step where the length runs out (BART, Marian)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # sequences never completed (Marian's pad)
    search: dict[str, Any] = field(default_factory=dict)  # beams and lengths (SEARCH's keys), as the source set them
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requires(self) -> list[str]:
        """The fields a slimml must apply to decode as the source does (format version 4): a slimml
        before them skipped them and decoded otherwise (greedy for a beam search, Whisper without
        its language and task tokens), so they are named in the manifest's ``requires``."""
        return [f"seq2seq.{k}" for k in ("search", "prompt_ids", "bad_words_ids", "forced_eos_token_id", "language_id",
                                         "language_task_id") if getattr(self, k) not in (None, [], {})]

    @classmethod
    def problems(cls, raw: Any, where: str = "seq2seq", components: Any = ()) -> list[str]:
        c = _Checks()
        if not c.need(isinstance(raw, dict), where, "must be an object or null"):
            return c.found
        c.need(all(k in components for k in cls.COMPONENTS), where, "needs the components encoder, decoder and decoder_with_past")
        c.need(_token_id(raw.get("decoder_start_token_id")), f"{where}.decoder_start_token_id", "must be a token id")
        for key in ("pad_token_id", "forced_eos_token_id", "language_id", "language_task_id"):
            c.need(raw.get(key) is None or _token_id(raw.get(key)), f"{where}.{key}", "must be a token id or null")
        eos = raw.get("eos_token_id")
        c.need(eos is None or _token_id(eos) or (isinstance(eos, list) and eos and all(_token_id(x) for x in eos)),
               f"{where}.eos_token_id", "must be a token id, a list of them, or null")
        prompt = raw.get("prompt_ids") or []
        c.need(isinstance(prompt, list) and all(x is None or _token_id(x) for x in prompt), f"{where}.prompt_ids",
               "must be a list of token ids (null: the language to detect)")
        c.need(isinstance(raw.get("language_ids") or [], list) and all(_token_id(x) for x in raw.get("language_ids") or []),
               f"{where}.language_ids", "must be a list of token ids")
        limit = raw.get("max_positions")
        c.need(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit > 1),
               f"{where}.max_positions", "must be a whole number > 1 or null")
        forced = raw.get("forced_ids") or []
        c.need(isinstance(forced, list) and all(isinstance(x, list) and len(x) == 2 and all(_token_id(v) for v in x)
                                                for x in forced), f"{where}.forced_ids", "must be a list of [position, token id]")
        for key in ("suppress_ids", "begin_suppress_ids"):
            ids = raw.get(key) or []
            c.need(isinstance(ids, list) and all(_token_id(x) for x in ids), f"{where}.{key}", "must be a list of token ids")
        search = raw.get("search") or {}
        c.need(isinstance(search, dict) and all(k in cls.SEARCH and isinstance(v, cls.SEARCH[k]) for k, v in search.items()),
               f"{where}.search", f"must map some of {', '.join(cls.SEARCH)} to numbers (early_stopping: true, false or \"never\")")
        bad = raw.get("bad_words_ids") or []
        c.need(isinstance(bad, list) and all(isinstance(w, list) and w and all(_token_id(x) for x in w) for w in bad),
               f"{where}.bad_words_ids", "must be a list of non-empty lists of token ids")
        return c.found


def assets_problems(raw: Any, where: str) -> list[str]:
    """A component's ``assets``: a list of asset names. One the manifest lacks (its record was
    removed) leaves the component without it; using it then says what is missing."""
    c = _Checks()
    if c.need(isinstance(raw, list) and all(isinstance(a, str) for a in raw), where, "must be a list of asset names"):
        for a in raw:
            c.need(a in ASSETS, where, f"names {a!r}, not one of {', '.join(ASSETS)}")
    return c.found


def derived_assets(input_names: set[str], input_ranks: list[int]) -> list[str]:
    """The assets a component's inputs are made with, for version 1 and 2 artifacts that do not say.

    The only place slimml infers them: text comes in as ``input_ids``, images as a 4-D pixel
    tensor, audio as ``input_features``. Artifacts written since record ``assets`` per component.
    """
    found = []
    if "input_ids" in input_names:
        found.append("tokenizer")
    if any(rank == 4 for rank in input_ranks) or "input_features" in input_names:
        found.append("preprocessor")
    return found
