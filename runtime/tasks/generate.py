"""Greedy text generation for decoder artifacts, with a KV cache when the artifact has one.

Two kinds of decoder artifact:

- ``--task text-generation-with-past`` (recommended): inputs ``input_ids``, ``attention_mask``,
  ``position_ids`` and ``past_key_values.N.key/value``; outputs ``logits`` and ``present.N.*``.
  The splitter routes each layer's past/present to that layer's shard, so the cache lives beside
  the streamed layers: the prompt is one pass, and each new token one pass over one position.
- ``--task text-generation`` (cache-free): each new token is one pass over the whole sequence.

Either way a streamed model loads each shard once per token (never once per layer per token), and
prompts are batched (left-padded) so one pass serves them all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from slimml.errors import FeedError, SlimmlError

if TYPE_CHECKING:
    from slimml.runtime.loader import Model

_EOS_TOKENS = ("</s>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>", "<eos>")


@dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
        tokens: per prompt, the new token ids (stopping at, and including, the end-of-sequence id).
        texts: per prompt, the new text decoded, when the prompts were strings.
        seconds: wall time of the whole generation.
        passes: model passes run (one per new token).
        prefill_s: wall time of the first pass (the prompts; time to the first token).
    """

    tokens: list[list[int]]
    texts: list[str] | None = None
    seconds: float = 0.0
    passes: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the first pass."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens per second after the first (each one pass over one position per prompt)."""
        later = sum(max(len(t) - 1, 0) for t in self.tokens)
        return later / (self.seconds - self.prefill_s) if self.seconds > self.prefill_s and later else 0.0


def generate(
    model: Model,
    prompts: list[str] | list[list[int]] | np.ndarray,
    max_new_tokens: int = 32,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Generation:
    """Continue each prompt greedily (the most likely token each step), batched.

    Args:
        model: a loaded ``text-generation`` artifact (streamed or resident).
        prompts: texts (the artifact must ship a tokenizer), or token id lists / a 2-D id array.
        max_new_tokens: tokens to add per prompt at most.
        eos_token_id: stop a prompt once it emits this id (default: the tokenizer's end token).
        pad_token_id: the id used to left-pad shorter prompts (masked out; default 0 or the
            tokenizer's pad id).

    Returns:
        A :class:`Generation` with the new tokens (and texts) per prompt.

    Example:
        >>> model = load("artifacts/my-llama", memory_budget="2GB")
        >>> model.generate(["The capital of France is"], max_new_tokens=8).texts
    """
    names = {t.name for t in model.manifest.inputs}
    if not model.manifest.task.startswith("text-generation") or "input_ids" not in names or "logits" not in {t.name for t in model.outputs}:
        raise SlimmlError(
            f"the artifact {model.folder} is a {model.manifest.task!r} model without input_ids -> logits; "
            "generate() needs a decoder converted with --task text-generation."
        )
    if max_new_tokens < 1:
        raise FeedError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    texts = isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts)
    tok = model.text.tokenizer if model.text is not None else None
    if texts:
        if tok is None:
            raise SlimmlError(f"the artifact {model.folder} has no tokenizer; pass token ids instead of text.")
        ids = [e.ids[: sum(e.attention_mask)] for e in tok.encode_batch(list(prompts))]
    else:
        ids = [list(map(int, p)) for p in np.asarray(prompts, dtype=object)] if len(prompts) else []
    if not ids or any(len(p) == 0 for p in ids):
        raise FeedError("generate() needs at least one non-empty prompt.")
    if eos_token_id is None and tok is not None:
        eos_token_id = next((tok.token_to_id(t) for t in _EOS_TOKENS if tok.token_to_id(t) is not None), None)
    if pad_token_id is None:
        pad_token_id = int((model.manifest.tokenizer or {}).get("pad_id") or 0)

    t0 = time.perf_counter()
    batch = len(ids)
    width = max(map(len, ids))
    seq = np.full((batch, width), pad_token_id, dtype=np.int64)
    mask = np.zeros((batch, width), dtype=np.int64)
    for i, p in enumerate(ids):  # left padding: every prompt's last token sits at the end
        seq[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    new: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, dtype=bool)
    passes = 0
    cache = _empty_cache(model, batch)  # None for a cache-free artifact
    for _ in range(max_new_tokens):
        step_ids = seq if cache is None or passes == 0 else seq[:, -1:]
        feeds = {"input_ids": step_ids, "attention_mask": mask}
        if "position_ids" in names:
            pos = np.where(mask > 0, np.cumsum(mask, axis=1) - 1, 1).astype(np.int64)
            feeds["position_ids"] = pos[:, -step_ids.shape[1]:]
        if cache is not None:
            feeds.update(cache)
        out = model.run(feeds)
        if passes == 0:
            prefill_s = time.perf_counter() - t0
        logits = out["logits"]  # (B, T, vocab)
        if cache is not None:
            cache = {name: out[name.replace("past_key_values.", "present.", 1)] for name in cache}
        passes += 1
        nxt = logits[:, -1, :].argmax(axis=-1).astype(np.int64)  # (B,)
        nxt = np.where(done, pad_token_id, nxt)
        for i in np.flatnonzero(~done):
            new[i].append(int(nxt[i]))
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
        mask = np.concatenate([mask, (~done | (nxt == eos_token_id))[:, None].astype(np.int64)], axis=1)
        if done.all():
            break
    out_texts = [tok.decode(t, skip_special_tokens=True) for t in new] if texts else None
    return Generation(tokens=new, texts=out_texts, seconds=time.perf_counter() - t0, passes=passes,
                      prompt_tokens=sum(map(len, ids)), prefill_s=prefill_s)


def _empty_cache(model: Model, batch: int) -> dict[str, np.ndarray] | None:
    """A zero-length cache per ``past_key_values.*`` input (the first step has no past), or None."""
    outputs = {t.name for t in model.outputs}
    cache = {}
    for t in model.manifest.inputs:
        if not t.name.startswith("past_key_values."):
            continue
        if t.name.replace("past_key_values.", "present.", 1) not in outputs:
            raise SlimmlError(f"the artifact takes {t.name} but outputs no matching present.*; re-convert it.")
        if not all(isinstance(d, int) for d in t.shape[1:2] + t.shape[3:]):
            raise SlimmlError(f"cannot tell the cache shape of {t.name} ({t.shape}); re-convert the model.")
        shape = [batch, t.shape[1], 0, *t.shape[3:]]  # (B, kv_heads, past=0, head_dim)
        cache[t.name] = np.zeros(shape, dtype=np.dtype(t.dtype))
    return cache or None
