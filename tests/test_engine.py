"""The engine layer's contracts: LoadConfig checks itself, load(path, config, **overrides), the
backend chosen once per device, segments and weight sources keep their declared protocols, and
the trusted path hands back device values for outputs a task feeds back."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnxruntime as ort
import pytest

from conftest import mlp_artifact_in
from slimml.errors import ConfigError, DeviceError, SlimmlError
from slimml.runtime import LoadConfig, load
from slimml.runtime.artifact.manifest import read_manifest
from slimml.runtime.engine.backends import CpuBackend, CudaBackend, backend_for
from slimml.runtime.engine.budget import plan_stream
from slimml.runtime.engine.contracts import Segment, WeightSource
from slimml.runtime.engine.cuda_slots import CudaSlots, DeviceWeight
from slimml.runtime.engine.engine import Engine
from slimml.runtime.engine.packed import PackedSlots
from slimml.runtime.engine.plan import ExecutionPlan, ResidentSegment, StreamedSegment, build_plan
from slimml.runtime.engine.slots import FedSlots

HIDDEN = 16


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """A 4-block ONNX MLP split per layer."""
    return mlp_artifact_in(tmp_path_factory.mktemp("engine_mlp"), layers=4, hidden=HIDDEN)


def _feeds(batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, HIDDEN)).astype(np.float32),
            "scale": rng.uniform(0.5, 1.0, (batch, 1)).astype(np.float32)}


# -- LoadConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,message", [
    ({"device": "gpu"}, DeviceError, "unknown device 'gpu'; use one of ['cpu', 'cuda', 'auto']."),
    ({"threads": 0}, ConfigError, f"threads=0 must be a whole number from 1 to 1024 (ONNX Runtime's intra-op threads; "
                                  f"this machine has {os.cpu_count()} cores); leave it out for ONNX Runtime's choice."),
    ({"threads": 10**5}, ConfigError, f"threads=100000 must be a whole number from 1 to 1024 (ONNX Runtime's intra-op "
                                      f"threads; this machine has {os.cpu_count()} cores); leave it out for ONNX Runtime's "
                                      "choice."),  # not 100,000 threads started
    ({"verify": "no"}, ConfigError, "verify='no' must be True or False."),
    ({"resident": 0}, ConfigError, "resident=0 must be a whole number >= 1 (shards loaded at once)."),
    ({"resident": 2.5}, ConfigError, "resident=2.5 must be a whole number >= 1 (shards loaded at once)."),
    ({"prefetch": -1}, ConfigError, "prefetch=-1 must be a whole number >= 0 (shards loaded ahead)."),
    ({"memory_budget": "lots"}, ConfigError, "memory budget 'lots' is not a size; write it like '4GB', '512MB', "
                                             "'1.5GiB' or a number of bytes."),
    ({"memory_budget": 0}, ConfigError, "memory budget 0 must be positive; write a size like '4GB' or '512MB'."),
    ({"pin": [0, "last"]}, ConfigError, "pin=[0, 'last'] must be a list of shard indices, e.g. pin=[0, -1]."),
    ({"pin": 0}, ConfigError, "pin=0 must be a list of shard indices, e.g. pin=[0, -1]."),
    ({"pack": "yes"}, ConfigError, "pack='yes' must be None (pack where it can), True or False."),
    ({"cache_dir": 3}, ConfigError, "cache_dir=3 must be a folder path."),
    ({"shards": (3, 1)}, ConfigError, "shards=(3, 1) must be (first, last), two shard indices with 0 <= first <= "
                                      "last, e.g. shards=(0, 3)."),
    ({"shards": 2}, ConfigError, "shards=2 must be (first, last), two shard indices with 0 <= first <= last, e.g. "
                                 "shards=(0, 3)."),
])
def test_load_config_refuses_bad_values_in_one_line(kwargs, error, message):
    with pytest.raises(error) as e:
        LoadConfig(**kwargs)
    assert str(e.value) == message


def test_load_takes_a_folder_and_a_model_closes_at_the_end_of_a_with_block(mlp):
    with pytest.raises(ConfigError) as e:
        load(None)
    assert str(e.value) == ("load() takes the artifact's folder (a str or a path), got NoneType; e.g. "
                            'load("artifacts/all-MiniLM-L6-v2").')
    with pytest.raises(ConfigError, match=r"load\(\) got an empty path; give the artifact's folder"):
        load("")  # was the current folder
    with load(mlp) as model:
        y = model.run(_feeds())["y"]
    assert y.shape == (2, HIDDEN)
    with pytest.raises(SlimmlError, match="the model was closed; load it again to run it."):
        model.run(_feeds())


def test_slimml_threads_is_checked_where_set(monkeypatch):
    monkeypatch.setenv("SLIMML_THREADS", "abc")
    with pytest.raises(ConfigError) as e:
        LoadConfig()
    assert str(e.value) == (f"SLIMML_THREADS='abc' must be a whole number from 1 to 1024 (ONNX Runtime's intra-op threads; "
                            f"this machine has {os.cpu_count()} cores; 0: its choice); fix it or unset it.")
    assert LoadConfig(threads=2).threads == 2  # the variable is not used then
    for value in (" 1 ", "0"):  # 0: ONNX Runtime's choice, as before
        monkeypatch.setenv("SLIMML_THREADS", value)
        assert LoadConfig().threads is None  # read where sessions are made


def test_a_cache_folder_set_to_a_file_by_the_environment_is_refused_where_it_is_used(mlp, tmp_path, monkeypatch):
    """cache_dir= naming a file was refused; SLIMML_CACHE_DIR naming one warned that packing failed,
    fell back to fed weights, and ended in a budget error that said to pack (the default). A load
    that never packs does not read the variable."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SLIMML_CACHE_DIR", str(tmp_path / "afile"))
    from slimml.runtime.engine.packed import cache_root

    with pytest.raises(ConfigError, match=r"SLIMML_CACHE_DIR='.*afile' is a file, not a folder; set it to a folder"):
        cache_root()
    load(mlp).close()  # resident: no cache


