"""Hostile and malformed input, tried by hypothesis: every case ends in a slimml error or a result.

Random and mutated manifests, truncated and bit-flipped shard files, wrong feeds (names, dtypes,
ranks, empty batches, over-long sequences, NaN/inf) and odd texts go into ``load``/``run``/
``encode`` of tiny real models. A case passes when it returns normally or raises a
``SlimmlError`` with a message; any other exception fails it, a crash kills the run, and a
watchdog turns a hang into a failure with a traceback. Runs are derandomized (the same cases on
every machine) and counted; the count is printed at the end of the module.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import re
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slimml.errors import FeedError, SlimmlError
from slimml.runtime import load
from slimml.runtime.artifact.files import sha256_file
from slimml.runtime.artifact.manifest import MANIFEST_NAME
from slimml.runtime.tools.bench import sample_feeds
from conftest import tiny_onnx_mlp

TRIED: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()
MESSAGES: Counter[tuple[str, str]] = Counter()  # (kind, message with numbers blanked): review with SLIMML_FUZZ_MESSAGES=1
HANG_S = 60  # one case taking this long is a hang: dump the stacks and fail the run


def fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@contextmanager
def watchdog():
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def attempt(kind: str, fn) -> str:
    """Run one hostile case; only a normal return or a SlimmlError with a message may come out."""
    TRIED[kind] += 1
    with watchdog():
        try:
            fn()
        except SlimmlError as e:
            msg = str(e)
            assert len(msg) >= 20 and "Traceback" not in msg, f"unhelpful message: {msg!r}"
            OUTCOMES["slimml error"] += 1
            MESSAGES[(kind, re.sub(r"\d+", "N", msg)[:160])] += 1
            return "error"
    OUTCOMES["ran"] += 1
    return "ok"


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    total = sum(TRIED.values())
    line = (f"hostile inputs tried: {total} ({', '.join(f'{k} {v}' for k, v in sorted(TRIED.items()))}); "
            f"outcomes: {dict(OUTCOMES)}; crashes 0, hangs 0")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown even when pytest captures output
        print(f"\n{line}")
        if os.environ.get("SLIMML_FUZZ_MESSAGES"):
            for (kind, msg), n in MESSAGES.most_common(int(os.environ["SLIMML_FUZZ_MESSAGES"])):
                print(f"{n:5d}  {kind}: {msg}")


@pytest.fixture(scope="module")
def mlp_art(tmp_path_factory) -> Path:
    from slimml.convert import ConvertConfig, convert

    folder = tmp_path_factory.mktemp("hostile")
    out = folder / "mlp"
    convert(tiny_onnx_mlp(folder / "mlp.onnx", layers=3, hidden=64), out, ConvertConfig(measure_latency=False))
    return out


def load_and_run(folder: Path, verify: bool = True) -> None:
    model = load(folder, verify=verify)
    out = model.run(sample_feeds(model.inputs, batch=2, seq=8))
    assert set(out) == {t.name for t in model.outputs}


# ---------------------------------------------------------------- manifests

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["../escape", "/etc/passwd", "shard_000.onnx", "shard_000.onnx.data", "", "a\x00b",
                     "float32", "input", "~/x", "..\\x", "manifest.json", "0" * 64, "tokenizer.json"]),
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@fuzz(300)
@given(body=json_values, header=st.booleans())
def test_random_manifests(mlp_art, tmp_path_factory, body, header):
    folder = _scratch(tmp_path_factory, "random", mlp_art, manifest_only=True)
    if header and isinstance(body, dict):
        body = {**body, "format": "slimml.artifact", "format_version": 1}
    (folder / MANIFEST_NAME).write_text(json.dumps(body))
    assert attempt("random manifest", lambda: load_and_run(folder)) == "error"


def _paths(node, prefix=()):
    """Every (path, value) inside a JSON tree."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutations(draw, manifest: dict):
    m = copy.deepcopy(manifest)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(m) if p]
        path = draw(st.sampled_from(paths))
        parent = m
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "delete", "duplicate", "retype"]))
        if op == "delete":
            del parent[path[-1]]
        elif op == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        elif op == "retype":
            v = parent[path[-1]]
            parent[path[-1]] = [v] if not isinstance(v, list) else (v[0] if v else {})
        else:
            parent[path[-1]] = draw(json_values)
    return m


