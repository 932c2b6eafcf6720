"""The CUDA path on a real GPU: resident (one merged graph), streamed through device slots, and the
GPU quantization schemes. Skipped cleanly where onnxruntime has no CUDA provider (CI)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from conftest import mlp_artifact_in
from slimml.errors import IntegrityError
from slimml.runtime import load

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                       reason="needs onnxruntime-gpu and an NVIDIA GPU"),
]

HIDDEN = 512  # biases large enough to be stored outside the graph, so the layers share one session


def _chain(tmp_path_factory, hidden: int):
    return mlp_artifact_in(tmp_path_factory.mktemp(f"cuda_mlp{hidden}"), layers=8, hidden=hidden)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """An 8-block ONNX MLP split per layer."""
    return _chain(tmp_path_factory, HIDDEN)


@pytest.fixture(scope="module")
def small_mlp(tmp_path_factory):
    """The same, 64 wide: its activations stay inside fp16's range."""
    return _chain(tmp_path_factory, 64)


def _feeds(batch: int = 3, seed: int = 0, hidden: int = HIDDEN) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, hidden)).astype(np.float32),
            "scale": rng.uniform(0.5, 1.0, (batch, 1)).astype(np.float32)}


def _close_to_cpu(got: np.ndarray, want: np.ndarray) -> bool:
    """ONNX Runtime's CUDA provider multiplies fp32 matrices in TF32 (its default, kept): about
    1e-3 of the output's scale from the CPU's fp32 (measured on an H100: 6e-4)."""
    return float(np.abs(got - want).max()) <= 2e-3 * float(np.abs(want).max())


def test_resident_runs_as_one_merged_session_and_equals_cpu(mlp):
    gpu = load(mlp, device="cuda")
    assert gpu.plan.sessions == 1 and gpu.plan.segments[0].merged
    for seed in range(3):
        out = gpu.run(_feeds(seed=seed))["y"]
        assert isinstance(out, np.ndarray)
        assert _close_to_cpu(out, load(mlp).run(_feeds(seed=seed))["y"])


@pytest.mark.parametrize("resident,prefetch", [(2, None), (3, 2), (2, 0)])
def test_streamed_through_device_slots_equals_resident(mlp, resident, prefetch):
    from slimml.runtime.engine.cuda_slots import CudaSlots

    want = load(mlp, device="cuda")
    model = load(mlp, device="cuda", resident=resident, prefetch=prefetch)
    assert model.plan.streaming and isinstance(model.plan.segments[0].source, CudaSlots)
    assert "copied to device slots" in model.plan.describe()
    assert model.plan.sessions < len(model.manifest.shards)  # the layers share one compiled session
    for seed in range(4):  # slots refilled pass after pass
        np.testing.assert_allclose(model.run(_feeds(seed=seed))["y"], want.run(_feeds(seed=seed))["y"],
                                   rtol=0, atol=1e-5)
    stats = model.plan.stats
    assert stats.passes == 4 and stats.peak_streamed <= resident and stats.bytes_loaded > 0


@pytest.mark.parametrize("host", ["pinned", "staged", "pageable"])
def test_every_host_side_streams_the_same_outputs(mlp, host, monkeypatch):
    from slimml.runtime.engine.cuda_slots import CudaSlots

    want = load(mlp, device="cuda").run(_feeds())["y"]
    monkeypatch.setattr(CudaSlots, "host", host)  # before load: the loader starts filling at once
    model = load(mlp, device="cuda", resident=2)
    source = model.plan.segments[0].source
    for _ in range(2):
        np.testing.assert_allclose(model.run(_feeds())["y"], want, rtol=0, atol=1e-5)
    assert isinstance(source, CudaSlots) and source.host_mode in (host, "pageable")  # pageable without cuda-python


def test_streamed_cuda_refuses_a_data_file_changed_after_load(mlp, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(mlp, art)
    model = load(art, device="cuda", resident=2)
    model.run(_feeds())
    data = sorted(art.glob("*.onnx.data"))[3]
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        model.run(_feeds())


@pytest.mark.parametrize("scheme,atol", [("fp16", 5e-2), ("int4-weights", 0.15), ("int8-weights", 5e-2)])
def test_gpu_quantization_schemes_run_on_cuda(small_mlp, tmp_path, scheme, atol):
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config

    out = tmp_path / scheme
    quantize(small_mlp, out, scheme_config(scheme, target="cuda"))
    feeds = _feeds(hidden=64)
    want = load(small_mlp).run(feeds)["y"]
    got = load(out, device="cuda").run(feeds)["y"]
    assert np.abs(got - want).max() <= atol * np.abs(want).max()
    assert _close_to_cpu(got, load(out).run(feeds)["y"]) or scheme == "fp16"  # the same artifact on CPU
    streamed = load(out, device="cuda", resident=2).run(feeds)["y"]
    np.testing.assert_allclose(streamed, got, rtol=0, atol=1e-3)


def test_device_auto_picks_the_gpu(mlp):
    assert load(mlp, device="auto").device == "cuda"


@pytest.mark.parametrize("resident", [None, 2])
def test_run_trusted_keeps_a_fed_back_output_on_the_gpu(mlp, resident):
    """A decode loop's cache: ``keep_on_device`` hands the output back as an OrtValue in GPU
    memory, and the next call binds it where it sits."""
    model = load(mlp, device="cuda", resident=resident)
    feeds = _feeds()
    want = model.run(feeds)["y"]
    kept = model.run_trusted(dict(feeds), keep_on_device=["y"])["y"]
    assert isinstance(kept, ort.OrtValue) and kept.device_name().lower() == "cuda"
    np.testing.assert_allclose(model.to_host(kept), want, rtol=0, atol=1e-5)
    again = model.run_trusted({"x": kept, "scale": feeds["scale"]}, keep_on_device=["y"])["y"]
    twice = model.run({"x": want, "scale": feeds["scale"]})["y"]
    assert float(np.abs(model.to_host(again) - twice).max()) <= 1e-4 * float(np.abs(twice).max())
    assert isinstance(model.run_trusted(dict(feeds))["y"], np.ndarray)  # nothing kept: host arrays