def test_slimml_threads_bounds_encodes_lanes(tiny_bert_artifact, monkeypatch):
    """encode's lanes (a batch per core) counted load(threads=) only: SLIMML_THREADS=1 still ran two lanes."""
    from slimml.runtime.engine.cpus import cpu_count
    from slimml.runtime.tasks.lanes import lane_count

    monkeypatch.setenv("SLIMML_THREADS", "1")
    model = load(tiny_bert_artifact)
    assert model.threads == 1
    assert lane_count(None, 8, unfit=None, threads=model.threads, model_bytes=1) == (1, 1)
    monkeypatch.setenv("SLIMML_THREADS", "0")
    assert load(tiny_bert_artifact).threads is None  # ONNX Runtime's choice: lanes by the cores
    assert lane_count(None, 8, unfit=None, threads=None, model_bytes=1)[0] == min(cpu_count(), 8)


def test_load_config_normalises_and_documents_every_field(tmp_path):
    c = LoadConfig(pin=[0, -1], shards=[1, 2], cache_dir=str(tmp_path), memory_budget="4GB")
    assert c.pin == (0, -1) and c.shards == (1, 2) and c.cache_dir == tmp_path and c.memory_budget == "4GB"
    assert LoadConfig(pin=[]).pin is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.device = "cuda"  # one config may be shared by every engine of an artifact
    for f in dataclasses.fields(LoadConfig):  # the CLI makes its flags from these
        if f.name != "manifest_sha256":  # set by a driver for its stages and replicas, not a user's flag
            assert f.metadata["help"].endswith(".") and len(f.metadata["help"]) > 20, f.name
    assert LoadConfig.names() == ["device", "threads", "verify", "resident", "prefetch", "memory_budget", "pin",
                                  "pack", "cache_dir", "shards", "manifest_sha256"]


