"""The streaming runtime: K resident shards, background prefetch, budgets, threads, integrity."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import numpy as np
import pytest

from slimml.errors import ConfigError, FeedError, IntegrityError
from slimml.runtime import load
from slimml.runtime.engine.budget import parse_bytes, plan_stream
from slimml.runtime.artifact.manifest import read_manifest
from conftest import tiny_onnx_mlp


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    """A 6-block ONNX MLP split per layer: 6 weight-bearing shards."""
    from slimml.convert import ConvertConfig, convert

    tmp = tmp_path_factory.mktemp("stream_mlp")
    src = tiny_onnx_mlp(tmp / "mlp.onnx", layers=6, hidden=32)
    out = tmp / "art"
    convert(src, out, ConvertConfig(measure_latency=False))
    return out


def _feeds(batch=3, hidden=32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, hidden)).astype(np.float32),
            "scale": rng.random((batch, 1)).astype(np.float32)}


def test_default_load_is_fully_resident(mlp_artifact):
    model = load(mlp_artifact)
    assert not model.plan.streaming and model.plan.streamer is None
    assert model.stats.passes == 0


def test_a_model_bigger_than_free_memory_streams_rather_than_be_killed(mlp_artifact, monkeypatch, caplog):
    """A plain load() of a model bigger than the memory free loaded it whole, and under a memory cgroup the
    kernel killed the process as it loaded, with no word (SmolLM2 fp32, 655 MB, in a 550 MB cap). It streams
    now, within a share of what is free, and says so; any streaming option (resident=N) is the caller's."""
    from slimml.runtime.engine import budget
    from slimml.runtime.engine.backends import cpu

    full = load(mlp_artifact)
    total, n = full.plan.model_bytes, len(full.manifest.shards)
    monkeypatch.setattr(budget, "AUTO_MIN", 0)  # this one is of KBs
    monkeypatch.setattr(cpu, "available_memory", lambda: total - 1)
    with caplog.at_level(logging.WARNING, logger="slimml"):
        model = load(mlp_artifact)
    assert model.plan.streaming and model.plan.memory.budget == int((total - 1) * 0.6)
    assert "so it streams within" in caplog.text and f"resident={n} loads it whole anyway" in caplog.text
    np.testing.assert_allclose(model.run(_feeds())["y"], full.run(_feeds())["y"], rtol=0, atol=1e-6)
    assert not load(mlp_artifact, resident=n).plan.streaming  # the caller's choice stands
    monkeypatch.setattr(cpu, "available_memory", lambda: max(full.plan.sizes))
    with pytest.raises(ConfigError, match=rf"takes about .* loaded whole, and only .* of memory is free.*largest shard.*"
                                          rf"resident={n} \(--resident {n}\) loads it whole anyway"):
        load(mlp_artifact)
    monkeypatch.setattr(cpu, "available_memory", lambda: int(total / 0.9) + 1)
    assert not load(mlp_artifact).plan.streaming  # it fits, a tenth to spare: whole
    monkeypatch.setattr(cpu, "available_memory", lambda: budget.UNKNOWN_MEMORY)  # the system cannot tell: as before
    assert not load(mlp_artifact).plan.streaming
    monkeypatch.setattr(budget, "AUTO_MIN", 32 * 10**6)
    monkeypatch.setattr(cpu, "available_memory", lambda: 0)
    assert not load(mlp_artifact).plan.streaming  # a model of KBs loads whole whatever is said free


def test_an_automatic_budget_holds_every_components_largest_shard(mlp_artifact, monkeypatch):
    """An encoder-decoder's automatic budget held the largest shard of one component only; split_budget then
    refused it, asking for a memory_budget the caller never gave."""
    from slimml.runtime.engine import budget

    m = read_manifest(mlp_artifact)
    parts = {"encoder": m, "decoder": m}  # two chains, as an encoder-decoder's
    least = 2 * max(budget.shard_bytes(m))
    monkeypatch.setattr(budget, "AUTO_MIN", 0)
    free = int(least / 0.85)  # 60% of it cannot hold both largest shards
    assert budget.auto_budget(parts, free) == least
    budget.split_budget(parts, least)  # what load() plans with it: no refusal


