"""Joining a Ray cluster (or starting a local one) and reading what its nodes offer."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import threading

from slimml.errors import ConfigError, MissingExtraError, SlimmlError
from slimml.runtime.artifact.places import home_folder, unwritable

CONNECT_TIMEOUT_S = 10  # a HOST:PORT that does not answer a TCP connection within this is refused
RAY_WORKER_PORTS_END = 19999  # Ray's default --max-worker-port: its workers listen on ports up to this one


def free_port(host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()) -> int:
    """A TCP port on ``host`` that nothing listens on now, not one of ``avoid`` (ports the caller
    means to use, free now), chosen where Ray starting up will not take it before it is bound:
    above Ray's worker ports and below the kernel's ephemeral range (Ray's gRPC servers bind port 0
    there, a dozen for one ``serve.start``; a port picked by a bind to 0 was taken so about once in
    500 starts). A bind to 0 where that gap is too small."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; elsewhere the bind checks the port
    pick = random.Random()
    for _ in range(64 if low - RAY_WORKER_PORTS_END > 1000 else 0):
        port = pick.randrange(RAY_WORKER_PORTS_END + 1, low)
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:  # in use (or waiting out a closed connection): another
                continue
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def require_ray() -> None:
    """Raise MissingExtraError (an ImportError too), naming the extra to install, when Ray is missing."""
    import importlib.util

    try:  # found, not imported: Ray Serve reads some settings when it is first imported (serve's direct_ingress)
        found = all(importlib.util.find_spec(m) is not None for m in ("ray", "ray.serve", "fastapi", "uvicorn"))
    except ImportError:
        found = False
    if not found:
        raise MissingExtraError(
            "serving and pipelines run on Ray, which is not installed; install it with "
            "`pip install 'slimml[serve]'`."
        ) from None


_holders = 0  # users (pipelines, a server) of the Ray connection slimml made in this process


def connect(address: str | None = None) -> bool:
    """Make sure this process is connected to Ray; return True if the connection is slimml's own
    (made by this call or an earlier one): the caller then holds a share of it, and gives it back
    with :func:`release_ray` (the last one to give it back shuts Ray down). A connection the caller
    made itself (``ray.init`` before slimml) is never slimml's to shut down.

    ``address=None`` keeps an existing connection, or starts a local Ray (no dashboard, quiet
    logs). ``"auto"`` or ``"HOST:PORT"`` joins a cluster started with ``ray start``.
    """
    global _holders
    require_ray()
    import ray

    if ray.is_initialized():
        if _holders > 0:  # slimml's own connection: one more user of it (closing another pipeline keeps it)
            _holders += 1
            return True
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    # Ray's processes inherit this. Serve kills an HTTP proxy that is not ready within 5 s, and
    # serve.start() then fails ("The actor never ran"); on a busy 2-core machine the proxy takes
    # longer than that to start (here, beside two busy processes, a start failed with Serve's 5 s
    # and succeeded with 60 s; a user's own value is kept)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    target = cluster_address(address)  # without an address: the one RAY_ADDRESS names, or a `ray start` here recorded
    found = address is None and target is not None
    if target is not None:
        try:
            check_reachable(target)
        except ConfigError as e:
            if found:
                raise ConfigError(f"{str(e).rstrip('.')}; Ray found that address itself (RAY_ADDRESS, or the cluster a "
                                  "`ray start` on this machine recorded): unset RAY_ADDRESS, or `ray stop` that cluster, "
                                  "to run on this machine alone.") from None
            raise
    else:
        token_in_memory()
    held: list[int] = []
    try:
        with _signals_held(held):
            if address is None:
                ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as e:
        ray.shutdown()  # whatever the failed start left that Ray knows of
        if held:  # asked to stop, and the start failed too: the signal, not the failure
            signal.raise_signal(held[0])
        if isinstance(e, (ConnectionError, ValueError)):  # ValueError: an address Ray cannot parse ("garbage")
            # a cluster with token authentication (Ray turns it on where ray start finds a token) refuses a
            # process without the mode for 20 s of "InvalidAuthToken" lines, then fails as if it were not there
            # (an address Ray cannot parse is not a login)
            auth = ("; if that cluster uses token authentication, set RAY_AUTH_MODE=token here too, with its token in "
                    "RAY_AUTH_TOKEN or ~/.ray/auth_token"
                    if isinstance(e, ConnectionError) and os.environ.get("RAY_AUTH_MODE") != "token" else "")
            named = repr(address) if not found else f"{target!r} (RAY_ADDRESS, or the cluster `ray start` recorded here)"
            raise ConfigError(
                f"could not join the Ray cluster at {named} ({e}); give HOST:PORT of a cluster started with "
                f"`ray start --head` on the head node{auth}, or leave the address out to run on this machine alone"
                f"{' (unset RAY_ADDRESS too)' if found else ''}."
            ) from None
        first = " ".join(str(e).split())[:300] or type(e).__name__  # seen under load: "timed out during startup"
        if isinstance(e, OSError) and e.filename:  # a folder it cannot write: not the machine's load
            raise SlimmlError(
                f"Ray did not start ({first}): it writes its session files under RAY_TMPDIR (default /tmp) and keeps "
                "its cluster token in ~/.ray unless RAY_AUTH_TOKEN is set; point them at writable folders and start "
                "again.") from None
        raise SlimmlError(
            f"Ray did not start ({first}); the machine may be too busy: free some cores or memory and start again. "
            "Its log is under Ray's session folder (`ray/session_latest/logs` in /tmp or $RAY_TMPDIR)."
        ) from None
    _holders = 1
    if held:  # asked to stop while Ray started: now that ray.shutdown() knows every process, deliver it
        try:
            signal.raise_signal(held[0])
        except BaseException:
            if release_ray():
                ray.shutdown()
            raise
    return True