def _scratch(tmp_path_factory, name: str, source: Path, manifest_only: bool = False) -> Path:
    """A reusable copy of ``source``; with manifest_only the shard files are shared, not copied."""
    base = tmp_path_factory.getbasetemp() / f"scratch-{name}"
    if not base.exists():
        shutil.copytree(source, base)
    elif not manifest_only:
        shutil.rmtree(base)
        shutil.copytree(source, base)
    return base


@fuzz(800)
@given(data=st.data())
def test_mutated_manifests(mlp_art, tmp_path_factory, data):
    manifest = json.loads((mlp_art / MANIFEST_NAME).read_text())
    mutated = data.draw(mutations(manifest))
    folder = _scratch(tmp_path_factory, "mutated", mlp_art, manifest_only=True)
    (folder / MANIFEST_NAME).write_text(json.dumps(mutated))
    attempt("mutated manifest", lambda: load_and_run(folder))


def test_mutated_tokenizer_manifest(tiny_bert_artifact, tmp_path):
    """The tokenizer entry of a real text model, mutated by hand in the ways hypothesis might miss."""
    folder = tmp_path / "bert"
    shutil.copytree(tiny_bert_artifact, folder)
    good = json.loads((folder / MANIFEST_NAME).read_text())
    for key, value in [("max_length", 2**61), ("pad_id", 2**40), ("pad_token", "\x00"), ("file", "../tokenizer.json"),
                       ("max_length", 0), ("pad_id", -1), ("file", "shard_000.onnx")]:
        m = copy.deepcopy(good)
        m["tokenizer"][key] = value
        (folder / MANIFEST_NAME).write_text(json.dumps(m))
        attempt("mutated manifest", lambda: load(folder).encode(["hello there"]))


# ---------------------------------------------------------------- damaged shard files

@fuzz(400)
@given(
    which=st.integers(0, 5), cut=st.floats(0, 1, exclude_max=True),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=4),
    rehash=st.booleans(),
)
def test_damaged_shard_files(mlp_art, tmp_path_factory, capfd, which, cut, flips, rehash):
    """Truncated or bit-flipped .onnx/.data files, with the manifest re-hashed half the time so the
    damage reaches the ONNX parser and ONNX Runtime instead of stopping at the hash check."""
    folder = _scratch(tmp_path_factory, "damaged", mlp_art)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    entry = manifest["files"][which % len(manifest["files"])]
    path = folder / entry["path"]
    blob = bytearray(path.read_bytes())
    if flips:
        for where, value in flips:
            blob[int(where * len(blob))] = value
    else:
        blob = blob[: int(cut * len(blob))]
    path.write_bytes(bytes(blob))
    if rehash:
        entry["bytes"], entry["sha256"] = len(blob), sha256_file(path)
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    outcome = attempt("damaged shard file", lambda: load_and_run(folder))
    out, err = capfd.readouterr()
    assert out + err == "", f"a dependency wrote to the terminal: {(out + err)[:300]!r}"
    if not rehash and bytes(blob) != (mlp_art / entry["path"]).read_bytes():
        assert outcome == "error"  # the hash check alone must catch it


# ---------------------------------------------------------------- feeds

DTYPES = ["float32", "float64", "float16", "int64", "int32", "uint8", "bool", "complex64", "U3", "object"]
specials = st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1e38, -1e38, 1e-45])


@st.composite
def arrays(draw, max_rank: int = 4, max_dim: int = 6, big_dim: int = 0):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    rank = draw(st.integers(0, max_rank))
    dims = st.integers(0, max_dim) if not big_dim else st.one_of(st.integers(0, max_dim), st.just(big_dim))
    shape = tuple(draw(dims) for _ in range(rank))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if dtype.kind in "fc":
        a = rng.standard_normal(shape).astype(dtype)
        if a.size and draw(st.booleans()):
            with np.errstate(over="ignore"):  # 1e38 does not fit float16: it becomes inf, also hostile
                a.flat[draw(st.integers(0, a.size - 1))] = draw(specials)
    elif dtype.kind in "iu":
        a = rng.integers(0, 100, size=shape).astype(dtype)
    elif dtype.kind == "b":
        a = rng.random(shape) > 0.5
    else:
        a = np.full(shape, "x", dtype=dtype)
    if a.ndim >= 2 and draw(st.booleans()):
        a = a.T  # non-contiguous
    return a


not_arrays = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.floats(), max_size=4))


