"""Integrity and security of artifacts: hashes, paths that escape, external data, versions, no code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from slimml.errors import ArtifactError, IntegrityError
from slimml.runtime import load
from slimml.runtime.artifact.files import sha256_file
from slimml.runtime.artifact.manifest import MANIFEST_NAME, read_manifest
from conftest import tiny_onnx_mlp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def art(tmp_path) -> Path:
    from slimml.convert import ConvertConfig, convert

    out = tmp_path / "art"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx", hidden=64), out, ConvertConfig(measure_latency=False))
    return out


def edit(folder: Path, change) -> None:
    m = json.loads((folder / MANIFEST_NAME).read_text())
    change(m)
    (folder / MANIFEST_NAME).write_text(json.dumps(m))


def rehash(folder: Path, rel: str) -> None:
    def change(m):
        for f in m["files"]:
            if f["path"] == rel:
                f["bytes"], f["sha256"] = (folder / rel).stat().st_size, sha256_file(folder / rel)
    edit(folder, change)


def test_every_shard_file_is_listed_with_size_and_hash(art):
    m = read_manifest(art)
    listed = {f.path: f for f in m.files}
    for s in m.shards:
        for rel in filter(None, (s.file, s.data)):
            assert listed[rel].bytes == (art / rel).stat().st_size and listed[rel].sha256 == sha256_file(art / rel)
    on_disk = {p.name for p in art.iterdir()} - {MANIFEST_NAME}
    assert on_disk == set(listed)


def test_tokenizer_is_listed_and_verified(tiny_bert_artifact, tmp_path):
    folder = tmp_path / "bert"
    shutil.copytree(tiny_bert_artifact, folder)
    assert "tokenizer.json" in {f.path for f in read_manifest(folder).files}
    with open(folder / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(IntegrityError, match=r"^tokenizer.json is \d+ bytes but the manifest records \d+"):
        load(folder)


def test_tampered_and_truncated_files(art):
    data = art / "shard_001.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[100] ^= 1
    data.write_bytes(bytes(blob))
    with pytest.raises(IntegrityError) as e:
        load(art)
    assert str(e.value) == (
        "shard_001.onnx.data does not match its sha256 in the manifest: the file is corrupted or was tampered "
        "with. Copy the artifact again or re-convert; slimml will not run it."
    )
    data.write_bytes(bytes(blob[:50]))
    with pytest.raises(IntegrityError, match="is 50 bytes but the manifest records 16384: the file is truncated"):
        load(art)
    data.unlink()
    with pytest.raises(IntegrityError, match="shard_001.onnx.data is missing from the artifact"):
        load(art)


@pytest.mark.parametrize("rel", ["../outside.onnx", "/etc/passwd", "a/../../x", "..\\x", "~/x"])
def test_manifest_paths_that_escape_are_refused(art, rel):
    edit(art, lambda m: m["files"][0].update(path=rel))
    with pytest.raises(ArtifactError) as e:
        load(art)
    assert str(e.value) == (f"the manifest names the path {rel!r}, which leaves the artifact folder; refusing to load it. "
                            "Copy the artifact again from where it was made, or convert the model again.")


def test_symlinks_out_are_refused(art, tmp_path):
    outside = tmp_path / "outside.data"
    shutil.copy(art / "shard_000.onnx.data", outside)  # same bytes, so the hash would even match
    (art / "shard_000.onnx.data").unlink()
    (art / "shard_000.onnx.data").symlink_to(outside)
    with pytest.raises(ArtifactError, match=r"^'shard_000.onnx.data' is a link that points outside the artifact folder"
                                            r".* \(`cp -rL .* NEW_FOLDER`; a Hugging Face hub snapshot: "):
        load(art)
    (art / "shard_000.onnx.data").unlink()
    shutil.copy(outside, art / "shard_000.onnx.data")
    load(art)  # a link inside the folder is fine; the real file back in place loads
    real = tmp_path / "elsewhere.json"
    shutil.move(art / MANIFEST_NAME, real)
    (art / MANIFEST_NAME).symlink_to(real)
    with pytest.raises(ArtifactError, match="'manifest.json' is a link that points outside"):
        load(art)


def _point_external_data(art: Path, shard: int, location: str, offset: int | None = None) -> None:
    path = art / f"shard_{shard:03d}.onnx"
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
            if e.key == "offset" and offset is not None:
                e.value = str(offset)
    path.write_bytes(model.SerializeToString())
    rehash(art, path.name)  # an honest-looking manifest: only the ONNX file's own pointer is hostile


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/hostname", "shard_001.onnx.data", "sub/../../secret.bin"])
def test_external_data_must_stay_in_the_shards_own_file(art, tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(b"\0" * 20000)
    _point_external_data(art, 0, location)
    with pytest.raises(ArtifactError) as e:
        load(art)
    assert str(e.value).startswith(f"shard_000.onnx: weight 'layers.0.w' reads its data from {location!r}, which is not "
                                   "the shard's own data file 'shard_000.onnx.data'; refusing to load it")


def test_external_data_past_the_end_is_refused(art):
    _point_external_data(art, 0, "shard_000.onnx.data", offset=16000)
    with pytest.raises(ArtifactError, match=r"reads bytes 16000\.\.32384 of shard_000.onnx.data, which has 16384"):
        load(art)


def test_external_data_refused_even_without_verify(art):
    _point_external_data(art, 0, "../secret.bin")
    with pytest.raises(ArtifactError, match="refusing to load it"):
        load(art, verify=False)  # opting out of hashing does not open the folder's walls


@pytest.mark.parametrize("version", [0, 5, "1", None, 1.5])
def test_unknown_format_version_is_refused_naming_it(art, version):
    edit(art, lambda m: m.update(format_version=version))
    with pytest.raises(ArtifactError) as e:
        load(art)
    assert f"has manifest format version {version!r}, but this slimml reads versions 1, 2, 3 and 4" in str(e.value)


def test_a_required_field_this_slimml_does_not_apply_is_refused_naming_it(art):
    """Format 4's ``requires``: a newer record an older reader would skip (and run the model otherwise)
    is named in the manifest, and a reader that does not apply it refuses the artifact."""
    edit(art, lambda m: m.update(format_version=4, requires=["seq2seq.search", "pooling.colbert"], slimml_version="0.9.0"))
    with pytest.raises(ArtifactError, match=r"manifest.json needs pooling.colbert, which this slimml does not apply, so it "
                                            r"would run the model otherwise; install the slimml that wrote it \(0.9.0\) "
                                            r"or newer\.$"):
        load(art)
    edit(art, lambda m: m.update(format_version=3, requires=["seq2seq.search"]))
    with pytest.raises(ArtifactError, match="is malformed: requires needs format_version 4"):
        load(art)
    edit(art, lambda m: m.update(format_version=4, requires=[{"a": 1}, ["x"]]))  # was Python's "unhashable type"
    with pytest.raises(ArtifactError, match="is malformed: requires must be a list of names"):
        load(art)


def test_malformed_manifest_lists_every_problem(art):
    def change(m):
        m["inputs"][0]["dtype"] = "object"
        m["shards"][1]["index"] = 7
        m["files"][0]["sha256"] = "xyz"
    edit(art, change)
    with pytest.raises(ArtifactError) as e:
        load(art)
    msg = str(e.value)
    assert "inputs[0].dtype is 'object', not one of" in msg
    assert "shards[1].index must be 1 (shards are listed in order)" in msg
    assert "files[0].sha256 must be 64 hex digits" in msg


def test_special_files_never_block(art):
    """A pipe where a shard should be is refused at once instead of blocking a read forever."""
    data = art / "shard_002.onnx.data"
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(IntegrityError, match="is not a regular file"):
        load(art)


def test_loading_runs_no_code_from_the_artifact():
    """No pickle, eval or torch.load anywhere in the runtime; npz inputs are read with allow_pickle=False."""
    sources = [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "slimml" / "cli").glob("*.py"), *(ROOT / "slimml" / "serve").glob("*.py")]
    assert len(sources) > 100
    banned = re.compile(r"\bpickle\b|allow_pickle\s*=\s*True|\beval\(|\bexec\(|torch\.load|marshal|__import__")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
            if banned.search(line) and not line.lstrip().startswith("#")]
    assert hits == []


def test_runtime_imports_stay_lean(art):
    code = ("import sys; from slimml.runtime import load; m = load(sys.argv[1]); "
            "bad = [x for x in ('torch', 'transformers', 'nncf', 'optimum') if x in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_damaged_names_are_refused_before_onnxruntime(art, capfd):
    """A name that is not UTF-8 made ORT's Python wrapper print 'EP Error' to stdout; refused first now."""
    path = art / "shard_001.onnx"
    blob = bytearray(path.read_bytes())
    blob[blob.find(b"MatMul") + 1] = 0x9E
    path.write_bytes(bytes(blob))
    rehash(art, path.name)
    with pytest.raises(ArtifactError) as e:
        load(art)
    assert str(e.value) == "shard_001.onnx holds a 'name' that is not valid UTF-8; the file is damaged: re-convert it."
    out, err = capfd.readouterr()
    assert "EP Error" not in out + err


