"""Faults: a convert killed at random points, a full disk, an unwritable output, files damaged after load.

Each fault happens to a real ``slimml`` in a child process (a kill, a file-size limit, a tiny
tmpfs), so a crash or a lost artifact shows up as what it is.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slimml.runtime import load
from slimml.runtime.artifact.manifest import MANIFEST_NAME
from conftest import tiny_onnx_mlp

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}

# A child that imports slimml, says READY, waits for a line on stdin, then converts.
CONVERT_CHILD = textwrap.dedent("""
    import sys, time
    from slimml.convert import ConvertConfig, convert
    print("READY", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    convert(sys.argv[1], sys.argv[2], ConvertConfig(measure_latency=False))
    print(f"DONE {time.perf_counter() - t0:.3f}", flush=True)
""")


def start_convert(src: Path, out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CONVERT_CHILD, str(src), str(out)], env=ENV, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == "READY", p.stderr.read()
    return p


def state(out: Path) -> str | None:
    """The artifact's manifest text when ``out`` holds a whole, verified artifact; None when absent."""
    if not out.exists():
        return None
    load(out)  # raises if anything in it is missing, truncated or not what the manifest says
    return (out / MANIFEST_NAME).read_text()


def test_killed_convert_never_loses_the_artifact(tmp_path):
    """SIGKILL at random instants of a convert: ``out`` always holds the previous artifact or the new one, whole."""
    src = tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=8, hidden=256)
    out = tmp_path / "art"
    p = start_convert(src, out)  # a first, complete run: the artifact to protect, and the time a run takes
    p.stdin.write("go\n")
    p.stdin.flush()
    took = float(p.stdout.readline().split()[1])
    assert p.wait() == 0
    previous = state(out)
    rng = random.Random(0)
    outcomes = []
    for i in range(8):
        if i % 4 == 3:  # now and then, a kill with no previous artifact at all
            shutil.rmtree(out, ignore_errors=True)
            previous = None
        p = start_convert(src, out)
        delay = rng.uniform(0, took * 1.6)  # most inside the convert, a few after it
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close(), p.stderr.close(), p.stdin.close()
        now = state(out)
        # the old artifact, or (when there was none) nothing or a complete new one
        assert now == previous or (now is not None and json.loads(now)["name"] == "mlp")
        outcomes.append("previous" if now == previous else "new")
        previous = now
    # the next convert cleans what the killed ones left beside the output
    p = start_convert(src, out)
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.wait() == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["art", "mlp.onnx"]
    print(f"killed converts: {len(outcomes)}, artifacts lost: 0 ({outcomes})")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_ends_a_convert_leaving_nothing(tmp_path, sig):
    """SIGTERM (a job runner's stop, `timeout`) unwinds a CLI convert as Ctrl-C does: exit 143 (130), no
    half-written folder beside the output (before, a hidden .slimml-tmp-* stayed until the next convert),
    and a last line that says so (it ended in silence)."""
    from slimml.convert.sources import default_model_dir

    p = subprocess.Popen([sys.executable, "-m", "slimml", "convert", str(default_model_dir()), "-o", str(tmp_path / "art")],
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".art.slimml-tmp-*")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the half-written folder exists
    assert p.poll() is None, p.stderr.read()
    p.send_signal(sig)
    assert p.wait(timeout=120) == 128 + sig
    said = p.stderr.read()
    p.stderr.close()
    assert said.strip().splitlines()[-1] == f"stopped ({signal.Signals(sig).name}); nothing half-written is left.", said
    assert list(tmp_path.iterdir()) == []


def test_kill_right_after_the_swap(tmp_path):
    """The riskiest instant: the new artifact just moved into place, the old one not yet deleted."""
    src = tiny_onnx_mlp(tmp_path / "mlp.onnx")
    out = tmp_path / "art"
    script = textwrap.dedent(f"""
        import os, signal
        import slimml.runtime.artifact.atomic as pl
        from slimml.convert import ConvertConfig, convert
        convert({str(src)!r}, {str(out)!r}, ConvertConfig(measure_latency=False))
        swap = pl._exchange
        def swap_then_die(a, b):  # fault injection: die the instant after the swap, before any cleanup
            swap(a, b)
            os.kill(os.getpid(), signal.SIGKILL)
        pl._exchange = swap_then_die
        convert({str(src)!r}, {str(out)!r}, ConvertConfig(measure_latency=False))
    """)
    r = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert state(out) is not None
    from slimml.convert import ConvertConfig, convert

    convert(src, out, ConvertConfig(measure_latency=False))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["art", "mlp.onnx"]


