"""``serve``: start the application on Ray, run until interrupted, then shut Ray's processes down."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.manifest import read_manifest, verify_files
from slimml.serve.config import ServeConfig


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
          ready: Callable[[str], None] | None = None, stop: threading.Event | None = None) -> None:
    """Serve ``config.artifact`` over HTTP until Ctrl-C, SIGTERM or ``stop`` is set.

    Args:
        config: what to serve and the server's limits.
        host, port: where to listen (loopback by default; use 0.0.0.0 to accept other machines).
        address: the Ray cluster to join (``"auto"`` after ``ray start``); None starts a local Ray.
        ready: called with the base URL once the application answers.
        stop: an event that ends the server when set (for embedding it in a program or a test).

    Example:
        >>> serve(ServeConfig("artifacts/all-MiniLM-L6-v2", replicas=2), port=8000)
    """
    # a wrong path or a damaged file fails here, in one line, before Ray starts (each replica
    # hashes the files again when it loads them)
    verify_files(config.artifact, read_manifest(config.artifact))
    if not 0 < port < 65536:
        raise ConfigError(f"port must be from 1 to 65535, got {port}.")
    from ray import serve as ray_serve

    from slimml.scale.cluster import connect, nodes_with_cpus
    from slimml.serve.app import app

    owns_ray = connect(address)
    stop = stop or threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if threading.current_thread() is threading.main_thread():
        for s in previous:
            signal.signal(s, lambda *_: stop.set())
    try:
        cpus = sum(n["cpus"] for n in nodes_with_cpus())
        ray_serve.start(http_options={"host": host, "port": port})
        try:
            ray_serve.run(app(config, cpus_per_replica=cpus / config.replicas), name="slimml", route_prefix="/",
                          logging_config={"enable_access_log": config.access_log})
        except RuntimeError as e:  # Serve's own "Deploying application ... failed"
            raise SlimmlError(
                f"Ray Serve could not start the application ({str(e).splitlines()[0]}); the replicas' logs are "
                "under Ray's session folder (`ray/session_latest/logs` in /tmp or $RAY_TMPDIR)."
            ) from None
        url = f"http://{host}:{port}"
        if ready is not None:
            ready(url)
        stop.wait()
    finally:
        try:
            ray_serve.shutdown()
        finally:
            if owns_ray:
                import ray

                ray.shutdown()
            if threading.current_thread() is threading.main_thread():
                for s, handler in previous.items():
                    signal.signal(s, handler)
