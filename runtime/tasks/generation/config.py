"""What to generate: one dataclass that checks itself, as transformers' ``GenerationConfig`` and
OpenAI's sampling parameters mean each field."""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from slimml.errors import ConfigError
from slimml.runtime.tasks.limits import surrogate_at

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
MAX_BEAMS = 64  # beams a prompt at most
_DIGITS = re.compile(r"\s*[0-9]+\s*")  # a token id written as text (a JSON object's key)
MAX_STOP_STRINGS = 16  # OpenAI takes 4; more than a handful is a mistake, not a use
MAX_STOP_CHARS = 4096  # a stop string is text the answer may end on, not a document; checked before tokenizing it
# other tools' names for these options (llama-cpp-python's, OpenAI's), named in the refusal
_PEER_NAMES = {"max_tokens": " (max_tokens is max_new_tokens here.)", "repeat_penalty": " (repeat_penalty is "
               "repetition_penalty here.)", "n_predict": " (n_predict is max_new_tokens here.)",
               "stop_sequences": " (stop_sequences is stop here.)", "num_return_sequences": " (for several answers, repeat the "
               "prompt in the list, each with its own seed: seed=[0, 1, ...].)"}
GREEDY_BELOW = 1e-5  # a temperature below this picks the most likely token (as vLLM): dividing by less overflows


