"""Checking what a caller feeds a model against the manifest, with messages that say the fix."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from slimml.errors import FeedError
from slimml.runtime.artifact.manifest import TensorSpec

LOGITS_INDEX = "logits_index"  # (B, n): the positions of a pass whose logits a fused decoder computes


SEQUENCE_AXES = ("seq", "length", "token")  # names of the dynamic axes that count tokens


TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # a model's own tokens


def counts_tokens(axis: str, input_name: str = "") -> bool:
    """Whether a dynamic axis counts this model's tokens. A decoder's ``encoder_sequence_length``
    axes are the encoder's length (audio frames for Whisper), bounded by the encoder, not here; the
    encoder's own ``input_ids`` (an encoder-decoder's, which carry that name) are bounded here."""
    name = axis.lower()
    return any(k in name for k in SEQUENCE_AXES) and (not name.startswith("encoder") or input_name in TOKEN_INPUTS)


class FeedChecker:
    """:func:`check_feeds` compiled once for a model's inputs, with a fast path for good feeds.

    ``run`` calls it on every call, so it must cost little next to a batch-1 pass of a small model
    (goal: under 2% of it). Feeds that pass every check take one tight loop; anything else goes
    to :func:`check_feeds`, which collects every problem and raises them in one message.
    """

    def __init__(self, specs: list[TensorSpec], max_seq: int | None = None, id_limits: Mapping[str, int] | None = None):
        self.specs, self.max_seq, self.id_limits = specs, max_seq, dict(id_limits or {})
        self.names = {s.name for s in specs}
        self.plan = []
        for s in specs:
            fixed = [(d, w) for d, w in enumerate(s.shape) if isinstance(w, int)]
            named = [(d, w) for d, w in enumerate(s.shape) if isinstance(w, str)]
            seq = [d for d, w in named if counts_tokens(w, s.name)] if max_seq is not None else []
            dtype = np.dtype(s.dtype)
            ids = (s.name in self.id_limits or s.name == LOGITS_INDEX) and dtype.kind in "iu"
            unsigned = np.dtype(f"u{dtype.itemsize}") if ids else None  # ids seen unsigned: negatives are huge
            self.plan.append((s.name, dtype, len(s.shape), fixed, named, seq, unsigned, dtype.kind in "fc"))
        self.sums = sum_axes(specs)

    def __call__(self, feeds: Mapping[str, object], allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
        """Checked feeds as contiguous numpy arrays; raises FeedError as :func:`check_feeds` does."""
        if type(feeds) is dict and feeds.keys() == self.names:  # the fast path: plain loops, few numpy calls
            out, axes, max_seq = {}, {}, self.max_seq
            for name, dtype, rank, fixed, named, seq, unsigned, floats in self.plan:
                v = feeds[name]
                if type(v) is not np.ndarray or v.dtype != dtype or v.ndim != rank:
                    break
                shape = v.shape
                if rank and not shape[0]:
                    break
                bad = False
                for d, w in fixed:
                    bad = bad or shape[d] != w
                for d in seq:
                    bad = bad or shape[d] > max_seq
                for d, w in named:
                    bad = bad or axes.setdefault(w, shape[d]) != shape[d]
                if bad:
                    break
                if v.size:
                    # one pass finds ids past the end and, seen unsigned, negative ones. argmax has
                    # no ufunc-reduction set-up: right after an ORT pass has evicted the caches, 128
                    # ids took 12.7 us by argmax, 16.6 us by max over a list, 31 us by .max()
                    if unsigned is not None:  # ids below their table's rows; logits_index below the pass's length
                        u = v.view(unsigned)
                        limit = self.id_limits[name] if name in self.id_limits else _positions(feeds)
                        if limit is None or u.item(u.argmax()) >= limit:
                            break
                    if floats and not allow_nonfinite and not _sum_finite(v) and not np.isfinite(v).all():
                        break  # the sum is finite unless some value is not (or it overflowed: then look)
                out[name] = v if v.flags.c_contiguous else np.ascontiguousarray(v)
            else:
                if all(axes[w] == sum(axes[p] for p in parts) for w, parts in self.sums):
                    return out
        return check_feeds(feeds, self.specs, self.max_seq, allow_nonfinite, self.id_limits)


def check_feeds(
    feeds: Mapping[str, object],
    specs: list[TensorSpec],
    max_seq: int | None = None,
    allow_nonfinite: bool = False,
    id_limits: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Return ``feeds`` as contiguous numpy arrays after checking names, dtypes and ranks.

    Every problem is collected before raising, so one error lists them all.

    Args:
        max_seq: the longest sequence the model takes; a sequence axis (a dynamic axis named
            like ``sequence_length``) longer than this is refused with the maximum named.
        allow_nonfinite: let NaN and inf through in float inputs. By default they are refused:
            they spread silently through every layer and come out as NaN outputs.
        id_limits: id inputs with the rows of the table they index (``input_ids``: the vocabulary,
            ``token_type_ids``: the segments); values outside ``[0, rows)`` are refused (a negative
            id would otherwise wrap around silently).

    Raises:
        FeedError: unknown or missing names, wrong dtype, wrong rank, a fixed dimension that
            differs, an empty batch (other axes may be zero-length, as a first
            decoding step's past is), inputs whose shared dynamic axes disagree, a sequence
            longer than ``max_seq``, NaN/inf in a float input, or a ``logits_index`` position
            outside the pass's tokens.
    """
    if not isinstance(feeds, Mapping):
        raise FeedError(
            f"feeds must be a dict of input name to numpy array, got {type(feeds).__name__}; "
            f"the model's inputs are {[s.name for s in specs]}."
        )
    by_name = {s.name: s for s in specs}
    problems: list[str] = []
    unknown = [k for k in feeds if k not in by_name]
    if unknown:
        problems.append(f"unknown input(s) {unknown}")
    missing = [n for n in by_name if n not in feeds]
    if missing:
        problems.append(f"missing input(s) {missing}")
    if unknown or missing:
        problems.append(f"feed the model's inputs by name, exactly these: {list(by_name)}")
    out: dict[str, np.ndarray] = {}
    axes: dict[str, tuple[str, int]] = {}  # named dynamic axis -> (first input seen, its size)
    for name, spec in by_name.items():
        if name not in feeds:
            continue
        value = feeds[name]
        if not isinstance(value, np.ndarray):
            problems.append(
                f"input {name!r} is a {type(value).__name__}, expected a numpy array; "
                f"pass np.asarray(value, dtype=np.{spec.dtype})"
            )
            continue
        if value.dtype != np.dtype(spec.dtype):
            problems.append(
                f"input {name!r} has dtype {value.dtype}, expected {spec.dtype}; "
                f"convert it with .astype(np.{spec.dtype})"
            )
            continue
        if value.ndim != len(spec.shape):
            problems.append(
                f"input {name!r} has rank {value.ndim} (shape {list(value.shape)}), expected rank "
                f"{len(spec.shape)} (shape {spec.shape})"
            )
            continue
        for dim, (want, got) in enumerate(zip(spec.shape, value.shape)):
            if isinstance(want, int) and want != got:
                problems.append(f"input {name!r} has size {got} at dim={dim}, expected {want} (shape {spec.shape})")
            elif isinstance(want, str):
                long_seq = max_seq is not None and got > max_seq and counts_tokens(want, name)
                if long_seq and want not in axes:  # once per axis, not once per input sharing it
                    problems.append(
                        f"input {name!r} has {want}={got} at dim={dim}, but this model takes at most {max_seq} "
                        f"tokens; truncate to {max_seq} (model.tokenize and encode do so)"
                    )
                first = axes.setdefault(want, (name, got))
                if first[1] != got:
                    problems.append(
                        f"input {name!r} has {want}={got} at dim={dim}, but {first[0]!r} has {want}={first[1]}; "
                        "inputs that share an axis must agree"
                    )
        if value.ndim and value.shape[0] == 0:  # other axes may be empty: a first step's zero-length past
            problems.append(f"input {name!r} has an empty batch (shape {list(value.shape)}); give at least one item")
        elif value.size == 0:
            pass
        elif id_limits and name in id_limits and value.dtype.kind in "iu":
            rows = id_limits[name]
            bad = (value < 0) | (value >= rows)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                table = "the vocabulary" if name == "input_ids" else "the model's token types"
                problems.append(
                    f"input {name!r} holds {int(bad.sum())} id(s) outside {table} [0, {rows}), the "
                    f"first {int(value[where])} at index {where}; encode text with this model's tokenizer (model.tokenize)"
                )
        elif name == LOGITS_INDEX and value.dtype.kind in "iu" and (positions := _positions(out) or _positions(feeds)) is not None:
            bad = (value < 0) | (value >= positions)
            if bad.any():
                problems.append(
                    f"input {LOGITS_INDEX!r} asks for position {int(value[bad][0])}, outside this pass's 0..{positions - 1}; "
                    "give positions of the pass's own tokens (each row's last real one, or every one)"
                )
        elif value.dtype.kind in "fc" and not allow_nonfinite:
            bad = ~np.isfinite(value)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                problems.append(
                    f"input {name!r} holds {int(bad.sum())} NaN/inf value(s), the first at index {where}; they "
                    "would spread into NaN outputs. Clean the input (np.nan_to_num) or set "
                    "model.allow_nonfinite = True if your model handles them"
                )
        out[name] = np.ascontiguousarray(value)
    for w, parts in sum_axes(specs):
        if w in axes and all(p in axes for p in parts) and axes[w][1] != sum(axes[p][1] for p in parts):
            terms = " + ".join(f"{p}={axes[p][1]}" for p in parts)
            problems.append(f"input {axes[w][0]!r} has {w}={axes[w][1]}, but {terms} is {sum(axes[p][1] for p in parts)}; "
                            f"give it that length (a decoder's attention_mask covers the past and the new tokens)")
    if problems:
        raise FeedError("bad feeds: " + "; ".join(problems) + ".")
    return out


def sum_axes(specs: list[TensorSpec]) -> list[tuple[str, list[str]]]:
    """The dynamic axes named as a sum of others (``past_sequence_length + sequence_length``, a
    decoder's attention mask), with those others: a feed must make the sum hold."""
    named = {w for s in specs for w in s.shape if isinstance(w, str)}
    sums = {}
    for w in named:
        parts = [p.strip() for p in w.split("+")]
        if len(parts) > 1 and all(p in named for p in parts):
            sums[w] = parts
    return sorted(sums.items())


def _positions(feeds: Mapping[str, object]) -> int | None:
    """The positions of the pass ``feeds`` make (``input_ids``' length), or None without them."""
    ids = feeds.get("input_ids")
    shape = getattr(ids, "shape", None)
    return int(shape[-1]) if shape else None


def _sum_finite(v: np.ndarray) -> bool:
    """Whether ``v``'s sum is finite (then every value is): one pass, no overflow warning."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(v.sum()))
