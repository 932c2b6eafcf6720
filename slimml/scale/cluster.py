"""Joining a Ray cluster (or starting a local one) and reading what its nodes offer."""

from __future__ import annotations

import os

from slimml.errors import ConfigError


def require_ray() -> None:
    """Raise ConfigError, naming the extra to install, when Ray is missing."""
    import importlib.util

    try:  # found, not imported: Ray Serve reads some settings when it is first imported (serve's direct_ingress)
        found = all(importlib.util.find_spec(m) is not None for m in ("ray", "ray.serve", "fastapi", "uvicorn"))
    except ImportError:
        found = False
    if not found:
        raise ConfigError(
            "serving and pipelines run on Ray, which is not installed; install it with "
            "`pip install 'slimml[serve]'`."
        ) from None


def connect(address: str | None = None) -> bool:
    """Make sure this process is connected to Ray; return True if this call started it.

    ``address=None`` keeps an existing connection, or starts a local Ray (no dashboard, quiet
    logs). ``"auto"`` or ``"HOST:PORT"`` joins a cluster started with ``ray start``.
    """
    require_ray()
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    # Ray's processes inherit this. Serve kills an HTTP proxy that is not ready within 5 s, and
    # serve.start() then fails ("The actor never ran"); on a busy 2-core machine the proxy takes
    # longer than that to start (here, beside two busy processes, a start failed with Serve's 5 s
    # and succeeded with 60 s; a user's own value is kept)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except ConnectionError as e:
        raise ConfigError(
            f"could not join the Ray cluster at {address!r} ({e}); start one with `ray start --head` "
            "on the head node, or leave the address out to run on this machine alone."
        ) from None
    return True


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
