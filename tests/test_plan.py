"""The execution plan: merged resident segments, streamed segments, the fallback, encode's batching."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.errors import ArtifactError, ConfigError, FeedError, IntegrityError
from slimml.runtime import load
from slimml.runtime.artifact.files import file_entry
from slimml.runtime.artifact.manifest import read_manifest
from conftest import STS_DEV, tiny_onnx_mlp


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """A 6-block ONNX MLP split per layer, and its unsharded source."""
    tmp = tmp_path_factory.mktemp("plan_mlp")
    src = tiny_onnx_mlp(tmp / "mlp.onnx", layers=6, hidden=32)
    convert(src, tmp / "art", ConvertConfig(measure_latency=False))
    return src, tmp / "art"


def _feeds(batch=3, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 32)).astype(np.float32), "scale": rng.random((batch, 1)).astype(np.float32)}


def test_a_model_that_fits_runs_as_one_session(mlp):
    src, art = mlp
    model = load(art)
    assert len(model.manifest.shards) > 2
    assert [s.kind for s in model.plan.segments] == ["resident"] and model.plan.sessions == 1
    assert model.plan.segments[0].merged
    assert "merged into one session" in model.plan.describe()
    whole = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    for seed in range(3):
        f = _feeds(seed=seed)
        np.testing.assert_allclose(model.run(f)["y"], whole.run(["y"], f)[0], rtol=0, atol=1e-5)


def test_pinned_shards_merge_and_the_rest_stream(mlp):
    _, art = mlp
    n = len(read_manifest(art).shards)
    model = load(art, resident=4, pin=[0, 1, -1])
    kinds = [(s.kind, s.shards) for s in model.plan.segments]
    assert kinds == [("resident", [0, 1]), ("streamed", list(range(2, n - 1))), ("resident", [n - 1])]
    assert model.plan.segments[0].merged
    want = load(art).run(_feeds())["y"]
    for _ in range(2):
        np.testing.assert_allclose(model.run(_feeds())["y"], want, rtol=0, atol=1e-5)
    text = model.plan.describe()
    assert "shards 2-" in text and "streamed through the slots, sessions compiled once" in text


def test_streaming_builds_no_session_per_pass(mlp, monkeypatch):
    _, art = mlp
    model = load(art, resident=2)
    model.run(_feeds())
    built = []
    real = ort.InferenceSession.__init__
    monkeypatch.setattr(ort.InferenceSession, "__init__", lambda self, *a, **k: (built.append(a), real(self, *a, **k))[1])
    for seed in range(3):
        model.run(_feeds(seed=seed))
    assert built == [] and model.stats.passes == 4


def _collide(art):
    """Give shard 2 a bias initializer with shard 1's bias name (other values): the shards run alone
    as before; one graph keeps both under different names."""
    m = read_manifest(art)
    one = onnx.load(str(art / m.shards[1].file), load_external_data=False)
    taken = next(t.name for t in one.graph.initializer if t.name.endswith(".b"))
    path = art / m.shards[2].file
    two = onnx.load(str(path), load_external_data=False)
    mine = next(t for t in two.graph.initializer if t.name.endswith(".b"))
    for node in two.graph.node:
        node.input[:] = [taken if i == mine.name else i for i in node.input]
    mine.name = taken
    onnx.save(two, str(path))
    m.files = [file_entry(art, art / f.path) if f.path == m.shards[2].file else f for f in m.files]
    m.write(art)


def _other_opset(art):
    """Shards 1 and 2 declare two versions of one domain besides ONNX's (which the merge moves up
    to the newest): each runs alone, but they cannot share one graph."""
    m = read_manifest(art)
    for index, version in ((1, 1), (2, 2)):
        path = art / m.shards[index].file
        shard = onnx.load(str(path), load_external_data=False)
        shard.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", version))
        onnx.save(shard, str(path))
        m.files = [file_entry(art, art / f.path) if f.path == m.shards[index].file else f for f in m.files]
    m.write(art)


def test_a_weight_two_shards_name_alike_is_renamed_in_the_merged_graph(mlp, tmp_path):
    _, art = mlp
    want = load(art).run(_feeds())["y"]
    odd = tmp_path / "art"
    shutil.copytree(art, odd)
    _collide(odd)  # shard 2 now reads its own bias under shard 1's bias name
    model = load(odd)
    assert model.plan.segments[0].merged
    np.testing.assert_allclose(model.run(_feeds())["y"], want, rtol=0, atol=1e-5)


def test_a_merge_onnxruntime_refuses_falls_back_with_one_warning(mlp, tmp_path, caplog):
    _, art = mlp
    want = load(art).run(_feeds())["y"]
    bad = tmp_path / "art"
    shutil.copytree(art, bad)
    _other_opset(bad)
    with caplog.at_level(logging.WARNING, logger="slimml"):
        model = load(bad)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "one session each" in warnings[0] and "\n" not in warnings[0]
    assert "uses opset" in warnings[0]
    assert not model.plan.segments[0].merged and model.plan.sessions == len(model.manifest.shards)
    np.testing.assert_allclose(model.run(_feeds())["y"], want, rtol=0, atol=1e-5)


def test_a_file_changed_after_load_is_refused_by_the_merged_plan(mlp, tmp_path):
    _, art = mlp
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    model = load(copy)
    model.run(_feeds())
    data = copy / model.manifest.shards[3].data
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="after the model was loaded"):
        model.run(_feeds())


def test_budget_too_small_for_k_names_the_shards(mlp):
    _, art = mlp
    sizes = load(art, resident=2).plan.sizes
    budget = sorted(sizes)[-1] + sorted(sizes)[-2] - 1
    with pytest.raises(ConfigError) as e:
        load(art, resident=2, memory_budget=budget)
    msg = str(e.value)
    assert msg.startswith("resident=2 can need ") and "the largest being shard " in msg and "Use resident=1" in msg


def test_zero_length_axes_pass_but_an_empty_batch_does_not(tiny_llama_past_artifact):
    model = load(tiny_llama_past_artifact)
    past = {t.name: np.zeros((2, t.shape[1], 0, t.shape[3]), np.float32) for t in model.inputs if t.name.startswith("past")}
    ids = np.array([[5, 6, 7], [8, 9, 10]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(3), (2, 1)), **past}
    out = model.run(feeds)  # the feed Hugging Face and Optimum give a first step
    assert out["logits"].shape[:2] == (2, 3)
    empty = {k: v[:0] for k, v in feeds.items()}
    with pytest.raises(FeedError, match=r"has an empty batch \(shape \[0, 3\]\); give at least one item"):
        model.run(empty)


def test_encode_sorts_by_length_and_returns_input_order(tiny_bert_artifact):
    from slimml.runtime.tools.evaluate import read_sts

    model = load(tiny_bert_artifact)
    texts = list(read_sts(STS_DEV)[0][:40])
    one_by_one = np.concatenate([model.encode([t]) for t in texts])  # no padding at all
    batched = model.encode(texts, batch_size=7)
    np.testing.assert_allclose(batched, one_by_one, rtol=0, atol=1e-5)
    assert model.encode(texts[::-1], batch_size=32)[::-1] == pytest.approx(batched, abs=1e-5)
    with pytest.raises(FeedError, match="batch_size must be a whole number >= 1, got 0"):
        model.encode(texts, batch_size=0)
    emb, counts = model.encode_with_counts(texts, batch_size=7)  # one tokenization for both (a server's usage)
    np.testing.assert_array_equal(emb, batched)
    assert counts == model.count_tokens(texts) and all(c >= 3 for c in counts)


def test_encode_runs_batches_in_lanes_with_the_same_embeddings(tiny_bert_artifact, tmp_path):
    from slimml.runtime.tools.evaluate import read_sts

    model = load(tiny_bert_artifact, threads=2)
    texts = list(read_sts(STS_DEV)[0][:64])
    alone = model.encode(texts, batch_size=8, workers=1)
    assert not model._lanes  # one lane: the plan itself
    lanes = model.encode(texts, batch_size=8)  # two cores of threads=2: two single-threaded lanes
    assert list(model._lanes) == [1]
    np.testing.assert_allclose(lanes, alone, rtol=0, atol=1e-5)
    model.encode(texts, batch_size=8, workers=2, show_progress=True)
    assert list(model._lanes) == [1]  # made once
    with pytest.raises(ConfigError, match="workers must be a whole number >= 1, got 0"):
        model.encode(texts, workers=0)
    streamed = load(tiny_bert_artifact, resident=2)
    with pytest.raises(ConfigError, match=r"workers=2 runs batches side by side .* this one streams\. Use workers=1"):
        streamed.encode(texts, workers=2)
    assert streamed.encode(texts[:9], batch_size=4).shape == (9, alone.shape[1])  # unset: one lane
    size = model.plan.model_bytes
    tight = load(tiny_bert_artifact, threads=2, memory_budget=int(size * 1.5))  # resident, no room for a copy
    assert not tight.plan.streaming
    tight.encode(texts, batch_size=8)
    assert not tight._lanes
    roomy = load(tiny_bert_artifact, threads=2, memory_budget=size * 2)
    roomy.encode(texts, batch_size=8)
    assert list(roomy._lanes) == [1]
    # a lane's copy of the plan is checked as the plan is: a weight file changed after load is refused
    copy = tmp_path / "art"
    shutil.copytree(tiny_bert_artifact, copy)
    model = load(copy, threads=2)
    model.encode(texts, batch_size=8, workers=2)
    data = next(p for p in sorted(copy.glob("*.data")))
    data.write_bytes(data.read_bytes()[:-4])
    with pytest.raises(IntegrityError):
        model.encode(texts, batch_size=8, workers=2)


def test_encode_progress_bar(tiny_bert_artifact, capsys):
    model = load(tiny_bert_artifact)
    out = model.encode(["a b c"] * 10, batch_size=2, show_progress=True)
    assert out.shape[0] == 10


def test_a_stale_temp_folder_is_removed_and_said(mlp_onnx, tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f".art.slimml-tmp-{pid}"
    stale.mkdir()
    (stale / "shard_000.onnx.data").write_bytes(b"\0" * 2_000_000)
    reused = tmp_path / f".art.slimml-tmp-{os.getppid()}"  # a live process, started after the folder was made
    reused.mkdir()
    os.utime(reused, (1_000_000, 1_000_000))
    with caplog.at_level(logging.WARNING, logger="slimml"):
        convert(mlp_onnx, tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not stale.exists() and not reused.exists()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"removed {stale} (2.0 MB), left by an interrupted convert" in m for m in said)


def test_an_unwritable_cache_falls_back_to_fed_weights_with_one_line(mlp, tmp_path, caplog):
    _, art = mlp
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="slimml"):  # a folder under a file cannot be made (cache_dir=blocker
        model = load(art, resident=2, cache_dir=blocker / "cache")  # itself is refused by LoadConfig, in one line)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("slimml: streaming weights as graph inputs (slower decoding): packing them failed")
    assert "set SLIMML_CACHE_DIR (--cache-dir, load(cache_dir=...)) to a writable folder" in said[0]
    assert said[0].endswith("or load with pack=False (--no-pack))")
    assert "weights fed from memory-mapped data files" in model.plan.describe()
    np.testing.assert_allclose(model.run(_feeds())["y"], load(art).run(_feeds())["y"], rtol=0, atol=1e-5)
    with pytest.raises(ArtifactError, match=r"^packing shard \d+ into .* failed"):
        load(art, resident=2, pack=True, cache_dir=blocker / "cache")  # asked for: no fallback


def test_the_cache_follows_xdg_and_a_user_without_a_home_streams_fed_weights(mlp, tmp_path, caplog, monkeypatch):
    """A container run as a user without a home folder: no cache, so fed weights and one line
    (a missing home is not made); XDG_CACHE_HOME, where set, holds the cache."""
    _, art = mlp
    monkeypatch.delenv("SLIMML_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    load(art, resident=2).close()
    assert list((tmp_path / "xdg" / "slimml" / "packed").iterdir())
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec ignores a relative one
    for home in ("", str(tmp_path / "no-such-home"), str(tmp_path / "a-file")):
        monkeypatch.setenv("HOME", home)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slimml"):
            model = load(art, resident=2)
        said = [r.getMessage() for r in caplog.records]
        assert said == ["slimml: streaming weights as graph inputs (slower decoding): no cache folder (no home folder "
                        "this user can write, and neither SLIMML_CACHE_DIR nor an absolute XDG_CACHE_HOME is set); set "
                        "SLIMML_CACHE_DIR (--cache-dir, load(cache_dir=...)) to a writable folder with room for about "
                        "twice the streamed shards"]
        assert "weights fed from memory-mapped data files" in model.plan.describe()
        np.testing.assert_allclose(model.run(_feeds())["y"], load(art).run(_feeds())["y"], rtol=0, atol=1e-5)
        with pytest.raises(ConfigError, match=r"^pack=True cannot be honoured: no cache folder .*streamed shards\.$"):
            load(art, resident=2, pack=True)
    assert not (tmp_path / "no-such-home").exists()


def test_a_short_list_is_cut_so_every_lane_has_work(tiny_bert_artifact):
    from slimml.runtime.tools.evaluate import read_sts
    from slimml.runtime.tasks.lanes import lane_batch_size, possible_batches

    assert [lane_batch_size(n, 32, 2) for n in (8, 16, 32, 64, 65, 1000)] == [8, 8, 8, 16, 17, 32]
    assert lane_batch_size(32, 4, 2) == 4 and lane_batch_size(32, 32, 1) == 32  # never above batch_size
    assert [possible_batches(n, 32) for n in (5, 8, 16, 17)] == [1, 1, 2, 3]
    model = load(tiny_bert_artifact, threads=2)
    texts = list(read_sts(STS_DEV)[0][:16])
    one = model.encode(texts, workers=1)  # one batch of 16 on both threads
    assert not model._lanes
    np.testing.assert_allclose(model.encode(texts), one, rtol=0, atol=1e-5)  # two lanes, a batch of 8 each
    assert list(model._lanes) == [1]
    small = load(tiny_bert_artifact, threads=2)
    small.encode(texts[:8])  # 8 texts: one batch, no lanes
    assert not small._lanes


def test_a_failing_batch_stops_the_lanes():
    import threading
    import time

    from slimml.runtime.tasks.lanes import in_lanes

    ran, lock = [], threading.Lock()

    def work(i):
        with lock:
            ran.append(i)
        if i == 0:
            raise FeedError("batch 0 is bad")
        time.sleep(0.01)
        return i

    with pytest.raises(FeedError, match="batch 0 is bad"):
        list(in_lanes(work, range(200), 2))
    assert len(ran) < 20  # the batches not started when it failed were dropped
    assert list(in_lanes(lambda i: i * i, range(7), 3)) == [i * i for i in range(7)]