@pytest.mark.parametrize("resident,prefetch,pin", [(1, None, None), (2, 1, None), (3, None, None), (4, 1, [0, -1])])
def test_streamed_equals_resident(mlp_artifact, resident, prefetch, pin):
    full = load(mlp_artifact)
    model = load(mlp_artifact, resident=resident, prefetch=prefetch, pin=pin)
    n = len(model.manifest.shards)
    assert model.plan.streaming and model.plan.resident == resident
    for seed in range(3):  # several passes: the cyclic loader must start each pass at its first shard
        want = full.run(_feeds(seed=seed))["y"]
        got = model.run(_feeds(seed=seed))["y"]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # streamed shards skip weight prepacking
    st = model.stats
    assert st.passes == 3
    assert st.peak_streamed <= resident - len(pin or [])  # never more than K loaded at once
    sizes = {f.path: f.bytes for f in model.manifest.files}
    streamed_bytes = sum(sizes[model.manifest.shards[i].data] for i in model.plan.streamed)
    assert st.bytes_loaded >= 3 * streamed_bytes  # every streamed shard's weights are read once per pass
    assert len(model.plan.streamed) == n - len(pin or [])
    model.close()
    assert not model.plan.streamer.alive


def test_budget_picks_k_and_says_so(mlp_artifact):
    m = read_manifest(mlp_artifact)
    plan = plan_stream(m)
    sizes = sorted(plan.sizes, reverse=True)
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # room for two of the largest shards, not three
    model = load(mlp_artifact, memory_budget=budget)
    assert model.plan.resident == 2 and model.plan.prefetch == 1
    assert model.plan.peak_bytes <= budget
    assert "K=2 resident, P=1 prefetched" in model.plan.describe()
    assert "K=2 is the most that fits" in model.plan.describe()
    np.testing.assert_array_equal(model.run(_feeds())["y"], load(mlp_artifact).run(_feeds())["y"])
    assert not load(mlp_artifact, memory_budget="1GB").plan.streaming  # everything fits: resident


