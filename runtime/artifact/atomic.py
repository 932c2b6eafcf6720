"""Writing an artifact folder atomically: build it beside the output, then swap it into place.

An interrupted write (an error, Ctrl-C, a kill at any instant) leaves the previous artifact, or
nothing, at the output path, never a half-written one. ``convert`` and ``quantize`` both write
through :func:`atomic_folder`.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slimml.errors import ConfigError, SlimmlError, missing_extra
from slimml.runtime.artifact.files import utf8_path
from slimml.runtime.artifact.manifest import MANIFEST_NAME
from slimml.runtime.artifact.replace import umask

log = logging.getLogger("slimml")

_stop_asked: list[int] = []  # signals a command line asked to stop by (stop_asked): nothing more is swapped in


def stop_asked(signum: int) -> None:
    """Record that the process was asked to stop (the CLI's SIGINT/SIGTERM handlers call it before
    raising). A signal that lands in a ``__del__`` raises there, where Python prints and drops the
    exception and the work goes on; the next :func:`atomic_folder` then refuses to swap its folder
    in, so a command asked to stop never leaves a new artifact behind."""
    _stop_asked.append(signum)


def stop_signal() -> int | None:
    """The signal a command line was first asked to stop by (:func:`stop_asked`), or None."""
    return _stop_asked[0] if _stop_asked else None


@contextmanager
def atomic_folder(out: Path, private: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``out``; on success swap it in as ``out``.

    ``private``: the folder stays 0700 (caches); else it gets the usual mode (0755 under umask 022).

    On any exception the temporary folder is removed and ``out`` is left as it was; an OSError
    (full disk, read-only place) becomes a SlimmlError that says what to do.

    Example:
        >>> with atomic_folder(Path("artifacts/m")) as tmp:
        ...     (tmp / "manifest.json").write_text("{}")
    """
    made = _missing_parents(out)  # folders this run makes to hold ``out``: gone again if it fails
    try:
        tmp = fresh_tmp(out)
    except BaseException:
        _remove_empty(made)
        raise
    try:
        if not private:
            tmp.chmod(0o777 & ~umask())
        yield tmp
        if _stop_asked:  # asked to stop while the folder was written, and the exception was lost
            sys.stderr.write(f"stopped as asked (signal {_stop_asked[0]}); {out} was not written.\n")
            raise SystemExit(128 + _stop_asked[0])
        swap_in(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        if isinstance(e, OSError) and not isinstance(e, SlimmlError):
            raise os_error(e, out) from None
        raise


def check_output(out: Path) -> None:
    """Refuse, before any work, an output that is a file, lies under a file, cannot be written, or
    is a folder of something else (a folder holding an artifact is replaced once the new one is done)."""
    try:
        _check_output(out)
    except OSError as e:  # a name too long, a loop of links: looking at the path fails
        raise os_error(e, out) from None


def _check_output(out: Path) -> None:
    utf8_path(out)
    if out.is_symlink():  # swapping a new folder in would replace the link, not what it points to
        raise ConfigError(f"the output {out} is a symbolic link (to {os.readlink(out)}); give -o the folder it points "
                          "to, or a new path (then point the link at it).")
    blocked = _file_in_path(out)
    if blocked is not None:
        raise ConfigError(f"{blocked} is not a folder, so the output {out} cannot be made under it; give -o a path inside "
                          "a folder.")
    place = next((p for p in (out, *out.parents) if p.exists()), None)
    if place is not None and place.is_dir() and not os.access(place, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write under {place} (no permission, or a read-only place); choose a writable folder with -o.")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the output {out} is a file; give a folder path with -o.")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise ConfigError(
            f"the output folder {out} is not empty and holds no slimml artifact; refusing to replace it. "
            "Give another folder with -o, or empty it first."
        )
    extra = _unlisted(out) if out.is_dir() else []
    if extra:  # a model card or a baseline kept beside the shards: replacing the folder would delete them
        raise ConfigError(
            f"the artifact {out} holds files its manifest does not list ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}); replacing it would delete them. Move them out of it, or give "
            "another folder with -o."
        )


def _unlisted(folder: Path) -> list[str]:
    """Files under an artifact ``folder`` that its manifest does not list (nor is the manifest);
    none where the manifest cannot be read (a damaged artifact is replaced as it is)."""
    import json

    try:
        listed = {f["path"] for f in json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if not p.is_dir() and rel != MANIFEST_NAME and rel not in listed and not p.name.startswith("."):  # .DS_Store
            out.append(rel)
    return out


def _missing_parents(out: Path) -> list[Path]:
    """The folders above ``out`` that do not exist yet, deepest first (``artifacts/`` on a first convert);
    ``..`` is kept for the system to follow after any link, as the writes do."""
    missing = []
    for parent in out.absolute().parents:
        if os.path.lexists(parent):
            break
        missing.append(parent)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """``folders`` (deepest first) removed while empty: one another process has filled since stays."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def fresh_tmp(out: Path) -> Path:
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        name = glob.escape(out.name)  # an output named `m[12]` must not match another artifact's folders
        for stale in parent.glob(f".{name}.slimml-tmp-*"):  # left by a killed convert
            if not _owner_alive(stale):
                size = _folder_bytes(stale)
                _remove(stale)
                log.warning("slimml: removed %s (%.1f MB), left by an interrupted convert, quantize or cache write whose process "
                            "no longer runs", stale, size / 1e6)
        for old in parent.glob(f".{name}.slimml-old-*"):  # a previous artifact set aside by a killed convert
            if not _owner_alive(old):
                if not out.exists():
                    os.rename(old, out)  # put it back: it is the user's last good artifact
                else:
                    _remove(old)
        # a name no one else can have made first (mkdtemp: O_EXCL, mode 0700); the pid in it lets
        # the next run tell whether its owner still runs
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.slimml-tmp-{os.getpid()}-", dir=parent))
    except OSError as e:
        raise os_error(e, out) from None
    return tmp


def swap_in(tmp: Path, out: Path) -> None:
    """Move the finished artifact into place; the old one, if any, goes only once the new is ready.

    On Linux the two folders are swapped in one atomic ``renameat2(RENAME_EXCHANGE)``, so a kill at
    any instant leaves a whole artifact at ``out``. Elsewhere the old one is renamed aside first;
    a kill between the two renames leaves it at ``.NAME.slimml-old-PID``, which the next convert
    puts back (see ``fresh_tmp``).
    """
    if not out.exists():
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        _remove(tmp)  # tmp now holds the previous artifact
        return
    old = out.parent / f".{out.name}.slimml-old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    _remove(old)


def _remove(path: Path) -> None:
    """A folder set aside, or a link that stood where one goes (rmtree refuses links: it was left behind)."""
    if os.path.islink(path):
        try:
            os.unlink(path)
        except OSError:
            pass
    else:
        shutil.rmtree(path, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux >= 3.15); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # glibc < 2.28 or another libc
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0  # EINVAL/ENOSYS (a filesystem without it): fall back to two renames


def _owner_alive(folder: Path) -> bool:
    """Whether the process whose id a temp folder's name carries (``.x.slimml-tmp-PID[-suffix]``) runs.

    A process with that id that started after the folder was made is not its owner: the id was
    reused (common in containers, where ids are small and restart from 1).
    """
    m = re.search(r"\.slimml-(?:tmp|old)-(\d+)", folder.name)
    if not m or not _alive(int(m.group(1))):
        return False
    started = _start_time(int(m.group(1)))
    try:
        made = folder.stat().st_mtime
    except OSError:
        return False
    return started is None or started <= made + 1.0


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _folder_bytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder``, never following a link (a planted one could
    point anywhere, or loop)."""
    total = 0
    for root, _, files in os.walk(folder, followlinks=False):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie (killed, not yet reaped by its parent) does not:
    ``os.kill(pid, 0)`` succeeds on it, so a convert started right after a SIGKILL would keep the
    killed one's temp folder."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill()
    return state not in (b"Z", b"X")


def _file_in_path(out: Path) -> Path | None:
    """The nearest existing part of ``out``'s path above it, when that part is not a folder."""
    for p in out.parents:
        if os.path.lexists(p):  # a link to nothing (or a loop) is in the way as much as a file
            return None if p.is_dir() else p
    return None


def os_error(e: OSError, out: Path) -> SlimmlError:
    """An OSError met while writing ``out``, as one line with what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # full disk, quota, or a file-size limit
        return SlimmlError(f"the disk is full while writing {out} ({e.strerror}); free space or choose another folder with -o. Nothing was left at {out}.")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return SlimmlError(f"cannot write to {out} ({e.strerror}); choose a writable folder with -o.")
    try:
        blocked = _file_in_path(out)
    except OSError:
        blocked = None
    if blocked is not None or e.errno == errno.ENOTDIR:
        return SlimmlError(f"{blocked or 'a part of its path'} is not a folder, so the output {out} cannot be made under "
                           "it; give -o a path inside a folder.")
    if e.errno == errno.ENOENT:  # a place that takes no new folders (/proc), or one removed under us
        return SlimmlError(f"cannot make {out} ({e.strerror}): {out.parent} takes no new folders; choose a writable "
                           "folder with -o.")
    if e.errno == errno.ENAMETOOLONG:
        return SlimmlError(f"the output path {out} is too long for the file system; give a shorter one with -o.")
    why = e.strerror or type(e).__name__
    return SlimmlError(f"writing {out} failed ({why}); choose another folder with -o, and check the disk it is on.")


@contextmanager
def one_line_errors(doing: str, current: list[str], out: Path, error: type[SlimmlError], fix: str) -> Iterator[None]:
    """A dependency's exception (torch, optimum, onnx, ONNX Runtime, NNCF) raised while a stage
    writes ``out`` becomes one ``error`` line: ``"{doing} failed while {current[0]} (its type: its
    first line). {fix}; SLIMML_DEBUG=1 shows the cause."``. ``current`` holds the step under way
    (the stage updates it as it goes). slimml's own errors pass as they are (and an ImportError of an
    extra's package, which the caller names the extra for), except that a full disk
    under any of them (an exporter's error wraps it) is said as such."""
    try:
        yield
    except Exception as e:
        full = _disk_full(e)
        if full is not None:
            raise os_error(full, out) from e
        if isinstance(e, (SlimmlError, MemoryError)) or (isinstance(e, ImportError) and missing_extra(e) is not None):
            raise  # out of memory, said as such by the CLI; an extra's package not installed, named by extras_for
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise error(f"{doing} failed while {current[0]} ({type(e).__name__}: {first}). {fix}; SLIMML_DEBUG=1 shows "
                    "the cause.") from e


def _disk_full(e: BaseException | None) -> OSError | None:
    """The full-disk (or quota, or file-size limit) OSError behind ``e``, if one is in its chain."""
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in codes:
            return e
        for code in codes:  # a Rust library's error (tokenizers' save) names it in its text: "(os error 28)"
            if f"(os error {code})" in str(e):
                return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None
