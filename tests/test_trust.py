"""Trust against an attacker, without a server: nothing unpickled, a cache that is checked, calls
that cannot ask for unbounded memory, atomic writers that follow nothing planted.

(The server's side, a running server under hostile requests, is tests/test_serve_hostile.py.)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import mlp_artifact_in

from slimml.errors import ConfigError, FeedError, IntegrityError, SlimmlError
from slimml.runtime import load


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    """A 4-block ONNX MLP split per layer: shards to stream through the pre-packed cache."""
    return mlp_artifact_in(tmp_path_factory.mktemp("trust_mlp"), layers=4, hidden=32)


def _feeds(batch=3, hidden=32):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((batch, hidden)).astype(np.float32),
            "scale": rng.random((batch, 1)).astype(np.float32)}


# -- nothing unpickled --------------------------------------------------------------------------


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    torch = pytest.importorskip("torch")
    from slimml.convert.distill.distill import _load_checkpoint, _save_checkpoint

    marker = tmp_path / "ran"
    planted = tmp_path / ".m.distill-checkpoint.pt"
    torch.save({"fingerprint": "f", "x": _RunsCode(str(marker))}, planted)
    with pytest.raises(ConfigError) as e:
        _load_checkpoint(planted, "f", "c")
    assert not marker.exists(), "the planted pickle ran"
    assert str(e.value).startswith(f"the resume checkpoint {planted} cannot be read as one slimml wrote (")
    assert str(e.value).endswith("it was not loaded. Delete it to train from the start.") and "\n" not in str(e.value)

    # what slimml writes: tensors, optimizer and RNG state, a plan of plain values; 0600; it loads back
    state = {"fingerprint": "f", "teacher_cache": "c", "phase": "main", "step": 3, "plan": {"heads": {"0": [1, 2]}},
             "student": {"w": torch.ones(2)}, "optim": {"rng": torch.get_rng_state(), "precision": "fp32",
                                                        "sched": {"last_epoch": 3, "lr_lambdas": [None]}},
             "heldout_start": 1.5, "result": {"seconds": 0.5, "resumed_at": None}}
    path = tmp_path / "ck.pt"
    _save_checkpoint(path, state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _load_checkpoint(path, "f", "c")["plan"] == state["plan"]
    assert _load_checkpoint(path, "other", "c") is None  # another run's: start over
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


# -- the pre-packed cache -----------------------------------------------------------------------


def _entry(model, index):
    return model.plan.segments[-1].source.entries[index]


def test_a_tampered_cached_graph_or_data_file_is_refused_at_load_and_by_verify(mlp_artifact, tmp_path):
    cache = tmp_path / "cache"
    model = load(mlp_artifact, resident=2, cache_dir=cache)
    want = load(mlp_artifact).run(_feeds())["y"]
    np.testing.assert_allclose(model.run(_feeds())["y"], want, rtol=0, atol=1e-5)
    index = max(model.plan.segments[-1].source.entries)
    entry = _entry(model, index)
    assert stat.S_IMODE(entry.folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE((entry.folder / n).stat().st_mode) for n in ("shard.onnx", "shard.onnx.data", "packed.json")} == {0o600}
    model.verify()  # a clean cache passes

    # one Neg node appended to the cached graph: it would change every output, and nothing else differs
    graph = onnx.load_model(str(entry.graph), load_external_data=False)
    out = graph.graph.output[0]
    graph.graph.node.append(helper.make_node("Neg", [out.name], [out.name + "_neg"]))
    graph.graph.node[-2].output[list(graph.graph.node[-2].output).index(out.name)] = out.name + "_pre"
    graph.graph.node[-1].input[0] = out.name + "_pre"
    graph.graph.node[-1].output[0] = out.name
    saved = entry.graph.read_bytes()
    entry.graph.write_bytes(graph.SerializeToString())
    with pytest.raises(IntegrityError) as e:
        model.verify()
    assert str(e.value) == (f"the cache entry {entry.folder} is damaged: shard.onnx does not match the hash recorded "
                            f"when it was written. Delete {entry.folder} (slimml rebuilds it) and load the model again.")
    with pytest.raises(IntegrityError, match="shard.onnx does not match"):
        load(mlp_artifact, resident=2, cache_dir=cache)
    with pytest.raises(IntegrityError, match="shard.onnx does not match"):
        load(mlp_artifact, resident=2, cache_dir=cache, verify=False)  # the cache is checked even then
    entry.graph.write_bytes(saved)

    raw = bytearray(entry.data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    entry.data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="shard.onnx.data does not match"):
        model.verify()
    with pytest.raises(IntegrityError, match="shard.onnx.data does not match"):
        load(mlp_artifact, resident=2, cache_dir=cache)
    shutil.rmtree(entry.folder)
    np.testing.assert_allclose(load(mlp_artifact, resident=2, cache_dir=cache).run(_feeds())["y"], want, rtol=0,
                               atol=1e-5)  # rebuilt


@pytest.mark.parametrize("record", [b"[]", b"{}", b"\xff\xfe", b'{"format": 2, "source": "s", "files": []}',
                                    b'{"format": 2, "source": "s", "files": {"shard.onnx": 1, "shard.onnx.data": 2}}',
                                    b"[" * 100_000, b"1e999999"])
def test_a_damaged_cache_record_of_any_shape_is_refused_naming_the_folder(mlp_artifact, tmp_path, record):
    cache = tmp_path / "cache"
    model = load(mlp_artifact, resident=2, cache_dir=cache)
    folder = _entry(model, max(model.plan.segments[-1].source.entries)).folder
    model.close()
    (folder / "packed.json").write_bytes(record)
    with pytest.raises(IntegrityError) as e:
        load(mlp_artifact, resident=2, cache_dir=cache)
    msg = str(e.value)
    assert msg.startswith(f"the cache entry {folder} is damaged: its record packed.json is unreadable (")
    assert msg.endswith(f"Delete {folder} (slimml rebuilds it) and load the model again.") and "\n" not in msg


def test_a_cache_folder_with_the_wrong_mode_or_owner_is_refused(mlp_artifact, tmp_path):
    cache = tmp_path / "cache"
    load(mlp_artifact, resident=2, cache_dir=cache).close()
    (cache / "packed").chmod(0o777)
    with pytest.raises(IntegrityError) as e:
        load(mlp_artifact, resident=2, cache_dir=cache)
    assert str(e.value) == (
        f"the cache folder {cache / 'packed'} is writable by others (mode 777); slimml will not trust files there: "
        "set SLIMML_CACHE_DIR (or cache_dir=) to a folder of your own, or fix it: "
        f"`chown $USER {cache / 'packed'}; chmod 700 {cache / 'packed'}`.")
    (cache / "packed").chmod(0o700)
    if os.geteuid() == 0:  # only root can give a folder away
        os.chown(cache, 65534, 65534)
        with pytest.raises(IntegrityError, match=r"^the cache folder .* is owned by another user \(uid 65534\)"):
            load(mlp_artifact, resident=2, cache_dir=cache)
        os.chown(cache, 0, 0)
    load(mlp_artifact, resident=2, cache_dir=cache).close()
    open_parent = tmp_path / "open"  # anyone may write here, and no sticky bit: the cache inside could be swapped
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(IntegrityError) as e:
        load(mlp_artifact, resident=2, cache_dir=open_parent / "cache")
    assert str(e.value) == (
        f"the cache folder {open_parent / 'cache'} is inside {open_parent}, which anyone can write to (mode 777, no sticky "
        "bit): they could swap the folder; slimml will not trust files there: set SLIMML_CACHE_DIR (or cache_dir=) to a "
        f"folder of your own, or `chmod +t {open_parent}` (as /tmp is).")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError) as e:
        load(mlp_artifact, resident=2, cache_dir=tmp_path / "afile")
    assert str(e.value) == (f"cache_dir={str(tmp_path / 'afile')!r} is a file, not a folder; give a folder (it is made "
                            "where missing) for slimml's pre-packed weights.")
    with pytest.raises(ConfigError, match=r"^cache_dir='' must be a folder path\.$"):
        load(mlp_artifact, resident=2, cache_dir="")  # not the working folder


# -- limits of one call -------------------------------------------------------------------------


def test_generate_is_bounded_before_any_pass(tiny_llama_past_artifact):
    model = load(tiny_llama_past_artifact)
    assert model.max_sequence_length == 128  # no position table, no tokenizer: the source's max_position_embeddings
    with pytest.raises(FeedError) as e:
        model.generate([[1] * 120], max_new_tokens=16)
    assert str(e.value) == ("a prompt of 120 tokens plus max_new_tokens=16 is more than this model's 128 positions; "
                            "shorten the prompt or ask for at most 8 new tokens.")
    with pytest.raises(FeedError, match=r"= 8320 is more than the limit of 8192 tokens a call; .*--max-batch-tokens"):
        model.generate([[1] * 64] * 128, max_new_tokens=1)
    for bad in (2**70, -1, 512):
        with pytest.raises(FeedError, match=rf"prompt 1 has token id {bad} at position 1, outside the model's vocabulary of 512"):
            model.generate([[1, 2], [3, bad]], max_new_tokens=1)
    with pytest.raises(FeedError, match="bad feeds: input 'input_ids' has sequence_length=200 .* at most 128 tokens"):
        model.run({"input_ids": np.ones((1, 200), np.int64), "attention_mask": np.ones((1, 200), np.int64),
                   "position_ids": np.arange(200)[None],
                   **{t.name: np.zeros([1, t.shape[1], 0, t.shape[3]], np.float32) for t in model.inputs
                      if t.name.startswith("past_key_values.")}})
    model.limits.max_batch_tokens = 16_384  # a caller with trusted input raises it
    assert len(model.generate([[1] * 64] * 128, max_new_tokens=1).tokens) == 128


def test_texts_are_cut_to_max_text_chars_before_tokenizing(tiny_bert_artifact):
    """A bound on what a call tokenizes, not on what the model reads: a cut that holds fewer tokens
    than the model reads is read on (four times as much a try), so the tokenizer's truncation decides."""
    model = load(tiny_bert_artifact)
    assert model.limits.max_text_chars == 16_384
    long = "word " * 100_000  # 500,000 characters
    whole = model.encode([long])
    model.limits.max_text_chars = 64
    np.testing.assert_allclose(model.encode([long]), whole, atol=1e-6)
    assert model.count_tokens([long]) == [model.manifest.tokenizer["max_length"]]