def test_previous_artifact_set_aside_is_restored(tmp_path):
    """Where the atomic swap is not available, a kill between the two renames leaves the old artifact
    at .NAME.slimml-old-PID; the next convert puts it back before anything else."""
    from slimml.convert import ConvertConfig, convert

    src = tiny_onnx_mlp(tmp_path / "mlp.onnx")
    out = tmp_path / "art"
    convert(src, out, ConvertConfig(measure_latency=False))
    before = state(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    os.rename(out, tmp_path / f".art.slimml-old-{dead.stdout.strip()}")
    from slimml.runtime.artifact.atomic import fresh_tmp

    tmp = fresh_tmp(out)
    assert state(out) == before
    shutil.rmtree(tmp)


FULL_DISK_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from slimml.convert import ConvertConfig, convert
    from slimml.errors import SlimmlError
    if sys.argv[3] != "0":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
    try:
        convert(sys.argv[1], sys.argv[2], ConvertConfig(measure_latency=False))
    except SlimmlError as e:
        print(f"SLIMML {type(e).__name__}: {e}")
        sys.exit(1)
    print("OK")
""")


def test_file_size_limit_gives_a_clear_error(tmp_path):
    src = tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=4, hidden=256)
    out = tmp_path / "out" / "art"
    r = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(src), str(out), "100000"], env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"SLIMML SlimmlError: the disk is full while writing {out} (File too large)" in r.stdout
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written, no temp folder, no folder made to hold it


def test_a_full_disk_during_an_exporters_step_is_said_as_such(tiny_bert_dir, tmp_path):
    """The exporter wrapped the OSError: "optimum-onnx could not export ... No space left on device",
    which blamed the exporter and said nothing to do."""
    out = tmp_path / "out" / "art"
    r = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(tiny_bert_dir), str(out), "200000"], env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"SLIMML SlimmlError: the disk is full while writing {out} (File too large)" in r.stdout, r.stdout
    assert not (tmp_path / "out").exists()


def _namespace_tmpfs(mount: Path, options: str, shell: str) -> subprocess.CompletedProcess | None:
    """Run ``shell`` with a fresh tmpfs at ``mount`` in a private user+mount namespace; None where
    this system does not allow one (the test then skips)."""
    if not shutil.which("unshare"):
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount}"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o {options} tmpfs {mount} && {shell}"],
                          env=ENV, capture_output=True, text=True)


def _child(tmp_path: Path, src: Path, out: Path, fsize: int = 0) -> str:
    script = tmp_path / "child.py"
    script.write_text(FULL_DISK_CHILD)
    return f"{sys.executable} {script} {src} {out} {fsize}"


def test_full_disk_gives_a_clear_error(tmp_path):
    src = tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=4, hidden=256)  # ~1 MB of weights
    mount = tmp_path / "disk"
    mount.mkdir()
    out = mount / "art"
    r = _namespace_tmpfs(mount, "size=256k", f"{_child(tmp_path, src, out)}; echo LEFT:$(ls -A {mount})")
    if r is None:
        pytest.skip("no unprivileged user+mount namespace here for a tiny tmpfs; the file-size-limit test covers it")
    assert f"SLIMML SlimmlError: the disk is full while writing {out} (No space left on device)" in r.stdout, r.stdout + r.stderr
    assert "Nothing was left at" in r.stdout and "Traceback" not in r.stderr
    assert r.stdout.splitlines()[-1] == "LEFT:"  # the full disk holds nothing afterwards


def test_unwritable_output_gives_a_clear_error(tmp_path):
    src = tiny_onnx_mlp(tmp_path / "mlp.onnx")
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        r = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(src), str(locked / "art"), "0"], env=ENV,
                           capture_output=True, text=True)
        locked.chmod(0o755)
    else:  # root ignores permissions: use a read-only filesystem instead
        locked = tmp_path / "ro"
        locked.mkdir()
        r = _namespace_tmpfs(locked, "ro,size=64k", _child(tmp_path, src, locked / "art"))
        if r is None:
            pytest.skip("running as root without a user+mount namespace: cannot make an unwritable folder")
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"SLIMML ConfigError: cannot write under {locked} (no permission, or a read-only place); choose a writable "
            "folder with -o.") in r.stdout  # checked before any work


# A child that loads an artifact with weights large enough for ONNX Runtime to memory-map them,
# damages a data file, and runs again: it must get an IntegrityError, not die of SIGBUS.
DAMAGE_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    from slimml.runtime import load
    from slimml.runtime.tools.bench import sample_feeds
    from slimml.errors import IntegrityError
    art, how = Path(sys.argv[1]), sys.argv[2]
    model = load(art)
    feeds = sample_feeds(model.inputs, batch=2)
    model.run(feeds)
    data = art / model.manifest.shards[0].data
    if how == "truncate":
        with open(data, "r+b") as f:
            f.truncate(100)
    else:
        with open(data, "r+b") as f:
            f.seek(5000)
            b = f.read(1)
            f.seek(5000)
            f.write(bytes([b[0] ^ 0xFF]))
    for what in ("run", "verify"):
        try:
            model.run(feeds) if what == "run" else model.verify()
            print(f"{what}: RAN")
        except IntegrityError as e:
            print(f"{what}: REFUSED {e}")
""")


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_shard_damaged_after_load_is_refused_not_run(tmp_path, how):
    from slimml.convert import ConvertConfig, convert

    art = tmp_path / "big"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=2, hidden=1024), art, ConvertConfig(measure_latency=False, verify=False))
    r = subprocess.run([sys.executable, "-c", DAMAGE_CHILD, str(art), how], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-2000:]}"  # -7 would be SIGBUS
    lines = r.stdout.splitlines()
    assert lines[0].startswith("run: REFUSED shard_000.onnx.data in ") and lines[1].startswith("verify: REFUSED"), lines
    if how == "truncate":
        assert re.search(r"was truncated or grown \(\d+ -> 100 bytes\) after the model was loaded", lines[0])
    with pytest.raises(Exception, match="shard_000.onnx.data"):
        load(art)  # and a fresh load refuses it too