@fuzz(800)
@given(
    names=st.lists(st.sampled_from(["x", "scale", "y", "bogus", "", "X"]), max_size=4, unique=True),
    values=st.lists(st.one_of(arrays(), arrays(max_rank=2, big_dim=70), not_arrays), min_size=4, max_size=4),
    good=st.integers(0, 2),
)
def test_wrong_feeds(mlp_art, capfd, names, values, good):
    model = _model(mlp_art)
    feeds = dict(zip(names, values))
    # start from valid feeds and break one thing, so the deeper checks are reached too
    if good == 1:
        feeds = sample_feeds(model.inputs, batch=3) | {k: v for k, v in feeds.items() if k in ("x", "scale")}
    elif good == 2:
        feeds = sample_feeds(model.inputs, batch=3) | dict(list(feeds.items())[:1])
    attempt("wrong feeds", lambda: model.run(feeds))
    out, err = capfd.readouterr()
    assert out + err == "", f"a dependency wrote to the terminal: {(out + err)[:300]!r}"


@fuzz(600)
@given(
    batch=st.integers(0, 3), seq=st.integers(0, 160),
    ids=st.sampled_from(["ok", "negative", "huge", "vocab_edge", "int32", "float"]),
    mask=st.sampled_from(["ones", "zeros", "random", "short", "missing"]),
)
def test_wrong_token_feeds(tiny_bert_artifact, batch, seq, ids, mask):
    model = _model(tiny_bert_artifact)
    rng = np.random.default_rng(batch * 1000 + seq)
    feeds = {
        "input_ids": rng.integers(0, 30522, size=(batch, seq)),
        "attention_mask": np.ones((batch, seq), np.int64),
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }
    feeds["input_ids"] = {
        "ok": feeds["input_ids"], "negative": -feeds["input_ids"] - 1, "huge": feeds["input_ids"] + 2**62,
        "vocab_edge": np.full((batch, seq), 30522), "int32": feeds["input_ids"].astype(np.int32),
        "float": feeds["input_ids"].astype(np.float32),
    }[ids]
    if mask == "zeros":
        feeds["attention_mask"][:] = 0
    elif mask == "random":
        feeds["attention_mask"] = rng.integers(-5, 5, size=(batch, seq))
    elif mask == "short":
        feeds["attention_mask"] = feeds["attention_mask"][:, : max(seq - 1, 0)]
    elif mask == "missing":
        del feeds["attention_mask"]
    feeds = {k: v for k, v in feeds.items() if k in {t.name for t in model.inputs}}
    outcome = attempt("wrong token feeds", lambda: model.run(feeds))
    if seq > model.max_sequence_length or (ids in ("negative", "huge", "vocab_edge") and batch * seq):
        assert outcome == "error"


def test_too_long_sequence_names_the_maximum(tiny_bert_artifact):
    model = _model(tiny_bert_artifact)
    assert model.max_sequence_length == 128  # the tiny BERT's position table, not the tokenizer's 256/512
    feeds = sample_feeds(model.inputs, batch=1, seq=129)
    with pytest.raises(FeedError) as e:
        model.run(feeds)
    assert str(e.value) == (
        "bad feeds: input 'input_ids' has sequence_length=129 at dim=1, but this model takes at most 128 tokens; "
        "truncate to 128 (model.tokenize and encode do so)."
    )
    model.run(sample_feeds(model.inputs, batch=1, seq=128))  # the maximum itself is fine


def test_token_ids_outside_the_vocabulary(tiny_bert_artifact):
    model = _model(tiny_bert_artifact)
    assert model.vocab_size == 30522
    feeds = sample_feeds(model.inputs, batch=2, seq=4)
    feeds["input_ids"][1, 2] = -3  # ONNX Gather would wrap this around silently
    with pytest.raises(FeedError) as e:
        model.run(feeds)
    assert str(e.value) == (
        "bad feeds: input 'input_ids' holds 1 id(s) outside the vocabulary [0, 30522), the first -3 at index (1, 2); "
        "encode text with this model's tokenizer (model.tokenize)."
    )