def test_a_pinned_manifest_or_the_drivers_refuses_any_other(mlp_artifact):
    """The one thing no hash vouches for is manifest.json; pinned, any other is refused (the message spoke
    of a driver and nodes only, to a user who had pinned it in one process)."""
    from slimml.runtime.artifact.manifest import read_manifest

    ok = read_manifest(mlp_artifact).sha256
    load(mlp_artifact, manifest_sha256=ok).close()
    with pytest.raises(IntegrityError) as e:
        load(mlp_artifact, manifest_sha256="0" * 64)
    assert str(e.value) == (f"the artifact {mlp_artifact} is not the one pinned: its manifest.json has sha256 {ok[:16]}..., "
                            "not the 0000000000000000... expected (manifest_sha256=, or the driver's on a cluster). Copy "
                            "the pinned artifact there again (on a cluster, the same artifact at the same path on every "
                            "node), or pin the new hash if you changed it.")


# -- atomic writers -----------------------------------------------------------------------------


def test_an_output_name_with_glob_characters_touches_no_other_artifact(tmp_path):
    from slimml.runtime.artifact.atomic import atomic_folder

    other = tmp_path / ".m1.slimml-old-999999999"  # another artifact's set-aside copy (`m1`), owner gone
    other.mkdir()
    (tmp_path / "m1").mkdir()
    with atomic_folder(tmp_path / "m[12]") as tmp:
        (tmp / "manifest.json").write_text("{}")
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o777 & ~_umask()
    assert other.is_dir(), "a glob over 'm[12]' matched m1's folder"
    assert (tmp_path / "m[12]" / "manifest.json").is_file()