@dataclass(frozen=True)
class GenerationConfig:
    """How to continue a prompt.

    Attributes:
        max_new_tokens: tokens to add per prompt at most. A prompt plus max_new_tokens past the
            model's context is refused (with ``truncate``, fewer new tokens are made instead).
        min_new_tokens: the end ids (eos and stop_token_ids) cannot be chosen before this many
            new tokens, as transformers' ``min_new_tokens`` (stop strings still stop).
        temperature: divides the logits before sampling; 0 (or below 1e-5) picks the most likely token (greedy).
        do_sample: False is greedy whatever the temperature, as transformers reads it; True with
            no temperature (or 0, which transformers refuses) samples at 1, transformers' default;
            None follows the temperature.
        top_k: sample among the k most likely tokens only; 0 turns it off. ``generate``, ``stream``
            and ``chat`` given options by name sample among 50 where neither they nor the model's
            generation config name a top-k, as transformers does (a server's request too); a
            ``GenerationConfig`` passed as ``config=`` is taken whole.
        top_p: sample among the most likely tokens whose probabilities add up to top_p (nucleus);
            1 turns it off.
        min_p: sample only among tokens at least ``min_p`` times as likely as the most likely one
            (after temperature, top-k and top-p), as transformers' and llama.cpp's ``min_p``; 0 turns it off.
        typical_p: sample among the tokens whose information is closest to the expected (locally
            typical sampling) until their probabilities add up to typical_p, as transformers'
            ``typical_p`` and llama.cpp's; 1 turns it off.
        epsilon_cutoff: sample only among tokens at least this likely (truncation sampling, after
            the ones above), as transformers' ``epsilon_cutoff``; 0 turns it off.
        eta_cutoff: sample only among tokens at least min(eta, sqrt(eta) x exp(-entropy)) likely,
            as transformers' ``eta_cutoff``; 0 turns it off.
        num_beams: more than 1: beam search over this many hypotheses a prompt, as transformers'
            ``num_beams`` without sampling (each beam holds a cache row of its own); the answer
            comes whole at the end, one piece when streamed. Greedy settings only: no sampling,
            stop strings, logit bias, OpenAI penalties, log-probabilities or ``response_format``.
        length_penalty: beam search's exponent of the length a finished hypothesis's summed
            log-probabilities are divided by (above 0 favours longer answers), as transformers'.
        early_stopping: beam search ends a prompt's search when ``num_beams`` hypotheses are
            finished (True), when no live beam can do better by transformers' estimate (False),
            or only when none can whatever its length ("never").
        repetition_penalty: logits of tokens already in the prompt or the output are divided by it
            (multiplied where negative), as transformers does; 1 turns it off.
        no_repeat_ngram_size: a token that would complete an n-gram of this many tokens that the
            prompt or the answer already holds is not chosen, as transformers'
            ``no_repeat_ngram_size`` (a ``response_format``'s required tokens excepted: the format
            wins); 0 turns it off.
        presence_penalty: subtracted from the logit of every token the answer already holds, as
            OpenAI's ``presence_penalty`` (from -2 to 2; 0 turns it off). Counts the answer's tokens
            only, not the prompt's.
        frequency_penalty: subtracted from a token's logit once for every time the answer already
            holds it, as OpenAI's ``frequency_penalty`` (from -2 to 2; 0 turns it off).
        logit_bias: ``{token id: bias}`` added to the model's logits before any processor, as
            OpenAI's ``logit_bias`` (from -100 to 100: -100 keeps a token out, 100 all but forces
            it; small values make a token more or less likely). Ids past the vocabulary are refused.
            Kept as sorted ``(id, bias)`` pairs (ids given as text, as JSON keys are, become ints).
        logprobs: also return each new token's log-probability under the model (its softmax before
            any processor) and this many most likely alternatives, as OpenAI's ``top_logprobs``
            (0 to 20); None turns it off. ``Generation.logprobs`` holds them.
        response_format: hold the answer to a format, as OpenAI's ``response_format``:
            ``{"type": "json_object"}`` (a JSON object), ``{"type": "json_schema", "json_schema":
            {"name": ..., "schema": {...}}}`` (JSON that the schema describes), or slimml's
            ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": <Lark>}``;
            None or ``{"type": "text"}``: free text
            (:mod:`~slimml.runtime.tasks.generation.structured`).
        seed: seeds numpy's ``Generator`` for sampling. Each prompt draws from its own generator,
            so the same seed gives a prompt the same draws alone or in any batch (the same prompt
            twice in a batch too; the same tokens where the logits are the same: fp32 and 8-bit
            artifacts, not always 4-bit ones, whose kernel sums one row and several differently); a
            list gives one seed per prompt. None draws fresh seeds.
        stop: strings that end a prompt's generation where they appear in its text (also across
            token boundaries); the stop string itself is not returned.
        stop_token_ids: token ids that end a prompt's generation, beside the end-of-sequence id.
        eos_token_id: the end-of-sequence id(s); None takes the tokenizer's.
        pad_token_id: left-pads shorter prompts of a batch (masked out); None takes the tokenizer's or 0.
        skip_special_tokens: leave special tokens (``<|im_start|>``, harmony's ``<|channel|>``)
            out of the text, as transformers' ``decode`` and vLLM do by default; False keeps them
            (``chat`` sets it for a template whose format is written in them). The end id that closes
            an answer is never part of its text.
        truncate: a prompt longer than the model's context keeps its last tokens instead of
            being refused.
        prompt_lookup: positions a pass may also compute by guessing that the text repeats what
            followed its last few tokens earlier in the prompt or the text (prompt lookup): the
            tokens are the same, fewer passes where text quotes its prompt (summaries, edits,
            answers from passages). One prompt, a fused artifact; 0 turns it off (e.g. 4).

    Example:
        >>> GenerationConfig(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=0, stop=["\\n\\n"])
    """

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    temperature: float = 0.0  # greedy by default: same answer every call, as llama.cpp with --temp 0
    do_sample: bool | None = None
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    logprobs: int | None = None
    response_format: dict | None = None
    seed: int | tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    skip_special_tokens: bool = True
    truncate: bool = False
    prompt_lookup: int = 0

    def __post_init__(self) -> None:
        _whole("max_new_tokens", self.max_new_tokens, 1)
        _whole("min_new_tokens", self.min_new_tokens, 0)
        _whole("prompt_lookup", self.prompt_lookup, 0, "(0 turns it off)")
        _whole("no_repeat_ngram_size", self.no_repeat_ngram_size, 0, "(0 turns it off)")
        _number("temperature", self.temperature, "a finite number >= 0 (0 is greedy)", lambda v: 0 <= v < float("inf"))  # < GREEDY_BELOW: greedy
        _whole("top_k", self.top_k, 0, "(0 turns it off)")
        _number("top_p", self.top_p, "in (0, 1] (1 turns it off)", lambda v: 0 < v <= 1)
        _number("min_p", self.min_p, "in [0, 1] (0 turns it off)", lambda v: 0 <= v <= 1)
        _number("typical_p", self.typical_p, "in (0, 1] (1 turns it off)", lambda v: 0 < v <= 1)
        for name in ("epsilon_cutoff", "eta_cutoff"):
            _number(name, getattr(self, name), "in [0, 1) (0 turns it off)", lambda v: 0 <= v < 1)
        _number("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 turns it off)",
                lambda v: 0 < v < float("inf"))
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), "from -2 to 2 (0 turns it off)", lambda v: -2 <= v <= 2)
        object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS} (the alternatives to return "
                              f"beside each token's own log-probability) or None (off), got {self.logprobs!r}.")
        if self.response_format is not None:
            from slimml.runtime.tasks.generation.structured import grammar_of

            object.__setattr__(self, "grammar", grammar_of(self.response_format))  # checked once, here
        seed = self.seed
        if seed is not None and not is_int(seed) and not (
                isinstance(seed, (list, tuple)) and seed and all(is_int(v) for v in seed)):
            raise ConfigError(f"seed must be an integer, a list of them (one per prompt) or None, got {seed!r}; "
                              "pass e.g. seed=0.")
        if seed is not None and any(int(v) < 0 for v in (seed if isinstance(seed, (list, tuple)) else [seed])):
            raise ConfigError(f"seed must not be negative, got {seed!r}; pass a seed of 0 or more (e.g. seed=0).")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if len(stop) > MAX_STOP_STRINGS:
            raise ConfigError(f"stop has {len(stop)} strings, more than {MAX_STOP_STRINGS}; keep the ones that matter.")
        if any(s == "" for s in stop):
            raise ConfigError("stop has an empty string, which would stop at once; remove it.")
        for i, s in enumerate(stop):
            if len(s) > MAX_STOP_CHARS:
                raise ConfigError(f"stop string {i} has {len(s):,} characters, more than {MAX_STOP_CHARS:,}; an answer "
                                  "stops on a short piece of text: give the few words it ends on.")
            if (at := surrogate_at(s)) is not None:
                raise ConfigError(f"stop string {i} is not valid Unicode (a lone surrogate at position {at}); remove it.")
        ids = (self.stop_token_ids,) if is_int(self.stop_token_ids) else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
            raise ConfigError(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}.")
        eos = self.eos_token_id
        if eos is not None and not (is_int(eos) and eos >= 0) and not (
                isinstance(eos, (list, tuple)) and all(is_int(i) and i >= 0 for i in eos)):
            raise ConfigError(f"eos_token_id must be a token id >= 0, a list of them, or None, got {eos!r}.")
        if self.pad_token_id is not None and not (is_int(self.pad_token_id) and self.pad_token_id >= 0):
            raise ConfigError(f"pad_token_id must be a token id >= 0 or None, got {self.pad_token_id!r}.")
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise ConfigError(f"do_sample must be True, False or None, got {self.do_sample!r}.")
        if self.do_sample and self.temperature == 0:
            object.__setattr__(self, "temperature", 1.0)
        for name in ("truncate", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if isinstance(seed, list):
            object.__setattr__(self, "seed", tuple(seed))
        if isinstance(eos, (list, tuple)):
            object.__setattr__(self, "eos_token_id", tuple(int(i) for i in eos))
        self._check_beams()

    def _check_beams(self) -> None:
        _whole("num_beams", self.num_beams, 1, "(1: no beam search)")
        if self.num_beams > MAX_BEAMS:
            raise ConfigError(f"num_beams must be at most {MAX_BEAMS} (each beam holds a cache row of its own), got "
                              f"{self.num_beams}; beam searches use 2 to 8.")
        _number("length_penalty", self.length_penalty, "a finite number (1: none)", lambda v: abs(v) < float("inf"))
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ConfigError(f'early_stopping must be True, False or "never", got {self.early_stopping!r}.')
        if self.num_beams == 1:
            return
        if not self.greedy:
            raise ConfigError(f"num_beams={self.num_beams} with sampling (beam sampling) is not supported; pass "
                              "temperature=0 for beam search, or num_beams=1 to sample.")
        used = [name for name in ("stop", "logit_bias", "presence_penalty", "frequency_penalty", "response_format",
                                  "prompt_lookup") if getattr(self, name)] + (["logprobs"] if self.logprobs is not None else [])
        if used:
            raise ConfigError(f"beam search (num_beams={self.num_beams}) does not take {', '.join(used)}; drop "
                              f"{'them' if len(used) > 1 else 'it'}, or pass num_beams=1.")

    grammar = None  # llguidance's grammar of response_format (None: free text), set by __post_init__

    @property
    def greedy(self) -> bool:
        """True when every step takes the most likely token (temperature 0, or below ``GREEDY_BELOW``, top_k 1, or
        do_sample=False)."""
        return self.do_sample is False or self.temperature < GREEDY_BELOW or self.top_k == 1

    @classmethod
    def of(cls, config: GenerationConfig | None = None, defaults: Mapping[str, Any] | None = None,
           **options: Any) -> GenerationConfig:
        """``config`` (default: all defaults) with ``options`` set; an unknown option is refused,
        naming the ones there are.

        ``defaults``: the model's own settings (:mod:`~slimml.runtime.tasks.generation.defaults`),
        taken by each field ``options`` leave out, where no ``config`` is given (a ``config`` is
        taken whole: its fields are what it says, 0 and off included). The model's temperature
        applies only where the generation samples: by the model's ``do_sample``, or the caller's
        ``do_sample=True`` (a model that does not sample then samples at its file's temperature, as
        transformers does); a caller's own ``temperature`` decides alone: ``temperature=0`` is
        greedy whatever the model's ``do_sample``."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"unknown generation option {unknown[0]!r}; the options are {', '.join(sorted(names))}."
                              + _PEER_NAMES.get(unknown[0], ""))
        if config is not None and not isinstance(config, cls):
            raise ConfigError(f"config must be a GenerationConfig, got {type(config).__name__}.")
        if config is not None:
            return replace(config, **options) if options else config
        if defaults:
            taken = {k: v for k, v in defaults.items() if k not in options}
            sampled = options.get("do_sample", defaults.get("do_sample"))
            if "temperature" in options or not sampled:  # the caller's own temperature, or greedy: the model's
                taken = {k: v for k, v in taken.items() if k not in ("do_sample", "temperature")}  # temperature unused
            options = {**taken, **options}
            if taken.get("num_beams", 1) > 1:  # the model's beams give way where the call asks what beams do not do
                try:
                    return cls(**options)
                except ConfigError:  # the caller's own settings are still checked (raised again without the beams)
                    options = {k: v for k, v in options.items()
                               if not (k in taken and k in ("num_beams", "length_penalty", "early_stopping"))}
        return cls(**options)


def is_int(v: Any) -> bool:
    """A whole number (a numpy one too), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _bias(value: Any) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as sorted ``(id, bias)`` pairs (hashable, one order), or None where empty.
    Ids may come as text, as JSON object keys do."""
    if value is None:
        return None
    pairs = value.items() if isinstance(value, dict) else value
    fix = "give {token id: bias from -100 to 100}, e.g. {50256: -100}"
    try:
        pairs = list(pairs)
    except TypeError:
        raise ConfigError(f"logit_bias must be a mapping of token ids to biases, got {value!r}; {fix}.") from None
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigError(f"logit_bias must be a mapping of token ids to biases, got {value!r}; {fix}.")
        key, bias = pair
        token = int(key) if isinstance(key, str) and _DIGITS.fullmatch(key) else key
        if not is_int(token) or token < 0:
            raise ConfigError(f"logit_bias has the key {key!r}, which is not a token id (a whole number >= 0); {fix}.")
        if not isinstance(bias, numbers.Real) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise ConfigError(f"logit_bias gives token {token} the bias {bias!r}; a bias is a number from -100 to 100.")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items())) or None


def _whole(name: str, v: Any, lo: int, note: str = "") -> None:
    if not is_int(v) or v < lo:
        raise ConfigError(f"{name} must be a whole number >= {lo}{' ' + note if note else ''}, got {v!r}.")


def _number(name: str, v: Any, rule: str, ok) -> None:
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or v != v or not ok(v):
        raise ConfigError(f"{name} must be {rule}, got {v!r}.")