@pytest.mark.parametrize("segment", [-1, 2])
def test_token_types_outside_the_segment_table(tiny_bert_artifact, segment):
    """BERT has 2 token types; ONNX Gather reads -1 as the last row, so it ran as segment 1."""
    model = _model(tiny_bert_artifact)
    feeds = sample_feeds(model.inputs, batch=2, seq=4)
    feeds["token_type_ids"][0, 1] = segment
    with pytest.raises(FeedError) as e:
        model.run(feeds)
    assert str(e.value) == (
        f"bad feeds: input 'token_type_ids' holds 1 id(s) outside the model's token types [0, 2), the first {segment} "
        "at index (0, 1); encode text with this model's tokenizer (model.tokenize)."
    )

def test_nan_policy(mlp_art):
    model = load(mlp_art)
    feeds = sample_feeds(model.inputs, batch=2)
    feeds["x"][1, 5] = np.inf
    with pytest.raises(FeedError, match=r"input 'x' holds 1 NaN/inf value\(s\), the first at index \(1, 5\)"):
        model.run(feeds)
    model.allow_nonfinite = True  # the documented way out, for models that handle them
    assert not np.isfinite(model.run(feeds)["y"]).all()


texts = st.lists(st.text(alphabet=st.characters(codec="utf-8"), max_size=300) | st.sampled_from(
    ["", " ", "\x00", "a" * 5000, "[CLS] [SEP] [PAD]", "lone \ud800 surrogate"]),
    max_size=5)


@fuzz(300)
@given(batch=st.one_of(texts, st.none(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                       st.lists(st.none(), min_size=1, max_size=2)))
def test_hostile_texts(tiny_bert_artifact, batch):
    model = _model(tiny_bert_artifact)

    def encode():
        emb = model.encode(batch)
        assert emb.shape == ((32,) if isinstance(batch, str) else (len(batch), 32)) and np.isfinite(emb).all()

    attempt("hostile texts", encode)


def test_a_text_that_is_not_one_is_named_with_the_fix(tiny_bert_artifact):
    """A missing value in a column of texts (NaN, None) is named by its index; tokenize(5) was a TypeError."""
    from slimml.errors import FeedError

    model = _model(tiny_bert_artifact)
    for call, said in (
            (lambda: model.encode(["a", float("nan")]), "item 1 is NaN (float)"),
            (lambda: model.tokenize(["a", "b", None]), "item 2 is null (NoneType)"),
            (lambda: model.tokenize([("a", 3)]), "item 0 is [\"a\", 3] (tuple)")):
        with pytest.raises(FeedError) as e:
            call()
        assert str(e.value) == (f"texts must be strings (or [text, text] pairs), and {said}; drop or fill missing "
                                "values, or make each item a text with str().")
    with pytest.raises(FeedError, match=r"^texts must be a list of strings \(or of \[text, text\] pairs\), got int; wrap a "
                                        r"single text as \[text\]\.$"):
        model.tokenize(5)
    assert model.tokenize(iter(["a", "b"]))["input_ids"].shape[0] == 2
    with pytest.raises(FeedError, match=r"^texts must be a list of strings .*, got str; wrap a single text as \[text\]\.$"):
        model.count_tokens("Hello")  # one count a character before
    with pytest.raises(FeedError, match=r"^the list of texts is empty; give at least one text\.$"):
        model.count_tokens([])


_MODELS: dict[Path, object] = {}


def _model(folder: Path):
    if folder not in _MODELS:
        _MODELS[folder] = load(folder)
    return _MODELS[folder]


ids = st.integers(min_value=-2, max_value=600) | st.sampled_from([2**63 - 1, 2**63, 2**70, -(2**70)])
prompts = st.one_of(
    st.lists(st.lists(ids, min_size=0, max_size=140), min_size=0, max_size=4),  # past the positions, odd ids
    st.builds(lambda rows, n: [[1] * n] * rows, st.integers(1, 300), st.integers(1, 60)),  # past the token budget
    st.lists(st.text(max_size=50) | st.just("lone \ud800"), min_size=1, max_size=3),  # text, but no tokenizer
    st.none(), st.text(max_size=5),
)


@fuzz(200)
@given(batch=prompts, new=st.integers(min_value=-1, max_value=140))
def test_hostile_prompts(tiny_llama_past_artifact, batch, new):
    """generate() on token ids a caller may send: everything past the model's positions, the
    call's token budget or the vocabulary is refused before any pass (docs/trust.md)."""
    model = _model(tiny_llama_past_artifact)

    def generate():
        gen = model.generate(batch, max_new_tokens=new)
        assert len(gen.tokens) == len(batch) and all(1 <= len(t) <= new for t in gen.tokens)

    attempt("hostile prompts", generate)