def test_a_write_that_fails_leaves_no_folder_it_made_to_hold_the_artifact(tmp_path, monkeypatch):
    """A first convert interrupted (Ctrl-C, SIGTERM) left an empty ``artifacts/`` behind; a folder that was
    there before, or that another write filled meanwhile, stays."""
    from slimml.runtime.artifact.atomic import atomic_folder

    for out in (tmp_path / "artifacts" / "m", tmp_path / "a" / "b" / "c" / "m"):
        with pytest.raises(KeyboardInterrupt):
            with atomic_folder(out) as tmp:
                (tmp / "manifest.json").write_text("{}")
                raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "a").mkdir()
    with pytest.raises(RuntimeError):
        with atomic_folder(tmp_path / "a" / "b" / "m"):
            (tmp_path / "a" / "b" / "other").mkdir()  # another artifact written beside it meanwhile
            raise RuntimeError("failed")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "a/b/other"]
    (tmp_path / "far").mkdir()
    (tmp_path / "lnk").symlink_to(tmp_path / "far")
    with pytest.raises(RuntimeError):  # '..' after a link: the folder made is far/new, not ./new
        with atomic_folder(tmp_path / "lnk" / ".." / "far" / "new" / "m"):
            raise RuntimeError("failed")
    assert list((tmp_path / "far").iterdir()) == []
    import errno
    import tempfile

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", full)  # the temporary folder itself cannot be made
    with pytest.raises(SlimmlError, match="disk is full"):
        with atomic_folder(tmp_path / "x" / "y" / "m"):
            pass
    assert not (tmp_path / "x").exists()