def token_in_memory() -> bool:
    """Before a local Ray starts: where Ray could not save its cluster token (``~/.ray/auth_token``:
    a read-only or missing home, as a container run as another user has), give it one in this
    process's environment (``RAY_AUTH_TOKEN``), which Ray's processes inherit; True where it did.
    A token or mode the user set, or a token file already there, is left to Ray."""
    if any(os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")):
        return False
    home = home_folder()
    if home is not None and ((home / ".ray" / "auth_token").is_file() or unwritable(home / ".ray") is None):
        return False
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return True


def cluster_address(address: str | None) -> str | None:
    """The cluster :func:`connect` joins for ``address``: ``address`` itself, else the one Ray
    finds without being told (``RAY_ADDRESS``, or the cluster a ``ray start`` on this machine
    recorded: ``ray.init()`` joins those), else None (a Ray of this process's own). An address
    Ray cannot use is returned as it is given, for ``ray.init`` to refuse in its words."""
    if address is not None:
        return address
    require_ray()
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - an address Ray cannot use: ray.init says so, in its words
        return os.environ.get("RAY_ADDRESS") or "auto"


@contextlib.contextmanager
def _signals_held(held: list[int]):
    """SIGINT and SIGTERM held while ``ray.init`` starts Ray's processes, and handed back after it.

    Ray's own SIGTERM handler (set by ``ray.init``) exits from wherever the start is, and Ctrl-C
    raises there: either left the processes started so far running with nothing to stop them (seen:
    two agents). The first signal now waits for the start to finish (seconds); a second one is
    delivered at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    import ray._private.utils as ray_utils

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def hold(signum, frame) -> None:
        if held:  # asked twice: stop now
            signal.signal(signum, previous[signum])
            signal.raise_signal(signum)
        held.append(signum)

    keep = getattr(ray_utils, "set_sigterm_handler", None)
    wanted: list = []  # the handler Ray sets for SIGTERM: set once the start is over, as Ray leaves it
    for s in previous:
        signal.signal(s, hold)
    if keep is not None:
        ray_utils.set_sigterm_handler = wanted.append
    try:
        yield held
    finally:
        if keep is not None:
            ray_utils.set_sigterm_handler = keep
        for s, handler in previous.items():
            handler = wanted[-1] if s == signal.SIGTERM and wanted else handler
            if handler is not None:  # None: a handler set from C, which Python cannot set back
                signal.signal(s, handler)


def check_reachable(address: str) -> None:
    """Refuse a ``HOST:PORT`` where nothing answers a TCP connection within :data:`CONNECT_TIMEOUT_S`
    (``ray.init`` itself retries a refused head for minutes, printing a warning every few seconds).
    ``"auto"``, ``ray://`` addresses and what Ray cannot parse are left to Ray.

    Raises:
        ConfigError: the port refuses connections, or the host does not answer.
    """
    host, sep, port = address.strip().rpartition(":")
    if not sep or "://" in address or not port.isdigit() or not host:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S) as conn:
            answer = _first_answer(conn)
    except OSError as e:
        why = "the port refuses connections" if isinstance(e, ConnectionRefusedError) else (
            f"no answer within {CONNECT_TIMEOUT_S} s" if isinstance(e, TimeoutError) else (e.strerror or str(e)))
        raise ConfigError(
            f"nothing answers at the Ray address {address!r} ({why}); start the cluster's head there with "
            "`ray start --head --port PORT` and give that HOST:PORT, or leave the address out to run on this "
            "machine alone."
        ) from None
    # Ray's GCS speaks gRPC: its first bytes are an HTTP/2 frame (SETTINGS, or GOAWAY). Anything else
    # (a web server such as the dashboard's 8265, a database) would hold ray.init for good, deaf to Ctrl-C
    if answer is not None and (answer[:5] == b"HTTP/" or len(answer) >= 4 and answer[3] not in (0x04, 0x07)):
        what = "answers HTTP/1: a web server (the dashboard's port, or Serve's?)" if answer[:5] == b"HTTP/" else (
            "answers, but not as Ray's GCS (gRPC)")
        raise ConfigError(
            f"{address!r} {what}, not the cluster's GCS port; give the port `ray start --head --port PORT` was given "
            "(6379 by default), or `auto` on a node of the cluster."
        )


def _first_answer(conn: socket.socket) -> bytes | None:
    """What a server says to an HTTP/1 request within a second (None: nothing in that time)."""
    conn.settimeout(1.0)
    try:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return conn.recv(64)
    except OSError:  # a timeout, or closed: nothing to tell from
        return None


def release_ray() -> bool:
    """Give back one share of slimml's Ray connection; True when it was the last (shut Ray down then)."""
    global _holders
    _holders = max(_holders - 1, 0)
    return _holders == 0


def nodes_with_cpus() -> list[dict]:
    """Alive nodes with CPUs: id, address, CPUs and memory (bytes) as Ray accounts them."""
    import ray

    out = []
    for n in ray.nodes():
        res = n.get("Resources", {})
        if n.get("Alive") and res.get("CPU", 0) >= 1:
            out.append({"id": n["NodeID"], "address": n.get("NodeManagerAddress", "?"), "cpus": int(res["CPU"]),
                        "memory": int(res.get("memory", 0))})
    return out