def test_budget_below_largest_shard_is_refused_before_loading(mlp_artifact, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(mlp_artifact, art)
    m = read_manifest(art)
    sizes = plan_stream(m).sizes
    big = int(np.argmax(sizes))
    (art / m.shards[big].data).write_bytes(b"garbage")  # would fail hashing if anything loaded
    with pytest.raises(ConfigError) as e:
        load(art, memory_budget=1000)
    assert str(e.value) == (
        f"memory budget 1.00 KB is smaller than shard {big} (shard_{big:03d}.onnx, {sizes[big] / 1e3:.2f} KB), the "
        f"largest shard; a shard must fit whole. Give at least 1MB (memory_budget=, --memory-budget), or re-convert with smaller "
        "shards (--shard-size)."
    )
    # a layered model's embedding or head: one weight, which no smaller --shard-size cuts (that advice could not help)
    from slimml.runtime.artifact.manifest import ShardSpec

    headed = dataclasses.replace(m, shards=[dataclasses.replace(sh, layers=[] if sh.index == big else ["layers.0"])
                                            for sh in m.shards])
    assert isinstance(headed.shards[0], ShardSpec)
    with pytest.raises(ConfigError, match=r"1MB \(memory_budget=, --memory-budget\); it is the token embedding or the head, "
                                          r"one weight no smaller --shard-size cuts\.$"):
        plan_stream(headed, memory_budget=1000)
    from slimml.runtime.engine.budget import _apart

    # figures that both read "113.25 MB" are shown in bytes (the refusal read "113.25 MB is smaller than ... 113.25 MB")
    assert _apart(113_250_947, 113_250_948) == ("113,250,947 bytes", "113,250,948 bytes")
    assert _apart(1000, 4825) == ("1.00 KB", "4.83 KB")


@pytest.mark.parametrize("kwargs,message", [
    ({"resident": 0}, "resident=0 must be a whole number >= 1 (shards loaded at once)."),
    ({"resident": 2, "prefetch": 2}, "prefetch=2 needs 3 streaming slots (the shard computing plus those loading), "
                                     "but resident=2 with 0 pinned leaves 2. Use prefetch <= 1 or raise resident."),
    ({"resident": 2, "pin": [0, -1]}, "resident=2 leaves no slot for streaming: 2 shard(s) are pinned ([0, 5]). "
                                      "Use resident >= 3, or pin fewer shards."),
    ({"pin": [9]}, "pin=[9] names shard 9, but the model has shards 0..5 (or -1..-6); pin shards in that range."),
    ({"pin": [0]}, "pin=[0] keeps shards loaded while the others stream, and nothing streams without resident= or "
                   "memory_budget= (--resident K, --memory-budget); give one, or drop pin."),  # it was ignored
    ({"resident": 3, "pin": [0, -6]}, "pin=[0, -6] names shard 0 twice (a negative index counts from the end, -1 the "
                                      "last of 6); give each shard once."),
    ({"resident": 6, "memory_budget": 10000}, "resident=6 needs 28.74 KB, over the 10.00 KB budget; give fewer resident "
                                             "shards, a larger budget, or only the budget (it picks resident)."),
    ({"memory_budget": "lots"}, "memory budget 'lots' is not a size; write it like '4GB', '512MB', '1.5GiB' or a number of bytes."),
])
def test_bad_stream_options(mlp_artifact, kwargs, message):
    with pytest.raises(ConfigError) as e:
        load(mlp_artifact, **kwargs)
    assert str(e.value) == message


def test_bad_feed_names_on_a_streamed_model(mlp_artifact):
    model = load(mlp_artifact, resident=2)
    with pytest.raises(FeedError) as e:
        model.run({"x": _feeds()["x"]})
    assert str(e.value) == "bad feeds: missing input(s) ['scale']; feed the model's inputs by name, exactly these: ['x', 'scale']."
    np.testing.assert_allclose(model.run(_feeds())["y"], load(mlp_artifact).run(_feeds())["y"], atol=1e-6)


def test_parse_bytes():
    assert parse_bytes("4GB") == 4 * 10**9
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(1234) == 1234
    for bad in (float("nan"), float("inf"), "1" + "0" * 400):  # before: ValueError, OverflowError, a traceback
        with pytest.raises(ConfigError, match="is not a size a machine has"):
            parse_bytes(bad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_streamed_model_runs_in_a_forked_child(mlp_artifact):
    """The loader thread (and the reading pool) do not survive a fork: a child's pass waited for them
    forever (multiprocessing's fork pool, a server's pre-fork workers). The child starts its own."""
    import signal

    model = load(mlp_artifact, resident=2)
    want = model.run(_feeds())["y"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: three passes (past the slots filled before the fork), their last one sent back
        signal.alarm(60)  # a hang ends the child, and the parent sees it
        try:
            for _ in range(3):
                got = model.run(_feeds())["y"]
            os.write(write, got.astype(np.float32).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"the child ended with status {status}"
    np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(want.shape), want)
    np.testing.assert_array_equal(model.run(_feeds())["y"], want)  # and the parent's loader goes on
    model.close()


def test_concurrent_runs_never_mix(mlp_artifact):
    model = load(mlp_artifact, resident=2)
    # the same model run one call at a time is the reference: concurrent calls must match it bit for bit
    want = {seed: model.run(_feeds(batch=seed + 1, seed=seed))["y"] for seed in range(4)}
    errors = []

    def worker(seed):
        try:
            for _ in range(5):
                got = model.run(_feeds(batch=seed + 1, seed=seed))["y"]
                np.testing.assert_array_equal(got, want[seed])
        except BaseException as e:  # reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert model.stats.passes == 24


def test_shard_failing_its_hash_mid_stream(mlp_artifact, tmp_path):
    import shutil

    art = tmp_path / "art"
    shutil.copytree(mlp_artifact, art)
    model = load(art, resident=2, pack=False)  # weights fed from the artifact's own data files
    model.run(_feeds())
    bad = model.manifest.shards[4]
    data = art / bad.data
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # same size, other bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="was rewritten or replaced after the model was loaded"):
        model.run(_feeds())  # the model's file watch refuses before any shard runs
    with pytest.raises(IntegrityError) as e:
        model.plan.run(_feeds(), ['y'])  # the engine on its own: the shard fails its hash as it streams in
    assert str(e.value) == (
        f"{bad.data} does not match its sha256 in the manifest: the file is corrupted or was tampered with. "
        "Copy the artifact again or re-convert; slimml will not run it."
    )
    loader = model.plan.streamer._loader
    loader.thread.join(timeout=10)
    assert not loader.thread.is_alive()  # the loader shut down, nothing hangs
    with pytest.raises(IntegrityError):  # later calls fail fast with the same error
        model.run(_feeds())


def test_packed_weights_damaged_in_the_cache_are_refused(mlp_artifact, tmp_path):
    model = load(mlp_artifact, resident=2, cache_dir=tmp_path / "cache")
    source = model.plan.segments[0].source
    assert "pre-packed weights mapped from the cache" in model.plan.describe()
    want = load(mlp_artifact).run(_feeds())["y"]
    np.testing.assert_allclose(model.run(_feeds())["y"], want, rtol=0, atol=1e-5)
    packed = source.entries[3].data
    raw = bytearray(packed.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    packed.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as e:
        model.run(_feeds())
    assert str(e.value) == (
        f"the cache entry {packed.parent} is damaged: shard.onnx.data does not match the hash recorded when it was "
        f"written. Delete {packed.parent} (slimml rebuilds it) and load the model again."
    )
    with pytest.raises(IntegrityError):  # a fresh load refuses it too (ONNX Runtime may notice first)
        load(mlp_artifact, resident=2, cache_dir=tmp_path / "cache").run(_feeds())
    import shutil

    shutil.rmtree(packed.parent)
    np.testing.assert_allclose(load(mlp_artifact, resident=2, cache_dir=tmp_path / "cache").run(_feeds())["y"], want,
                               rtol=0, atol=1e-5)  # rebuilt


def test_packed_weights_written_in_place_with_their_mtime_put_back_are_refused(mlp_artifact, tmp_path):
    model = load(mlp_artifact, resident=2, cache_dir=tmp_path / "cache")
    model.run(_feeds())
    packed = model.plan.segments[0].source.entries[3].data
    st = os.stat(packed)
    with open(packed, "r+b") as f:  # same size, same inode, and the mtime put back after
        f.seek(st.st_size // 2)
        f.write(b"\x7f" * 4)
    os.utime(packed, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IntegrityError, match="shard.onnx.data does not match the hash recorded"):
        model.run(_feeds())  # its ctime moved: hashed again before the slot is filled


def test_a_tampered_shard_never_reaches_the_shared_packed_cache(mlp_artifact, tmp_path):
    """The cache is keyed on the manifest's hashes and shared by every later load: packed from a
    tampered file under verify=False, it served the tampered weights to a verified load of the
    genuine artifact (``verify()`` passed). The bytes packed are hashed against the manifest now."""
    import shutil

    art = tmp_path / "art"
    shutil.copytree(mlp_artifact, art)
    data = art / load(art).manifest.shards[3].data
    genuine = data.read_bytes()
    raw = bytearray(genuine)
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"does not match its sha256 in the manifest, so shard 3 was not packed"):
        load(art, resident=2, verify=False, cache_dir=tmp_path / "cache")
    data.write_bytes(genuine)
    model = load(art, resident=2, cache_dir=tmp_path / "cache")
    np.testing.assert_allclose(model.run(_feeds())["y"], load(art).run(_feeds())["y"], rtol=0, atol=1e-5)
    model.verify()


def test_bad_feeds_mid_pass_leave_the_model_usable(tiny_llama_artifact):
    full = load(tiny_llama_artifact)
    model = load(tiny_llama_artifact, resident=2)
    good = _llama_feeds()
    bad = dict(good, input_ids=np.full_like(good["input_ids"], 10**6))  # out of the vocabulary: fails inside a shard
    want = full.run(good)["logits"]
    results = []

    def body():  # repeated: the loader may be mid-load when a failed pass skips ahead (a past deadlock)
        for _ in range(6):
            with pytest.raises(FeedError, match="rejected the inputs"):
                model.plan.run(dict(bad), ['logits'])  # the plan itself; Model.run refuses such ids before any shard
            results.append(float(np.abs(model.run(good)["logits"] - want).max()))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "a run after a failed pass hung"
    assert len(results) == 6 and max(results) <= 1e-5


@pytest.fixture(scope="module")
def tiny_llama_artifact(tiny_llama_dir, tmp_path_factory):
    from slimml.convert import ConvertConfig, ExportConfig, convert

    out = tmp_path_factory.mktemp("stream_llama") / "art"
    convert(tiny_llama_dir, out, ConvertConfig(export=ExportConfig(task="text-generation"), verify=False,
                                               measure_latency=False))
    return out


def _llama_feeds(batch=2, seq=7, seed=0):
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 512, size=(batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), dtype=np.int64),
            "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy()}


def test_streamed_decoder_matches_torch_greedy(tiny_llama_artifact, tiny_llama_dir):
    import torch
    from transformers import LlamaForCausalLM

    prompts = np.random.default_rng(1).integers(0, 512, size=(2, 6)).tolist()
    model = load(tiny_llama_artifact, resident=2, pin=[-1])
    got = model.generate(prompts, max_new_tokens=5)
    assert got.passes == 5 and all(len(t) == 5 for t in got.tokens)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), max_new_tokens=5, do_sample=False, attention_mask=torch.ones(2, 6, dtype=torch.long),
                           pad_token_id=0, eos_token_id=None)
    assert got.tokens == want[:, 6:].tolist()
    assert got.tokens == load(tiny_llama_artifact).generate(prompts, max_new_tokens=5).tokens


def test_generate_left_pads_a_batch_of_uneven_prompts(tiny_llama_artifact):
    model = load(tiny_llama_artifact, resident=3)
    short, long = [5, 6, 7], [8, 9, 10, 11, 12]
    both = model.generate([short, long], max_new_tokens=3).tokens
    alone = [model.generate([p], max_new_tokens=3).tokens[0] for p in (short, long)]
    assert both == alone


def test_kv_cache_generation_matches_cache_free(tiny_llama_artifact, tiny_llama_past_artifact):
    out = tiny_llama_past_artifact
    m = read_manifest(out)
    layer_shards = [s for s in m.shards if any(t.name.startswith("past_key_values.") and t.name.endswith(".value")
                                               for t in s.inputs)]
    assert len(layer_shards) == 3  # each layer's cache goes to that layer's shard (transformers 5's trace reads
    # layer 0's key in the embedding shard too: the cache's length, for the mask)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    cached = load(out, resident=2).generate(prompts, max_new_tokens=4)
    assert cached.passes == 4
    assert cached.tokens == load(tiny_llama_artifact).generate(prompts, max_new_tokens=4).tokens


def test_two_models_of_one_packed_artifact_page_only_their_own_mappings(mlp_artifact, tmp_path):
    import gc

    want = load(mlp_artifact).run(_feeds())["y"]
    first = load(mlp_artifact, resident=2, cache_dir=tmp_path / "cache")
    second = load(mlp_artifact, resident=2, cache_dir=tmp_path / "cache")  # the same packed files, mapped again
    a, b = first.plan.segments[0].source, second.plan.segments[0].source
    for i in a.ranges:
        assert not set(a.ranges[i]) & set(b.ranges[i])  # each manages only the mappings its sessions made
    first.run(_feeds())
    first.close()
    del first, a
    gc.collect()
    junk = [np.ones(1 << 16, np.float32) for _ in range(64)]  # memory that may reuse the freed addresses
    for seed in range(3):
        np.testing.assert_allclose(second.run(_feeds(seed=seed))["y"], load(mlp_artifact).run(_feeds(seed=seed))["y"],
                                   rtol=0, atol=1e-5)
    assert all((j == 1).all() for j in junk)  # nothing of ours was advised away
    np.testing.assert_allclose(second.run(_feeds())["y"], want, rtol=0, atol=1e-5)


def test_models_loading_one_cold_packed_cache_at_once_all_load_and_agree(mlp_artifact, tmp_path):
    """Threads of a worker pool load the same streamed artifact at once, nothing packed yet: one
    writes each cache entry while the others wait and read it, and each model knows its own
    mappings (before, the others swapped in their own copy under it, and it refused the entry as
    changed; or took another's mappings as its own)."""
    from slimml.errors import SlimmlError

    want = load(mlp_artifact).run(_feeds())["y"]
    got, failed = [], []

    def go():
        try:
            model = load(mlp_artifact, resident=1, cache_dir=tmp_path / "cache")
            got.append(model.run(_feeds())["y"])
            model.verify()
        except SlimmlError as e:
            failed.append(str(e))

    threads = [threading.Thread(target=go) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not failed and len(got) == 4, failed
    for y in got:
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)


def test_a_closed_model_refuses_every_call_in_one_line(mlp_artifact, tiny_llama_artifact):
    """Resident or streamed, an encoder's lanes or a decoder's cache loop: after close() each call
    says so (before, a resident model kept running, or a decoder failed with KeyError: 'logits')."""
    from slimml.errors import SlimmlError

    for model, call in ((load(mlp_artifact), lambda m: m.run(_feeds())),
                        (load(mlp_artifact, resident=2), lambda m: m.run(_feeds())),
                        (load(tiny_llama_artifact), lambda m: m.generate([[5, 6, 7]], max_new_tokens=3))):
        call(model)
        model.close()
        with pytest.raises(SlimmlError, match="the model was closed; load it again"):
            call(model)


def test_layers_of_one_type_share_one_compiled_session(tmp_path):
    """Streamed shards whose graphs are the same once named by position (every layer of a chain)
    run on one session: one compilation and one set of buffers instead of one per layer."""
    from slimml.convert import ConvertConfig, convert

    art = tmp_path / "art"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=6, hidden=512), art, ConvertConfig(measure_latency=False))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 512)).astype(np.float32),
             "scale": rng.uniform(0.5, 1.0, (3, 1)).astype(np.float32)}
    own = load(art, resident=2, pack=False)  # weights fed as inputs
    assert own.plan.sessions == 2  # five layers share one; the last also holds the head
    want = load(art).run(feeds)["y"]
    for _ in range(2):
        got = own.run(feeds)["y"]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_an_fp16_artifact_streams_with_weights_fed(mlp_artifact, tmp_path):
    """fp16 shards come from a converter that writes nodes out of order: still one valid graph per
    layer type, fed the same weights."""
    from slimml.quantize import Fp16Config, quantize

    quantize(mlp_artifact, tmp_path / "h", Fp16Config())
    want = load(tmp_path / "h").run(_feeds())["y"]  # ONNX Runtime's CPU provider runs fp16 too
    np.testing.assert_allclose(load(tmp_path / "h", resident=2, pack=False).run(_feeds())["y"], want, rtol=0, atol=1e-3)