def test_unknown_load_option_lists_the_valid_ones(mlp):
    with pytest.raises(ConfigError) as e:
        load(mlp, resdent=2)
    assert str(e.value) == (
        "unknown load option 'resdent' (did you mean 'resident'?); the options are device, threads, verify, "
        "resident, prefetch, memory_budget, pin, pack, cache_dir, shards, manifest_sha256."
    )
    with pytest.raises(ConfigError, match=r"^unknown load options 'a', 'b'; the options are device, "):
        load(mlp, a=1, b=2)
    with pytest.raises(ConfigError, match=r"^config must be a LoadConfig, got str 'cuda'; pass options by name "
                                          r"instead, e.g. load\(path, device='cuda'\)\.$"):
        load(mlp, "cuda")


def test_load_takes_a_config_and_overrides_by_name(mlp):
    config = LoadConfig(resident=3, pack=False)
    model = load(mlp, config, prefetch=0)
    assert model.config == dataclasses.replace(config, prefetch=0) and config.prefetch is None  # not changed
    assert model.plan.streaming and (model.plan.resident, model.plan.prefetch) == (3, 0)
    assert all(isinstance(s.source, FedSlots) for s in model.plan.segments if isinstance(s, StreamedSegment))
    old_style = load(mlp, device="cpu", resident=3, prefetch=0, pack=False)  # keywords, as before
    np.testing.assert_allclose(model.run(_feeds())["y"], old_style.run(_feeds())["y"], rtol=1e-6)
    np.testing.assert_allclose(model.run(_feeds())["y"], load(mlp).run(_feeds())["y"], rtol=1e-5, atol=1e-6)


# -- backends -----------------------------------------------------------------------------------


def test_backend_is_chosen_once_from_the_device_name(mlp):
    cpu = backend_for("cpu")
    assert isinstance(cpu, CpuBackend) and backend_for("cpu") is cpu and backend_for(cpu) is cpu
    assert cpu.name == "cpu" and cpu.on_host and not cpu.device_values
    assert cpu.disabled_optimizers() == ["SkipLayerNormFusion"] and cpu.memory_available() > 0
    model = load(mlp, device="auto")
    want = CudaBackend if "CUDAExecutionProvider" in ort.get_available_providers() else CpuBackend
    assert isinstance(model.backend, (want, CpuBackend)) and model.device == model.backend.name  # a string, as before
    assert model.plan.backend is model.backend and model.plan.device == model.device
    with pytest.raises(DeviceError, match=r"^unknown device 'tpu'; use one of \['cpu', 'cuda', 'auto'\]\.$"):
        backend_for("tpu")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        cuda = backend_for("cuda")  # made without a GPU: asking it for providers says what is missing
        assert cuda.disabled_optimizers() is None
        with pytest.raises(DeviceError, match=r"^device='cuda' was asked for, but this onnxruntime has no CUDA provider"):
            cuda.providers()


