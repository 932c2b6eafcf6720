"""Text in, tensors out: the shipped tokenizer, batches of texts, and the prompts put before them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from slimml.errors import ArtifactError, FeedError
from slimml.runtime.tasks.limits import Limits, shown, tokenized

if TYPE_CHECKING:
    from slimml.runtime.tasks.inputs.pooling import Pooler


class TextEncoder:
    """Tokenizes texts into the int64 feeds a transformer expects, padded per batch."""

    def __init__(self, path: Path, spec: dict[str, Any], input_names: list[str], limits: Limits | None = None):
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ArtifactError(f"could not read the tokenizer {path.name}: {e}; re-convert the model.") from None
        self.max_length = int(spec.get("max_length") or 512)
        self.tokenizer.enable_truncation(max_length=self.max_length)
        self.tokenizer.no_padding()  # batches are padded here, each to its own longest text
        pad_id = spec.get("pad_id")
        if pad_id is None:
            pad_id = self.tokenizer.token_to_id(str(spec.get("pad_token") or "[PAD]"))
        self.pad_id = int(pad_id or 0)
        self.input_names = input_names
        self.limits = limits or Limits()  # texts are cut to limits.max_text_chars before tokenizing
        self.pad_to: int | None = None  # batches padded to at least this many tokens (SigLIP's 64, as it was trained)
        self._windowed: Tokenizer | None = None  # the window calls' copy (made on first use)
        self._window_lock = threading.Lock()

    def encodings(self, texts: list[str] | list[tuple[str, str]]) -> list:
        """One unpadded, truncated encoding per text (``.ids``, ``.attention_mask``, ``.type_ids``);
        a ``(text, text)`` pair is encoded as one input, as the tokenizer joins a pair (a
        cross-encoder's query and passage; longest first where it must be cut)."""
        check_texts(texts)
        if not texts:
            raise FeedError("the list of texts is empty; give at least one text.")
        cut = self.limits.cut
        cut_texts = [cut([t])[0] if isinstance(t, str) else tuple(cut(list(t))) for t in texts]
        encs = tokenized(lambda: self.tokenizer.encode_batch(cut_texts))
        for i, (t, c, e) in enumerate(zip(texts, cut_texts, encs)):
            if c != (t if isinstance(t, str) else tuple(t)) and not e.overflowing:
                encs[i] = self._read_more(t)  # the cut held fewer tokens than the model reads (blank runs)
        return encs

    def _read_more(self, text: str | tuple[str, str]):
        """The encoding of ``text`` as its tokenizer truncates it, for a text whose first
        ``limits.max_text_chars`` characters hold fewer tokens than the model reads (spaces,
        control or combining characters, which make none): more of it, four times as much each
        try, until the tokens fill the model's length or the text is read whole."""
        n = self.limits.max_text_chars
        while True:
            n *= 4
            piece = text[:n] if isinstance(text, str) else tuple(x[:n] for x in text)
            e = tokenized(lambda: self.tokenizer.encode(piece) if isinstance(piece, str) else self.tokenizer.encode(*piece))
            if e.overflowing or piece == (text if isinstance(text, str) else tuple(text)):
                return e

    def batch(self, encs: list, pad_to: int | None = None) -> dict[str, np.ndarray]:
        """Feeds for ``encs``, right-padded to the longest of them (or to ``pad_to``, or the encoder's own)."""
        tensors = self.tensors(encs, pad_to)
        return {k: v for k, v in tensors.items() if k in self.input_names}

    def tensors(self, encs: list, pad_to: int | None = None) -> dict[str, np.ndarray]:
        """:meth:`batch`'s tensors, ``attention_mask`` among them whether or not the model takes it
        (SigLIP's text tower takes the ids alone; pooling still reads which tokens are real)."""
        width = max(max(len(e.ids) for e in encs), pad_to or 0, self.pad_to or 0)
        ids = np.full((len(encs), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encs), width), dtype=np.int64)
        types = np.zeros((len(encs), width), dtype=np.int64)
        for row, e in enumerate(encs):
            n = len(e.ids)
            ids[row, :n] = e.ids
            mask[row, :n] = e.attention_mask
            types[row, :n] = e.type_ids
        tensors = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        if "position_ids" in self.input_names:  # decoders: positions count real tokens, as transformers does
            tensors["position_ids"] = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        return tensors

    def __call__(self, texts: list[str], pad_to: int | None = None) -> dict[str, np.ndarray]:
        return self.batch(self.encodings(texts), pad_to)

    # -- windows over long inputs (token classification's stride, question answering) ---------

    def _windowing(self) -> Tokenizer:
        """A copy of the tokenizer whose truncation the window calls set (the shared one keeps its
        own), made once (a copy costs 37 ms for BERT's vocabulary); use under ``_window_lock``."""
        if self._windowed is None:
            self._windowed = Tokenizer.from_str(self.tokenizer.to_str())
            self._windowed.no_padding()
        return self._windowed

    def token_counts(self, texts: list[str]) -> list[int]:
        """Each text's tokens, uncut and without special tokens."""
        with self._window_lock:
            tokenizer = self._windowing()
            tokenizer.no_truncation()
            return [len(e.ids) for e in tokenized(lambda: tokenizer.encode_batch(texts, add_special_tokens=False))]

    def special_tokens(self, pair: bool) -> int:
        """The special tokens the tokenizer adds to one text (or to a pair)."""
        return self.tokenizer.num_special_tokens_to_add(pair)

    def windows(self, inputs: list, length: int, stride: int, strategy: str = "longest_first") -> list[tuple[int, Any]]:
        """``(input index, encoding)`` for each window of ``length`` tokens (specials included) that
        ``inputs`` (texts, or pairs whose ``strategy`` side is cut) take, windows of one input
        overlapping by ``stride`` tokens, as transformers' fast tokenizers make them."""
        with self._window_lock:
            tokenizer = self._windowing()
            tokenizer.enable_truncation(max_length=length, stride=stride, strategy=strategy)
            encs = tokenized(lambda: tokenizer.encode_batch(inputs))
        return [(i, w) for i, enc in enumerate(encs) for w in (enc, *enc.overflowing)]