def test_verify_catches_what_stat_cannot(tmp_path):
    """A byte changed in place with size and mtime put back: refused by ``verify()`` (on Linux the
    watch sees the write itself; off inotify it compares sizes, times and the change time, which
    ``utime`` cannot put back; verify re-hashes where neither would tell)."""
    from slimml.convert import ConvertConfig, convert
    from slimml.errors import IntegrityError

    art = tmp_path / "art"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx", hidden=64), art, ConvertConfig(measure_latency=False))
    model = load(art)
    model._watch._after_fork()  # off inotify: sizes and times only
    data = art / model.manifest.shards[1].data
    st = data.stat()
    blob = bytearray(data.read_bytes())
    blob[10] ^= 0x01
    data.write_bytes(bytes(blob))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IntegrityError, match=r"shard_001.onnx.data (does not match its sha256 in the manifest|in .* was "
                                             r"rewritten in place \(its size and times put back\))"):
        model.verify()


def test_verify_refuses_a_manifest_changed_after_load(tmp_path):
    """The graphs and the manifest are read into memory at load, so the model runs on; but the
    folder no longer holds what it runs, and the health check says so."""
    from slimml.convert import ConvertConfig, convert
    from slimml.errors import IntegrityError

    art = tmp_path / "art"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx", hidden=64), art, ConvertConfig(measure_latency=False))
    model = load(art)
    model.verify()
    manifest = art / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"name": "', '"name": "x', 1))
    with pytest.raises(IntegrityError) as e:
        model.verify()
    assert str(e.value) == (f"manifest.json in the artifact {art} was changed or removed after the model loaded; the model "
                            "runs what it read then, and the folder now holds something else. Find out who changed it, "
                            "then load the artifact again.")


# A child that loads the artifact, then lets its address space grow by only 300 MB more and runs a
# batch whose buffers need several times that.
OOM_CHILD = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from slimml.errors import OutOfMemoryError
    from slimml.runtime import load
    model = load(sys.argv[1], threads=1)
    feeds = {t.name: np.ones((6_000_000, *t.shape[1:]), np.float32) for t in model.inputs}  # 192 MB of x
    size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + 300 * 2**20, resource.RLIM_INFINITY))
    try:
        model.run(feeds)
        print("RAN")
    except OutOfMemoryError as e:
        print(f"OOM {e}")
    model.run({name: v[:4] for name, v in feeds.items()})  # the model still answers a batch that fits
    print("SMALL RAN")
""")


def test_a_batch_past_the_memory_is_an_out_of_memory_error(tmp_path):
    """ONNX Runtime's failed allocation is one line of its own class (OutOfMemoryError, a FeedError:
    a server answers it 503, retry), not "rejected the inputs", and the model goes on."""
    from slimml.convert import ConvertConfig, convert

    art = tmp_path / "art"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx", layers=4, hidden=8), art, ConvertConfig(measure_latency=False))
    r = subprocess.run([sys.executable, "-c", OOM_CHILD, str(art)], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [
        "OOM shards 0-3 (merged) ran out of memory for this batch (ONNX Runtime could not allocate a buffer); send "
        "fewer rows or shorter sequences a call (encode's batch_size), or stream the model with a memory budget.",
        "SMALL RAN"], r.stdout + r.stderr[-2000:]