def test_a_quantized_artifact_is_as_readable_as_its_source(mlp_artifact, tmp_path):
    """Every file of a quantized artifact gets the user's usual mode (before, ONNX's external data
    writer left the weights 0600: a service account could not load what another user quantized)."""
    from slimml.quantize import quantize
    from slimml.quantize.config import WeightOnlyConfig
    from slimml.runtime.artifact.manifest import read_manifest

    quantize(mlp_artifact, tmp_path / "q", WeightOnlyConfig(bits=8))
    modes = {f.path: stat.S_IMODE((tmp_path / "q" / f.path).stat().st_mode) for f in read_manifest(tmp_path / "q").files}
    assert any(p.endswith(".data") for p in modes) and set(modes.values()) == {0o666 & ~_umask()}, modes


def _umask() -> int:
    from slimml.runtime.artifact.replace import umask

    return umask()


def test_sizing_a_stale_folder_follows_no_link(tmp_path):
    from slimml.runtime.artifact.atomic import _folder_bytes, fresh_tmp

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 10_000)
    stale = tmp_path / ".art.slimml-tmp-999999999"
    stale.mkdir()
    (stale / "a").write_bytes(b"y" * 10)
    (stale / "link").symlink_to(outside, target_is_directory=True)
    (stale / "loop").symlink_to(stale, target_is_directory=True)
    assert _folder_bytes(stale) == 10
    fresh_tmp(tmp_path / "art")
    assert not stale.exists() and (outside / "big").stat().st_size == 10_000  # removed the link, not its target


def test_a_killed_convert_still_a_zombie_counts_as_gone(tmp_path):
    from slimml.runtime.artifact.atomic import _alive, fresh_tmp

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / f".art.slimml-tmp-{child.pid}").mkdir()
    child.kill()
    deadline = time.monotonic() + 10
    while True:  # killed, not yet reaped: a zombie
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not _alive(child.pid)
    made = fresh_tmp(tmp_path / "art")
    assert [p.name for p in tmp_path.iterdir()] == [made.name]
    child.wait()


def test_small_writers_use_names_no_one_planted(tmp_path):
    from slimml.runtime.artifact.replace import replace_file

    target = tmp_path / "baseline.json"
    decoy = tmp_path / "elsewhere"
    decoy.write_text("keep")
    (tmp_path / f".{target.name}.tmp-{os.getpid()}").symlink_to(decoy)  # the name the old writer used
    (tmp_path / "manifest.json.tmp").symlink_to(decoy)
    replace_file(target, "{}")
    from slimml.runtime.artifact.manifest import Manifest

    Manifest(name="x", task="t", source={}, steps=[], inputs=[], outputs=[], shards=[], files=[]).write(tmp_path)
    assert decoy.read_text() == "keep" and target.read_text() == "{}"
    assert stat.S_IMODE(replace_file(tmp_path / "secret", b"s", mode=0o600).stat().st_mode) == 0o600