class _Binding:
    """Records what a backend binds (the shape of ONNX Runtime's IOBinding)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def test_cuda_backend_binds_each_kind_of_value_where_it_sits():
    """The CPU-side logic of the CUDA backend (no GPU needed): a host array is copied up, a streamed
    weight (a class of its own, not a tuple) is bound at its device address, a device value as is."""
    cuda = CudaBackend()
    weight = DeviceWeight(4096, np.dtype(np.float16), (2, 3))
    assert not isinstance(weight, tuple)
    host, kept = np.ones((2, 2), np.float32), ort.OrtValue.ortvalue_from_numpy(np.zeros(3, np.float32))
    binding = _Binding()
    for name, value in (("x", host), ("w", weight), ("past", kept)):
        cuda.bind(binding, name, value)
    assert binding.calls[0][:2] == ("bind_cpu_input", "x") and binding.calls[0][2] is host
    assert binding.calls[1] == ("bind_input", "w", "cuda", 0, np.float16, [2, 3], 4096)
    assert binding.calls[2] == ("bind_ortvalue_input", "past", kept)
    np.testing.assert_array_equal(cuda.to_host(kept), np.zeros(3, np.float32))  # a device value comes back
    assert cuda.to_host(host) is host and cuda.device_values and not cuda.on_host


# -- the declared contracts ---------------------------------------------------------------------


def test_every_segment_and_weight_source_keeps_its_protocol(mlp):
    from slimml.scale.segment import RayStages

    resident = load(mlp).plan.segments
    streamed = load(mlp, resident=2, pin=[0]).plan.segments
    assert [type(s) for s in streamed] == [ResidentSegment, StreamedSegment]
    stages = RayStages([], [(0, 3)], ["n0"], ["x", "scale"], 1, True, 1.0, 0)  # no actors: not run, only checked
    for seg in [*resident, *streamed, stages]:
        assert isinstance(seg, Segment), type(seg).__name__
        assert isinstance(seg.describe(), str) and seg.sessions >= 0 and seg.shards
    manifest = read_manifest(mlp)
    config = LoadConfig()
    packed = streamed[1].source
    assert isinstance(packed, PackedSlots)  # CPU on Linux: pre-packed weights
    sources = [packed, FedSlots(mlp, manifest, backend_for("cpu"), config),
               CudaSlots(mlp, manifest, CudaBackend(), config)]  # made without a GPU: nothing is copied until fill
    for source in sources:
        assert isinstance(source, WeightSource), type(source).__name__
    assert len({s.how for s in sources}) == 3


def test_a_plan_refuses_what_is_not_a_segment(mlp):
    class Half:
        kind, shards = "half", [0]

        def run(self, env, streamer):
            pass

    memory = plan_stream(read_manifest(mlp))
    with pytest.raises(TypeError, match=r"^Half is not a plan segment: it lacks sessions, describe, check_files, close$"):
        ExecutionPlan(memory, "cpu", [Half()], None)


def test_one_session_plan_keeps_its_direct_call(mlp):
    plan = load(mlp).plan
    assert plan.sessions == 1 and plan._only is not None
    assert plan._only._inner is not None  # the session's C++ binding, no Python wrapper in between
    assert plan._only.session is plan.segments[0].steps[0].session


# -- the trusted path ---------------------------------------------------------------------------


class _OnDevice:
    """A value a backend with device memory left there."""

    def __init__(self, array: np.ndarray):
        self.array = array


class _DeviceLike(CpuBackend):
    """A CPU backend whose step outputs stay 'on the device' (wrapped) until copied to the host:
    the plan's handling of device values, testable without a GPU."""

    device_values = True
    bound: list = []  # the device values fed to a session

    def direct(self, session):
        return None

    def run(self, session, outputs, feeds, on_device):
        type(self).bound += [v for v in feeds.values() if isinstance(v, _OnDevice)]
        values = session.run(outputs, {k: self.to_host(v) for k, v in feeds.items()})
        return [_OnDevice(v) for v in values] if on_device else values

    def to_host(self, value):
        return value.array if isinstance(value, _OnDevice) else value


@pytest.mark.parametrize("resident", [None, 2])
def test_run_trusted_keeps_outputs_it_is_told_to_on_the_device(mlp, resident):
    manifest = read_manifest(mlp)
    memory = plan_stream(manifest, resident=resident)
    config = LoadConfig(resident=resident, pack=False)
    engine = Engine(mlp, manifest, config, memory, plan=build_plan(mlp, manifest, memory, config, _DeviceLike()))
    want = load(mlp).run(_feeds())["y"]
    out = engine.run(_feeds())  # checked: host arrays, whatever the backend
    assert isinstance(out["y"], np.ndarray)
    np.testing.assert_allclose(out["y"], want, rtol=1e-5, atol=1e-6)
    kept = engine.run_trusted(_feeds(), keep_on_device=["y"])["y"]
    assert isinstance(kept, _OnDevice)
    np.testing.assert_allclose(engine.to_host(kept), want, rtol=1e-5, atol=1e-6)
    _DeviceLike.bound = []
    again = engine.run_trusted({"x": kept, "scale": _feeds()["scale"]}, keep_on_device=["y"])["y"]  # fed back
    assert any(v is kept for v in _DeviceLike.bound)  # bound where it sat, never copied out in between
    twice = load(mlp).run({"x": want, "scale": _feeds()["scale"]})["y"]
    np.testing.assert_allclose(engine.to_host(again), twice, rtol=1e-4, atol=1e-5)
    engine.close()