def test_an_int4_encoder_streams_with_its_4_bit_embedding_kept_as_a_constant(tiny_bert_artifact, tmp_path, caplog):
    """An encoder's 4-bit embedding table (INT4, two values a byte) was refused as fed weights
    ("records 488352 bytes for shape (30522, 32); re-convert it"): streaming with pack=False, or
    after any packing failure, failed on every int4 encoder and seq2seq artifact."""
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config

    quantize(tiny_bert_artifact, tmp_path / "int4", scheme_config("int4-weights"))
    want = load(tmp_path / "int4").encode(["a man plays a guitar", "short"])
    for kw in ({"pack": False}, {"cache_dir": tmp_path / "cache"}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slimml"):
            got = load(tmp_path / "int4", resident=1, **kw).encode(["a man plays a guitar", "short"])
        np.testing.assert_array_equal(got, want)
        said = [r.getMessage() for r in caplog.records if "4-bit weights stay" in r.getMessage()]
        assert len(said) == (1 if kw.get("pack") is False else 0), said  # held beside the budget: said, once


def test_shards_without_a_weight_of_1_kb_stream_pre_packed_from_empty_cache_entries(tmp_path):
    """ONNX Runtime writes no pre-packed data file for a shard whose weights are all under 1 KB (a
    small head): its cache entry holds an empty one, and the shard streams with nothing to map,
    first load and later ones alike (the whole model's packing used to fail)."""
    from slimml.convert import ConvertConfig, convert

    src = tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=3, hidden=8)  # 8 x 8 fp32 weights: 256 bytes
    convert(src, tmp_path / "art", ConvertConfig(measure_latency=False))
    want = load(tmp_path / "art").run(_feeds(hidden=8))["y"]
    for _ in range(2):  # packed, then read from the cache
        model = load(tmp_path / "art", resident=1, cache_dir=tmp_path / "cache")
        assert "pre-packed weights mapped from the cache" in model.plan.describe()
        np.testing.assert_array_equal(model.run(_feeds(hidden=8))["y"], want)
    data = sorted((tmp_path / "cache").rglob("shard.onnx.data"))
    assert len(data) == 3 and all(f.stat().st_size == 0 for f in data)


