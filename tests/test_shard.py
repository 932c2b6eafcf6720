"""The splitter on tiny real graphs: structure (where cuts go, how shards chain) and numerics."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from slimml.convert.shard import ShardConfig, shard
from slimml.errors import ConfigError


def run_chain(specs, folder, feeds):
    env = dict(feeds)
    for s in specs:
        sess = ort.InferenceSession(str(folder / s.file), providers=["CPUExecutionProvider"])
        names = [t.name for t in s.outputs]
        env.update(zip(names, sess.run(names, {t.name: env[t.name] for t in s.inputs})))
    return env


@pytest.fixture
def mlp_feeds():
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((3, 8)).astype(np.float32), "scale": rng.random((3, 1)).astype(np.float32)}


def test_per_layer_cuts_one_shard_per_layer(mlp_onnx, tmp_path, mlp_feeds):
    out = tmp_path / "out"
    out.mkdir()
    specs = shard(mlp_onnx, out)
    assert [s.layers for s in specs] == [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    # between layers only the hidden state crosses; the side input comes from the model inputs
    for s in specs[1:]:
        assert {(t.name, t.source) for t in s.inputs} == {("scale", "input"), (f"/layers.{s.index - 1}/out", s.index - 1)}
    want = ort.InferenceSession(str(mlp_onnx)).run(["y"], mlp_feeds)[0]
    got = run_chain(specs, out, mlp_feeds)["y"]
    np.testing.assert_array_equal(got, want)


def test_each_shard_is_a_valid_self_contained_model_with_its_own_weights(mlp_onnx, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    specs = shard(mlp_onnx, out)
    for s in specs:
        model = onnx.load(str(out / s.file), load_external_data=False)
        onnx.checker.check_model(model)
        assert {t.name for t in model.graph.initializer} == {f"layers.{s.index}.w", f"layers.{s.index}.b"}
        assert s.weight_bytes == 8 * 8 * 4 + 8 * 4


@pytest.mark.parametrize("count", [1, 2, 3])
def test_count_mode_balances_weight_bytes(mlp_onnx, tmp_path, mlp_feeds, count):
    out = tmp_path / "out"
    out.mkdir()
    specs = shard(mlp_onnx, out, ShardConfig(mode="count", count=count))
    assert len(specs) == count
    sizes = [s.weight_bytes for s in specs]
    assert max(sizes) - min(sizes) <= 288  # at most one layer apart
    want = ort.InferenceSession(str(mlp_onnx)).run(["y"], mlp_feeds)[0]
    np.testing.assert_array_equal(run_chain(specs, out, mlp_feeds)["y"], want)


def test_size_mode_keeps_shards_under_the_limit(mlp_onnx, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    specs = shard(mlp_onnx, out, ShardConfig(mode="size", max_mb=600 / 1e6))  # two layers fit in 600 bytes
    assert [s.weight_bytes for s in specs] == [576, 576]


def test_a_shard_size_that_cannot_be_met_is_said(mlp_onnx, tmp_path):
    """A layer above --shard-size stays whole, as it must; the convert said nothing of it, and a streamed
    load then advised smaller shards, which cannot cut it."""
    from slimml.convert import ConvertConfig, convert

    report = convert(mlp_onnx, tmp_path / "art", ConvertConfig(shard=ShardConfig(mode="size", max_mb=100 / 1e6),
                                                               measure_latency=False))
    assert re.fullmatch(r"shard 0 \(\d+ B\), shard 2 \(\d+ B\), shard 4 \(\d+ B\), shard 6 \(\d+ B\) above "
                        r"--shard-size 0.0001 MB: each is a piece with no cut point inside \(one weight matrix: the token "
                        r"embedding, the output head, a projection\); a streamed load needs a budget of at least the largest",
                        report.checks["shard_note"]), report.checks
    fits = convert(mlp_onnx, tmp_path / "fits", ConvertConfig(shard=ShardConfig(mode="size", max_mb=1.0),
                                                              measure_latency=False))
    assert "shard_note" not in fits.checks


def test_large_weights_go_to_external_data_files(tmp_path):
    from conftest import tiny_onnx_mlp

    path = tiny_onnx_mlp(tmp_path / "wide.onnx", layers=2, hidden=64)
    out = tmp_path / "out"
    out.mkdir()
    specs = shard(path, out)
    for s in specs:
        assert s.data == f"{s.file}.data"
        assert (out / s.data).stat().st_size >= 64 * 64 * 4
        assert (out / s.file).stat().st_size < 2048  # the graph alone


def test_graph_without_layer_names_falls_back_to_balanced_cuts(mlp_onnx, tmp_path, mlp_feeds):
    model = onnx.load(str(mlp_onnx))
    mapping = {}
    for i, node in enumerate(model.graph.node):  # strip every hint of a layer from the names
        node.name = f"n{i}"
        for k, o in enumerate(node.output):
            if o != "y":
                mapping[o] = node.output[k] = f"t{i}"
        node.input[:] = [mapping.get(x, x) for x in node.input]
    for k, t in enumerate(model.graph.initializer):
        for node in model.graph.node:
            node.input[:] = [f"w{k}" if x == t.name else x for x in node.input]
        t.name = f"w{k}"
    onnx.save(model, str(tmp_path / "anon.onnx"))
    out = tmp_path / "out"
    out.mkdir()
    specs = shard(tmp_path / "anon.onnx", out)
    assert len(specs) == 4 and all(s.layers == [] for s in specs)
    want = ort.InferenceSession(str(mlp_onnx)).run(["y"], mlp_feeds)[0]
    np.testing.assert_array_equal(run_chain(specs, out, mlp_feeds)["y"], want)


@pytest.mark.parametrize(
    ("shards", "size", "message"),
    [
        ("zero", None, "--shards must be 'per-layer' or a whole number, got 'zero'."),
        ("0", None, "--shards must be 'per-layer' or a whole number >= 1, got 0."),
        ("per-layer", -1.0, "--shard-size must be a positive number of MB, got -1.0."),
        ("3", 5.0, "--shards 3 and --shard-size 5 each decide the shards; give one of them."),  # --shards was dropped
    ],
)
def test_bad_shard_options_say_what_to_use(shards, size, message):
    with pytest.raises(ConfigError) as e:
        ShardConfig.parse(shards, size)
    assert str(e.value) == message


def test_shard_makes_its_folder_and_names_a_graph_that_is_not_there(mlp_onnx, tmp_path, mlp_feeds):
    """A missing out_dir was a raw onnx ValidationError; it is made, as export() makes its work_dir."""
    out = tmp_path / "new" / "shards"
    specs = shard(str(mlp_onnx), str(out))
    np.testing.assert_array_equal(run_chain(specs, out, mlp_feeds)["y"],
                                  ort.InferenceSession(str(mlp_onnx)).run(["y"], mlp_feeds)[0])
    with pytest.raises(ConfigError, match=r"^\S+missing\.onnx is not an ONNX file; give the path of the \.onnx graph"):
        shard(tmp_path / "missing.onnx", out)