def test_run_trusted_on_cpu_returns_host_arrays_and_the_same_numbers(tiny_llama_past_artifact):
    model = load(tiny_llama_past_artifact)
    past = {t.name: np.zeros((1, t.shape[1], 0, t.shape[3]), np.float32) for t in model.inputs if t.name.startswith("past")}
    ids = np.array([[5, 6, 7]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(3)[None], **past}
    presents = [n.replace("past_key_values.", "present.", 1) for n in past]
    checked = model.run(dict(feeds))
    trusted = model.run_trusted(dict(feeds), keep_on_device=presents)
    for name in ["logits", *presents]:
        assert isinstance(trusted[name], np.ndarray)
        np.testing.assert_array_equal(trusted[name], checked[name])


def test_an_engine_refusal_says_what_to_check_without_onnx_runtime_s_build_paths(tmp_path):
    """Images of the wrong size reached ONNX Runtime and came back with its build path
    (``/onnxruntime_src/.../element_wise_ops.h:583 void onnxruntime::...``) and advice about token ids."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from slimml.convert import ConvertConfig, convert
    from slimml.errors import FeedError
    from slimml.runtime import load
    from slimml.runtime.engine.backends.base import first_line

    x = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, "height", "width"])
    y = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3, 4, 4])
    table = numpy_helper.from_array(np.ones((1, 3, 4, 4), np.float32), "positions")
    graph = helper.make_graph([helper.make_node("Add", ["pixel_values", "positions"], ["out"])], "g", [x], [y], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    convert(tmp_path / "m.onnx", tmp_path / "art", ConvertConfig(measure_latency=False, verify=False))
    model = load(tmp_path / "art")
    assert model.run({"pixel_values": np.zeros((1, 3, 4, 4), np.float32)})["out"].shape == (1, 3, 4, 4)
    with pytest.raises(FeedError, match=r"rejected the inputs: .*Check the images' size and channels") as e:
        model.run({"pixel_values": np.zeros((1, 3, 8, 8), np.float32)})
    assert "onnxruntime_src" not in str(e.value) and "token ids" not in str(e.value)
    cpp = ("Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/math/element_wise_ops.h:583 void "
           "onnxruntime::BroadcastIterator::Append(ptrdiff_t, ptrdiff_t) axis == 1 was false.\nmore")
    assert first_line(Exception(cpp)) == "Status Message: axis == 1 was false."


def test_reading_the_machines_memory_leaves_no_file_open():
    """/proc/meminfo and the cgroup files were opened and left to the collector: a ResourceWarning
    each, which fails an embedding app's tests run with warnings as errors."""
    import gc
    import warnings

    from slimml.runtime.engine.budget import available_memory

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        available_memory()
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], [str(w.message) for w in seen]


def test_close_while_other_threads_call_gives_each_the_closed_error(tiny_bert_artifact):
    """An application shutting down with calls under way: some threads got a KeyError (the plan
    walked after close emptied it) or EBADF (the file watch's queue closed under its poll)."""
    import random
    import threading
    import time

    from slimml.errors import SlimmlError

    errors: list[BaseException] = []
    pick = random.Random(0)  # the same close times every run: a failure can be run again
    for _ in range(8):
        model = load(tiny_bert_artifact)

        def call():
            while True:
                try:
                    model.encode(["a short text"])
                except BaseException as e:  # noqa: BLE001 - what each thread got is the point
                    errors.append(e)
                    return

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(pick.uniform(0.02, 0.2))
        model.close()
        for t in threads:
            t.join(30)
    assert len(errors) == 32
    assert {(type(e), str(e)) for e in errors} == {(SlimmlError, "the model was closed; load it again to run it.")}