def test_a_budget_counts_the_4_bit_weights_a_fed_session_keeps():
    """Fed 4-bit weights stay in their session for the model's life, outside the slots: the plan
    counted them in their shard's slot, so K=2 held 690 bytes under a 600-byte budget."""
    from types import SimpleNamespace

    from slimml.runtime.engine.budget import StreamPlan, refit

    manifest = SimpleNamespace(shards=[SimpleNamespace(file=f"shard_{i:03d}.onnx") for i in range(4)])
    plan = StreamPlan(2, 1, [], [0, 1, 2, 3], 600, 1000, "", [100, 300, 300, 300], 600)
    fitted = refit(plan, {}, manifest, None, {0: 90})
    assert (fitted.resident, fitted.prefetch, fitted.peak_bytes) == (1, 0, 390)
    assert fitted.sizes == plan.sizes and "with the 4- or 8-bit weights the sessions keep (90 B)" in fitted.reason
    assert refit(plan, {}, manifest, None, {}) is plan  # nothing kept: the plan as made
    unbounded = refit(dataclasses.replace(plan, budget=None), {}, manifest, 2, {0: 90})
    assert (unbounded.resident, unbounded.peak_bytes) == (2, 690)  # K as asked; the peak says what it holds
    with pytest.raises(ConfigError, match=r"resident=2 can need 690 B with the 4- or 8-bit weights the sessions keep, over "
                                          r"the 600 B budget. Use resident=1 or fewer, .* or load with pack=True"):
        refit(plan, {}, manifest, 2, {0: 90})
    with pytest.raises(ConfigError, match=r"cannot hold shard 1 .* beside the 4- or 8-bit weights the streamed shards' "
                                          r"sessions keep \(350 B\)\. Give at least 1MB, or load with pack=True"):
        refit(plan, {}, manifest, None, {0: 90, 2: 260})
    # fed because packing failed (a read-only cache): the fix is where packing writes, not pack=True, which was asked
    with pytest.raises(ConfigError, match=r"Give at least 1MB, or let packing work \(packing shard 0 into /c failed "
                                          r"\(Read-only file system\)\): set SLIMML_CACHE_DIR"):
        refit(plan, {}, manifest, None, {0: 90, 2: 260}, None, "packing shard 0 into /c failed (Read-only file system)")