def window_outputs(run, text: TextEncoder, encs: list, batch_size: int, names: tuple[str, ...]) -> list[dict[str, np.ndarray]]:
    """Each encoding's ``names`` outputs of ``run`` (float32, cut to its own tokens), in order, run
    in :func:`budget_batches` of like lengths."""
    out: list[dict[str, np.ndarray]] = [{} for _ in encs]
    for rows in budget_batches([len(e.ids) for e in encs], batch_size, WINDOW_BATCH_TOKENS):
        got = run(text.batch([encs[r] for r in rows]))
        for row, r in enumerate(rows):
            n = len(encs[r].ids)
            out[r] = {name: got[name][row, :n].astype(np.float32) for name in names}
    return out


def listed(texts: Any) -> Any:
    """Texts in the containers sentence-transformers' ``encode`` and transformers' pipelines take
    besides a list, as a list: a numpy array of strings (a data frame column's ``.values``), a pandas
    Series, a generator. A text, a list, a tuple, a dict or a numeric array is given back as it is
    (for the caller's check to name, or to read as token ids)."""
    if isinstance(texts, np.ndarray):
        return texts.tolist() if texts.dtype.kind in "UO" else texts
    if not isinstance(texts, (str, bytes, list, tuple, dict)) and hasattr(texts, "__iter__") and not hasattr(texts, "keys"):
        return list(texts)  # a mapping (a tokenizer's BatchEncoding) stays one, for the caller to name
    return texts