def test_a_file_swapped_between_its_hash_and_the_session_is_refused(mlp_artifact, tmp_path):
    from slimml.runtime.artifact.files import check_unchanged, verify_files
    from slimml.runtime.artifact.manifest import read_manifest

    art = tmp_path / "art"
    shutil.copytree(mlp_artifact, art)
    seen = verify_files(art, read_manifest(art))  # identities of the very files hashed
    check_unchanged(art, seen)
    data = next(p for p in art.glob("*.onnx.data"))
    swap = data.with_name("swap")
    shutil.copy2(data, swap)
    os.replace(swap, data)  # same bytes, same mtime: another file all the same
    with pytest.raises(IntegrityError) as e:
        check_unchanged(art, seen)
    assert str(e.value).startswith(f"{data.name} in the artifact {art} was replaced while the model loaded")


def test_a_decoders_attention_mask_must_cover_the_past_and_the_new_tokens(tiny_llama_past_artifact):
    model = load(tiny_llama_past_artifact)

    def feeds(mask: int, past: int = 2, seq: int = 3) -> dict:
        out = {}
        for spec in model.inputs:
            if spec.name.startswith("past_key_values"):
                shape = [1 if d == "batch_size" else past if d == "past_sequence_length" else d for d in spec.shape]
                out[spec.name] = np.zeros(shape, np.float32)
        out.update(input_ids=np.ones((1, seq), np.int64), attention_mask=np.ones((1, mask), np.int64),
                   position_ids=np.arange(past, past + seq, dtype=np.int64)[None])
        return {k: v for k, v in out.items() if k in {s.name for s in model.inputs}}

    assert model.run(feeds(5))["logits"].shape[:2] == (1, 3)
    for wrong in (4, 9):
        with pytest.raises(FeedError) as e:
            model.run(feeds(wrong))
        assert str(e.value) == (f"bad feeds: input 'attention_mask' has past_sequence_length + sequence_length={wrong}, but "
                                "past_sequence_length=2 + sequence_length=3 is 5; give it that length (a decoder's "
                                "attention_mask covers the past and the new tokens).")


def test_a_folder_written_after_the_command_was_asked_to_stop_is_never_swapped_in(tmp_path, monkeypatch):
    """A SIGINT/SIGTERM that lands in a __del__ raises there, where Python drops it and the convert
    went on to ship its artifact (2 times in 7 at 6 s into a tiny BERT's convert); the CLI's handlers
    record the signal, and the swap refuses."""
    from slimml.runtime.artifact import atomic

    monkeypatch.setattr(atomic, "_stop_asked", [])
    with atomic.atomic_folder(tmp_path / "kept") as tmp:
        (tmp / "manifest.json").write_text("{}")
    atomic.stop_asked(15)
    with pytest.raises(SystemExit) as e:
        with atomic.atomic_folder(tmp_path / "out") as tmp:
            (tmp / "manifest.json").write_text("{}")
    assert e.value.code == 143 and not (tmp_path / "out").exists() and (tmp_path / "kept").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # and no temporary folder left


