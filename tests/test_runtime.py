"""The runtime on a tiny artifact: integrity checks and exact messages for bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.errors import ArtifactError, DeviceError, FeedError, IntegrityError
from slimml.runtime import load


@pytest.fixture
def artifact(mlp_onnx, tmp_path):
    out = tmp_path / "art"
    convert(mlp_onnx, out, ConvertConfig(measure_latency=False))
    return out


@pytest.fixture
def feeds():
    return {"x": np.ones((2, 8), np.float32), "scale": np.ones((2, 1), np.float32)}


def test_run_chains_shards_and_frees_activations(artifact, feeds):
    model = load(artifact)
    assert len(model.manifest.shards) == 4
    out = model.run(feeds)
    assert list(out) == ["y"] and out["y"].shape == (2, 8)


def test_corrupted_shard_is_refused_naming_the_file(artifact):
    data = artifact / "shard_002.onnx"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as e:
        load(artifact)
    assert str(e.value) == (
        "shard_002.onnx does not match its sha256 in the manifest: the file is corrupted or was tampered "
        "with. Copy the artifact again or re-convert; slimml will not run it."
    )


def test_truncated_shard_is_refused(artifact):
    path = artifact / "shard_001.onnx"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(IntegrityError, match=r"^shard_001.onnx is \d+ bytes but the manifest records \d+: the file is truncated"):
        load(artifact)


def test_missing_shard_is_refused(artifact):
    (artifact / "shard_003.onnx").unlink()
    with pytest.raises(IntegrityError, match=r"^shard_003.onnx is missing from the artifact"):
        load(artifact)


def test_unknown_manifest_version_is_refused_with_the_version(artifact):
    path = artifact / "manifest.json"
    raw = json.loads(path.read_text())
    raw["format_version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="has manifest format version 99, but this slimml reads versions 1, 2, 3 and 4"):
        load(artifact)


def test_manifest_path_escaping_the_folder_is_refused(artifact):
    path = artifact / "manifest.json"
    raw = json.loads(path.read_text())
    raw["files"][0]["path"] = "../../etc/passwd"
    path.write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="leaves the artifact folder; refusing to load it"):
        load(artifact)


def test_folder_without_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="has no manifest.json: it is not a slimml artifact"):
        load(tmp_path)


def test_wrong_feed_name(artifact, feeds):
    feeds["X"] = feeds.pop("x")
    with pytest.raises(FeedError) as e:
        load(artifact).run(feeds)
    assert str(e.value) == "bad feeds: unknown input(s) ['X']; missing input(s) ['x']; feed the model's inputs by name, exactly these: ['x', 'scale']."


def test_wrong_dtype_says_how_to_convert(artifact, feeds):
    feeds["x"] = feeds["x"].astype(np.float64)
    with pytest.raises(FeedError) as e:
        load(artifact).run(feeds)
    assert str(e.value) == "bad feeds: input 'x' has dtype float64, expected float32; convert it with .astype(np.float32)."


def test_wrong_rank_and_fixed_dim(artifact, feeds):
    model = load(artifact)
    with pytest.raises(FeedError) as e:
        model.run({"x": np.ones((2, 8, 1), np.float32), "scale": feeds["scale"]})
    assert str(e.value) == "bad feeds: input 'x' has rank 3 (shape [2, 8, 1]), expected rank 2 (shape ['batch', 8])."
    with pytest.raises(FeedError, match=r"input 'x' has size 7 at dim=1, expected 8"):
        model.run({"x": np.ones((2, 7), np.float32), "scale": feeds["scale"]})


def test_inputs_sharing_an_axis_must_agree(artifact):
    with pytest.raises(FeedError, match=r"input 'scale' has batch=3 at dim=0, but 'x' has batch=2"):
        load(artifact).run({"x": np.ones((2, 8), np.float32), "scale": np.ones((3, 1), np.float32)})


def test_cuda_without_provider_is_a_clear_error(artifact):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError, match=r"device='cuda' was asked for, but this onnxruntime has no CUDA provider"):
        load(artifact, device="cuda")


def test_device_auto_runs_where_it_can(artifact):
    import onnxruntime as ort

    model = load(artifact, device="auto")
    want = "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    assert model.device in (want, "cpu")  # a CUDA build on a machine without a working GPU: CPU
    x = {"x": np.ones((2, 8), np.float32), "scale": np.ones((2, 1), np.float32)}
    np.testing.assert_allclose(model.run(x)["y"], load(artifact).run(x)["y"], rtol=1e-3, atol=1e-3)
    with pytest.raises(DeviceError, match=r"unknown device 'gpu'; use one of \['cpu', 'cuda', 'auto'\]"):
        load(artifact, device="gpu")


def test_text_on_an_array_model_says_to_use_run(artifact):
    from slimml.errors import SlimmlError

    model = load(artifact)
    with pytest.raises(SlimmlError, match=r"is a 'generic' model, not a sentence-embedding model; use run\(\)"):
        model.encode(["hello"])
    with pytest.raises(SlimmlError, match="has no tokenizer, so it cannot take text"):
        model.tokenize(["hello"])


def test_copied_artifact_loads_anywhere(artifact, tmp_path, feeds):
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(artifact, moved)
    np.testing.assert_array_equal(load(moved).run(feeds)["y"], load(artifact).run(feeds)["y"])


def test_a_loaded_model_is_not_pickled_or_copied(artifact, feeds):
    """pickle gave "cannot pickle '_thread.lock' object", and copy.copy(model).close() closed the original."""
    import copy
    import pickle

    from slimml.errors import SlimmlError

    model = load(artifact)
    for how in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(SlimmlError, match=r"a loaded model cannot be pickled or copied; pass the artifact's path .* "
                                              r"call slimml.runtime.load\(\) in the worker"):
            how(model)
    model.run(feeds)  # and it still runs