def check_texts(texts: Any) -> None:
    """Refuse anything but a list of texts (or of ``[text, text]`` pairs), naming the first item that is not one
    (a missing value from a data frame, NaN or None, most often)."""
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise FeedError(f"texts must be a list of strings (or of [text, text] pairs), got {type(texts).__name__}; wrap "
                        "a single text as [text].")
    bad = next((i for i, t in enumerate(texts) if not (isinstance(t, str) or _pair(t))), None)
    if bad is not None:
        item = texts[bad]
        raise FeedError(f"texts must be strings (or [text, text] pairs), and item {bad} is {shown(item)} "
                        f"({type(item).__name__}); drop or fill missing values, or make each item a text with str().")


def _pair(t: Any) -> bool:
    return isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t)


def check_batch_size(batch_size: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise FeedError(f"batch_size must be a whole number >= 1, got {shown(batch_size)}.")


def sorted_batches(lengths: list[int], batch_size: int) -> list[np.ndarray]:
    """Row indices of texts with token counts ``lengths`` in batches of ``batch_size``, longest
    first (as sentence-transformers sorts), so each batch pads little."""
    order = np.argsort([-n for n in lengths], kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(lengths), batch_size)]


WINDOW_BATCH_TOKENS = 1024  # tokens a batch of windows holds at most (budget_batches; measured in its docstring)


def budget_batches(lengths: list[int], batch_size: int, tokens: int) -> list[list[int]]:
    """Row indices in batches, longest first, each of at most ``batch_size`` rows and, padded to its
    longest, at most ``tokens`` tokens (one row at least). On CPU a batch of long rows costs more a
    token than the rows one by one (BERT-base, 384-token windows: batches of 32 took 2.7x the time
    of single windows), while short rows gain from batching."""
    out: list[list[int]] = []
    for r in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and len(out[-1]) < batch_size and (len(out[-1]) + 1) * lengths[out[-1][0]] <= tokens:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def encode_texts(run, text: TextEncoder, pooler: Pooler, encs: list, batches: list[np.ndarray],
                 show_progress: bool = False, lanes: int = 1) -> np.ndarray:
    """Sentence embeddings in input order: each batch of ``encs`` (from :func:`sorted_batches`)
    padded only to its own longest text, run through ``run(feeds) -> outputs`` and pooled by
    ``pooler``, ``lanes`` batches at a time (:mod:`slimml.runtime.tasks.lanes`)."""
    from slimml.runtime.tasks.lanes import in_lanes

    def embed(rows: np.ndarray) -> np.ndarray:
        tensors = text.tensors([encs[r] for r in rows])
        return pooler(run({k: v for k, v in tensors.items() if k in text.input_names}), tensors["attention_mask"])

    done = in_lanes(embed, batches, lanes)
    if show_progress:
        from rich.console import Console
        from rich.progress import track

        done = track(done, total=len(batches), description="encoding", transient=True,
                     console=Console(stderr=True))  # stdout holds what the caller prints (--json)
    out: np.ndarray | None = None
    for rows, emb in zip(batches, done):
        if out is None:
            out = np.empty((len(encs), emb.shape[1]), dtype=emb.dtype)
        out[rows] = emb
    return out


def prompt_text(pooling: Any, prompt_name: str | None = None, prompt: str | None = None) -> str:
    """The text put before each text by an embedding model whose ``pooling`` record holds its
    sentence-transformers prompts: ``prompt`` itself, else the prompt named ``prompt_name``, else
    the model's default prompt (or none)."""
    if prompt is not None:
        if not isinstance(prompt, str):
            raise FeedError(f"prompt must be a text, got {type(prompt).__name__}; pass the words to put before each text.")
        return prompt
    prompts = dict(pooling.get("prompts") or {}) if pooling is not None else {}
    if prompt_name is None:
        default = pooling.get("default_prompt") if pooling is not None else None
        return prompts.get(default, "") if default is not None else ""
    if prompt_name not in prompts:
        have = f"its prompts are {', '.join(map(repr, prompts))}" if prompts else "it has none"
        raise FeedError(f"prompt_name {prompt_name!r} is not one of this model's prompts ({have}); name one of them, "
                        "or put the words before each text yourself.")
    return prompts[prompt_name]