def test_a_manifest_number_of_thousands_of_digits_and_a_tokenizer_that_panics_are_one_line(tiny_bert_artifact, tmp_path):
    """json refuses integers of more than 4,300 digits with a ValueError, and the tokenizers library
    panics (a BaseException) on a regex that gives up: each is now one slimml error, not a traceback."""
    import json

    from slimml.errors import ArtifactError
    from slimml.runtime.artifact.files import file_entry
    from slimml.runtime.artifact.manifest import read_manifest

    art = tmp_path / "a"
    shutil.copytree(tiny_bert_artifact, art)
    raw = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(raw.replace('"format_version": 1', '"format_version": ' + "9" * 5000, 1))
    with pytest.raises(ArtifactError, match=r"manifest.json is not valid JSON \(a number too long to read\)"):
        load(art)
    (art / "manifest.json").write_text(raw)
    tok = json.loads((art / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|a)+$"}, "behavior": "Isolated", "invert": False}
    (art / "tokenizer.json").write_text(json.dumps(tok))
    manifest = read_manifest(art)
    manifest.files = [file_entry(art, art / "tokenizer.json") if f.path == "tokenizer.json" else f for f in manifest.files]
    manifest.write(art)
    model = load(art)
    with pytest.raises(FeedError, match=r"the artifact's tokenizer failed on this text \(.*\); change or shorten the text"):
        model.encode(["a" * 40 + "b"])
    assert model.encode(["fine"]).shape[0] == 1  # the model goes on


def test_quantize_checks_its_source_as_load_does_and_never_launders_a_swapped_file(mlp_artifact, tmp_path, monkeypatch):
    """quantize confines each shard's external data as load does (was: the installed onnx's own checker
    only, as a traceback), names hard-linked data files, and discards its output when a source file was
    swapped while it read it (was: quantized and given fresh, valid hashes)."""
    import slimml.quantize.api as api
    from slimml.errors import ArtifactError
    from slimml.quantize import quantize
    from slimml.quantize.config import WeightOnlyConfig
    from slimml.runtime.artifact.manifest import read_manifest

    linked = tmp_path / "linked"
    shutil.copytree(mlp_artifact, linked, copy_function=os.link)
    with pytest.raises(ArtifactError, match=r"has several hard links, and onnx will not read weights through one"):
        quantize(linked, tmp_path / "q1", WeightOnlyConfig(bits=8))
    src = tmp_path / "src"
    shutil.copytree(mlp_artifact, src)
    data = next(f.path for f in read_manifest(src).files if f.path.endswith(".data"))
    real = api._quantize_artifact

    def swap_then_quantize(*args, **kwargs):  # the file replaced after its hash, before it is read
        (src / "new").write_bytes((src / data).read_bytes())
        os.replace(src / "new", src / data)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_quantize_artifact", swap_then_quantize)
    with pytest.raises(IntegrityError, match=rf"{data} in the artifact .* was replaced while it was quantized .*; the "
                                             "output is discarded"):
        quantize(src, tmp_path / "q2", WeightOnlyConfig(bits=8))
    assert not (tmp_path / "q2").exists() and not list(tmp_path.glob(".q2*"))


def test_a_shard_graph_that_is_not_what_its_manifest_lists_is_refused_at_load(mlp_artifact, tmp_path):
    """A graph swapped under honest hashes: another output dtype (encode gave garbage), an input the
    manifest does not list (a FeedError blaming the caller's feeds) or an output of another rank or
    size is refused when the model loads."""
    from slimml.errors import ArtifactError
    from slimml.runtime.artifact.files import file_entry
    from slimml.runtime.artifact.manifest import read_manifest

    for change, words in (("dtype", "holds '.*' in another dtype"), ("input", "takes 'extra', which its manifest entry"),
                          ("rank", "holds '.*' in another shape"), ("size", "holds '.*' in another shape")):
        art = tmp_path / change
        shutil.copytree(mlp_artifact, art)
        manifest = read_manifest(art)
        shard = manifest.shards[0]
        model = onnx.load(str(art / shard.file), load_external_data=False)
        dims = model.graph.output[0].type.tensor_type.shape.dim
        if change == "dtype":
            model.graph.output[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
        elif change == "rank":
            dims.add().dim_value = 7
        elif change == "size":
            listed = next(t.shape for t in shard.outputs if t.name == model.graph.output[0].name)
            at = next(i for i, n in enumerate(listed) if isinstance(n, int))
            dims[at].dim_value = listed[at] + 1
        else:
            model.graph.input.append(helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, [1]))
        onnx.save(model, str(art / shard.file))
        manifest.files = [file_entry(art, art / shard.file) if f.path == shard.file else f for f in manifest.files]
        manifest.write(art)
        with pytest.raises(ArtifactError, match=rf"{shard.file}'s graph {words}.*; the artifact is damaged or was tampered"):
            load(art)