def test_verify_shard_before_a_session_is_recreated(art):
    """The check a lazily (re)loaded shard goes through: hash, then external data."""
    from slimml.runtime.artifact.integrity import verify_shard

    m = read_manifest(art)
    assert verify_shard(art, m, m.shards[2]).external_tensors == 1  # the 64x64 weight; the bias is inline
    with open(art / "shard_002.onnx.data", "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(IntegrityError, match="shard_002.onnx.data does not match its sha256"):
        verify_shard(art, m, m.shards[2])
    verify_shard(art, m, m.shards[1])  # the others are untouched


def test_manifest_bombs(art):
    path = art / MANIFEST_NAME
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ArtifactError, match="is not valid JSON \\(nested too deeply\\)"):
        load(art)
    with open(path, "wb") as f:
        f.truncate(65 << 20)  # sparse: 65 MB of zeros
    with pytest.raises(ArtifactError, match="far more than any slimml manifest"):
        load(art)
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ArtifactError, match="is not valid JSON"):
        load(art)


def test_link_loops_are_refused(art):
    (art / "loop").symlink_to(art / "loop")
    edit(art, lambda m: m["files"][0].update(path="loop"))
    with pytest.raises(ArtifactError, match="refusing to load it"):
        load(art)


def test_cli_turns_hostile_artifacts_into_one_line(art):
    edit(art, lambda m: m["files"][0].update(path="../../etc/passwd"))
    for args in (["info", str(art)], ["run", str(art), "--input", str(art / "x.npz")], ["bench", str(art)]):
        r = subprocess.run([sys.executable, "-m", "slimml", *args], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 1
        assert r.stderr.strip() == ("error: the manifest names the path '../../etc/passwd', which leaves the artifact "
                                    "folder; refusing to load it. Copy the artifact again from where it was made, or "
                                    "convert the model again.")


def test_cli_refuses_hostile_npz_inputs(art, tmp_path):
    import numpy as np

    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}], dtype=object))  # would need pickle to load
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04garbage")
    np.save(tmp_path / "one.npy", np.ones(3))
    for name, why in [("obj.npz", "object arrays, which slimml never unpickles"),
                      ("bad.npz", "BadZipFile"), ("one.npy", "a single .npy array, not named arrays")]:
        r = subprocess.run([sys.executable, "-m", "slimml", "run", str(art), "--input", str(tmp_path / name)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 1 and r.stderr.startswith(f"error: --input {tmp_path / name} is not an .npz of plain arrays")
        assert why in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("how", ["renamed over", "removed", "rewritten in place", "unrelated file added"])
def test_the_file_watch_sees_the_folder_as_well_as_the_files(art, how):
    """A streamed model reads its shards by path as it runs. The watch holds each data file and its
    folder open: a file renamed over keeps its old descriptor valid, so the folder's change sends
    the check to the paths."""
    from slimml.runtime.tools.bench import sample_feeds

    model = load(art, resident=1, pack=False)
    assert model.plan.streaming
    feeds = sample_feeds(model.inputs, batch=1)
    before = model.run(feeds)
    data = art / "shard_001.onnx.data"
    if how == "renamed over":
        twin = art / "twin.tmp"
        twin.write_bytes(data.read_bytes())  # the same bytes, a new file
        os.replace(twin, data)
    elif how == "removed":
        data.unlink()
    elif how == "rewritten in place":
        body = data.read_bytes()
        with open(data, "r+b") as f:
            f.write(body[:8][::-1])
        os.utime(data, ns=(os.stat(data).st_atime_ns, os.stat(data).st_mtime_ns + 1_000_000))
    else:
        (art / "notes.txt").write_text("not part of the model")
        assert model.run(feeds)["y"].tolist() == before["y"].tolist()  # still the same files: runs
        model.close()
        return
    with pytest.raises(IntegrityError, match=r"shard_001\.onnx\.data in .* (was rewritten|was removed) .*A streamed "
                                             r"model reads its shards from the folder as it runs"):
        model.run(feeds)
    with pytest.raises(IntegrityError):  # and every later call, until loaded again
        model.run(feeds)
    model.close()


@pytest.mark.parametrize("how", ["folders swapped", "renamed over", "removed"])
def test_a_resident_model_runs_on_when_its_artifact_is_swapped(tiny_bert_artifact, tmp_path, how):
    """The way to replace an artifact slimml gives (write a new folder, rename it into place) made a
    loaded, fully resident model refuse every later call, though no byte it maps had changed: its
    weights are in memory or mapped from files that live on while mapped. It runs on as loaded
    (encode's lanes included: no session is made from the new folder); a write in place is still refused."""
    live = tmp_path / "model"
    shutil.copytree(tiny_bert_artifact, live)
    model = load(live)
    texts = [f"sentence number {i} about swapping models" for i in range(40)]
    before = model.encode(texts, workers=1)
    data = max(live.glob("*.data"), key=lambda f: f.stat().st_size)
    if how == "folders swapped":
        shutil.copytree(tiny_bert_artifact, tmp_path / "model.new")
        os.rename(live, tmp_path / "model.old")
        os.rename(tmp_path / "model.new", live)
        shutil.rmtree(tmp_path / "model.old")
    elif how == "renamed over":
        twin = live / "twin.tmp"
        twin.write_bytes(data.read_bytes()[::-1])  # other bytes: a model a new session would have run
        os.replace(twin, data)
    else:
        data.unlink()
    model.check_files()
    assert model.encode(texts, workers=1).tolist() == before.tolist()
    assert np.allclose(model.encode(texts, workers=2), before, atol=1e-6)  # lanes: on the loaded plan
    model.close()
    # written through a shared map (no inotify event) with its times put back, then unlinked (as a
    # swap's removal of the old folder would): the change time alone moved, and the link count; the
    # held file's bytes are hashed before it is let through
    import mmap

    shutil.copytree(tiny_bert_artifact, tmp_path / "tampered")
    model = load(tmp_path / "tampered")
    model.encode(texts)
    data = max((tmp_path / "tampered").glob("*.data"), key=lambda f: f.stat().st_size)
    st = os.stat(data)
    with open(data, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[:8] = bytes(m[:8])[::-1]
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    data.unlink()
    with pytest.raises(IntegrityError, match=r"was rewritten in place \(its size and times put back\)"):
        model.encode(texts)
    model.close()
    shutil.copytree(tiny_bert_artifact, tmp_path / "again")
    model = load(tmp_path / "again")
    model.encode(texts)
    data = max((tmp_path / "again").glob("*.data"), key=lambda f: f.stat().st_size)
    with open(data, "r+b") as f:
        f.write(data.read_bytes()[:8][::-1])
    with pytest.raises(IntegrityError, match=r"was rewritten.*Restore the artifact"):
        model.encode(texts)
    model.close()


def _rewrite_keeping_times(path: Path) -> None:
    st = os.stat(path)
    body = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(body[:8][::-1])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_watch_sees_a_rewrite_that_keeps_the_files_times(art):
    """On Linux the kernel reports the write itself (inotify), so a file rewritten in place is
    refused even when its size and times are put back."""
    from slimml.runtime.tools.bench import sample_feeds

    model = load(art)
    if model._watch.how != "inotify":
        model.close()
        pytest.skip("no inotify here: the watch compares sizes and times")
    feeds = sample_feeds(model.inputs, batch=1)
    model.run(feeds)
    _rewrite_keeping_times(art / "shard_001.onnx.data")
    with pytest.raises(IntegrityError, match=r"shard_001\.onnx\.data in .* was rewritten in place \(its size and times put back\)"):
        model.run(feeds)
    model.close()


def test_the_watch_backstop_catches_what_the_kernel_did_not_report(art):
    """Writes through a shared memory map raise no inotify event; every BACKSTOP checks the
    watch also compares sizes and times. Simulated by taking the events out of the queue."""
    from slimml.runtime.tools.bench import sample_feeds
    from slimml.runtime.artifact.watch import BACKSTOP

    model = load(art)
    watch = model._watch
    if watch.how != "inotify":
        model.close()
        pytest.skip("no inotify here: every check compares sizes and times")
    feeds = sample_feeds(model.inputs, batch=1)
    data = art / "shard_001.onnx.data"
    with open(data, "r+b") as f:
        f.write(data.read_bytes()[:8][::-1])
    os.utime(data, ns=(os.stat(data).st_atime_ns, os.stat(data).st_mtime_ns + 1_000_000))
    watch._notify.read()  # the kernel's events, lost
    with pytest.raises(IntegrityError, match=r"shard_001\.onnx\.data in .* was rewritten or replaced"):
        for _ in range(BACKSTOP + 1):
            model.run(feeds)
    model.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_leaves_the_parents_inotify_queue_alone(art):
    """Parent and child would share one inotify queue (whoever reads an event takes it), so the
    child checks with fstat; the parent keeps its queue and still sees a change."""
    model = load(art)
    if model._watch.how != "inotify":
        model.close()
        pytest.skip("no inotify here")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report how it watches
        os.write(write, model._watch.how.encode())
        os._exit(0)
    os.close(write)
    how = os.read(read, 100).decode().strip()
    os.waitpid(pid, 0)
    os.close(read)
    assert how == "fstat" and model._watch.how == "inotify"
    _rewrite_keeping_times(art / "shard_001.onnx.data")
    with pytest.raises(IntegrityError):
        model.check_files()
    model.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_while_a_thread_holds_the_watch_runs(art):
    """The watch's lock, held by a parent thread at the fork, was held forever in the child: its first
    call hung."""
    from slimml.runtime.tools.bench import sample_feeds

    model = load(art)
    feeds = sample_feeds(model.inputs, batch=1)
    with model._watch._lock:  # as a parent thread checking the files at that instant
        pid = os.fork()
        if pid == 0:
            signal = __import__("signal")
            signal.alarm(20)
            try:
                model.run(feeds)
                model.check_files()
                os._exit(0)
            except BaseException:
                os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    model.close()


@pytest.mark.parametrize("resident", [None, 2])
def test_a_write_through_a_shared_map_with_its_mtime_put_back_is_refused(art, resident):
    """A shared-mmap write raises no inotify event, and ``utime`` put the mtime back: size, mtime
    and inode matched, so the model ran the changed weights on every later call. The change time
    (which no caller can set) gives it away."""
    import mmap

    from slimml.runtime.tools.bench import sample_feeds

    model = load(art, resident=resident, pack=False)
    feeds = sample_feeds(model.inputs, batch=1)
    model.run(feeds)
    data = art / "shard_001.onnx.data"
    st = os.stat(data)
    time.sleep(0.01)
    with open(data, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[:8] = bytes(m[:8])[::-1]
        m.flush()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(data).st_mtime_ns == st.st_mtime_ns and os.stat(data).st_size == st.st_size
    time.sleep(1.1)  # the watch's time backstop, were the kernel's attribute event lost too
    with pytest.raises(IntegrityError, match=r"shard_001\.onnx\.data"):
        model.run(feeds)
    model.close()


def test_many_models_leave_the_application_file_descriptors(art):
    """Each model's watch held a descriptor per data file and folder, and an inotify queue: 200 small
    models under the usual limit of 1,024 left the application none for its own files."""
    script = (
        "import os, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from slimml.runtime import load\n"
        "models = [load(sys.argv[1]) for _ in range(150)]\n"
        "files = [open(os.devnull) for _ in range(64)]\n"
        "print(sorted({m._engines[0]._watch.how for m in models}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(art)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stat" in r.stdout, r.stdout  # past half the limit, the later models' watches stat the paths
    # such a watch cannot follow the files it loaded through a swap: it refuses, and says why
    live = art.parent / "live"
    shutil.copytree(art, live)
    script = (
        "import os, resource, shutil, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "held = [open(os.devnull) for _ in range(40)]\n"
        "from slimml.runtime import load\n"
        "from slimml.runtime.tools.bench import sample_feeds\n"
        "live = sys.argv[1]\n"
        "model = load(live)\n"
        "print(model._engines[0]._watch.how)\n"
        "feeds = sample_feeds(model.inputs, batch=1)\n"
        "os.rename(live, live + '.old'); shutil.copytree(live + '.old', live)\n"
        "try:\n"
        "    model.run(feeds)\n"
        "except Exception as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(live)], capture_output=True, text=True, timeout=300)
    assert r.stdout.startswith("stat") and "loaded past half the process's open-file limit" in r.stdout, (r.stdout, r.stderr)