def test_a_budget_counts_the_float_matrix_a_fed_4_bit_matmul_unpacks_to(tmp_path):
    """A 4-bit weight fed as an input is not pre-packed: ONNX Runtime's MatMulNBits unpacks it to a
    K x N float matrix each pass, and the shared arena keeps the largest. SmolLM2's lm_head (113 MB
    unpacked) took a 40 MB budget to 302 MB of RSS, more than the model resident (284 MB)."""
    from types import SimpleNamespace

    from conftest import save_tiny_llama
    from slimml.convert import ConvertConfig, ExportConfig, convert
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config
    from slimml.runtime.engine.budget import StreamPlan, refit

    manifest = SimpleNamespace(shards=[SimpleNamespace(file=f"shard_{i:03d}.onnx") for i in range(4)])
    plan = StreamPlan(2, 1, [], [0, 1, 2, 3], 600, 1000, "", [100, 300, 300, 300], 700)
    fitted = refit(plan, {}, manifest, None, None, {1: 50, 3: 80})  # one shard runs at a time: the largest counts
    assert (fitted.resident, fitted.peak_bytes) == (2, 680) and fitted.sizes == plan.sizes
    with pytest.raises(ConfigError, match=r"resident=2 can need 680 B with the 4- or 8-bit weights the sessions unpack, over"):
        refit(dataclasses.replace(plan, budget=650), {}, manifest, 2, None, {1: 50, 3: 80})
    folder = save_tiny_llama(tmp_path / "hf", hidden_size=128, intermediate_size=256)
    convert(folder, tmp_path / "fp32", ConvertConfig(export=ExportConfig(task="text-generation-with-past"),
                                                     measure_latency=False))
    art = tmp_path / "int4"
    quantize(tmp_path / "fp32", art, scheme_config("int4-weights"))
    model = load(art, resident=2, pack=False)
    source = next(s for s in model.plan.segments if s.kind == "streamed").source
    unpacked = source.unpacked_bytes()
    assert unpacked and min(unpacked.values()) >= 128 * 256 * 4  # each layer's MLP: hidden x intermediate floats
    top = max(unpacked, key=unpacked.get)
    assert model.plan.peak_bytes >= unpacked[top] + max(model.plan.sizes[1:])
    with pytest.raises(ConfigError, match=r"cannot hold shard \d+ .* the largest fed 4- or 8-bit matmul weight "
                                          rf"unpacked to float as its shard runs .*shard {top}; pin it"):
        load(art, memory_budget=unpacked[top] // 2 + max(model.plan.sizes), pack=False)


def test_a_budget_holds_the_pre_packed_weights_not_the_files(tmp_path):
    """A 4-bit shard's weights pre-packed for the CPU take ~1.5x its file; the budget counted the
    files, so a slot held 26% more than the budget allowed. Now K is fitted to what the slots hold,
    and a budget that cannot hold one packed shard is refused, naming both sizes."""
    from conftest import save_tiny_llama
    from slimml.convert import ConvertConfig, ExportConfig, convert
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config

    folder = save_tiny_llama(tmp_path / "hf", hidden_size=128, intermediate_size=256)
    convert(folder, tmp_path / "fp32", ConvertConfig(export=ExportConfig(task="text-generation-with-past"),
                                                     measure_latency=False))
    art = tmp_path / "int4"
    quantize(tmp_path / "fp32", art, scheme_config("int4-weights"))
    probe = load(art, resident=2, cache_dir=tmp_path / "cache")
    source = next(s for s in probe.plan.segments if s.kind == "streamed").source
    packed = source.loaded_bytes()
    files = probe.plan.sizes
    layer = max(packed, key=packed.get)
    assert packed[layer] > 1.2 * files[layer]
    with pytest.raises(ConfigError, match=rf"cannot hold shard {layer} .* as it runs: .* on disk, .* with its weights "
                                          r"pre-packed for this CPU.*pack=False"):
        load(art, memory_budget=(files[layer] + packed[layer]) // 2, cache_dir=tmp_path / "cache")
    want = load(art).generate([[5, 6, 7]], max_new_tokens=4).tokens
    budget = int(1.5 * packed[layer]) + files[0] + files[-1]  # two layers' files fit beside the ends, one packed layer
    model = load(art, memory_budget=budget, cache_dir=tmp_path / "cache")
    stream = model.plan.memory
    slots = stream.resident - len(stream.pinned)
    held = sum(stream.sizes[i] for i in stream.pinned) + sum(sorted((packed[i] for i in stream.streamed), reverse=True)[:slots])
    assert model.plan.streaming and slots == 1 and held <= budget and model.plan.peak_bytes <= budget
    assert "with the weights pre-packed for this CPU" in model.plan.describe()
    assert model.generate([[5, 6, 7]], max_new_tokens=4).tokens == want
    with pytest.raises(ConfigError, match=r"resident=4 can need .* with the weights pre-packed for this CPU, over the"):
        load(art, memory_budget=budget, resident=4, pin=[0, 4], cache_dir=tmp_path / "cache")
