"""``serve``: start the application on Ray, run until interrupted, then shut Ray's processes down."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.artifact.manifest import read_manifest, verify_files
from slimml.serve.config import ServeConfig

log = logging.getLogger("slimml")


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
          ready: Callable[[str], None] | None = None, stop: threading.Event | None = None,
          direct_ingress: bool = False) -> None:
    """Serve ``config.artifact`` over HTTP until Ctrl-C, SIGTERM or ``stop`` is set.

    Args:
        config: what to serve and the server's limits.
        host, port: where to listen (loopback by default; use 0.0.0.0 to accept other machines).
        address: the Ray cluster to join (``"auto"`` after ``ray start``); None starts a local Ray.
        ready: called with the base URL once the application answers.
        stop: an event that ends the server when set (for embedding it in a program or a test).
        direct_ingress: the replica answers HTTP on ``port`` itself, without Serve's proxy in
            between (Ray Serve's direct ingress; the proxy still runs, on a free port). One
            replica on a Ray this call starts. Ray reads the setting when ``ray.serve`` is first
            imported, so it must be the process's first use of Ray Serve (``slimml serve
            --direct-ingress`` is). On 2 cores, 32 texts a request: 0.87-0.90x of in-process
            ``encode`` against 0.73x through the proxy. A replica that dies leaves the port
            refusing connections until its replacement listens there (seconds to a minute: Serve must notice, then start it).

    Example:
        >>> serve(ServeConfig("artifacts/all-MiniLM-L6-v2", replicas=2), port=8000)
    """
    # a wrong path or a damaged file fails here, in one line, before Ray starts (each replica
    # hashes the files again when it loads them)
    manifest = read_manifest(config.artifact)
    verify_files(config.artifact, manifest)
    config = dataclasses.replace(config, manifest_sha256=manifest.sha256)  # every replica and stage checks its copy
    if config.stages:  # a stage count the shards cannot take fails here, not in a replica's log
        from slimml.scale.balance import split_stages

        if manifest.components:
            raise ConfigError(f"--stages splits one chain of shards, but {config.artifact} has components "
                              f"{', '.join(manifest.components)}; serve it whole (leave --stages out).")
        split_stages([sh.weight_bytes for sh in manifest.shards], config.stages)
    if config.chat_template is not None:
        from slimml.runtime.tasks.registry import kind_of

        if kind_of(manifest) != "text-generation":
            raise ConfigError(f"--chat-template is for language models, and {config.artifact} is a {kind_of(manifest)} "
                              "artifact; leave --chat-template out.")
    if not 0 < port < 65536:
        raise ConfigError(f"port must be from 1 to 65535, got {port}.")
    if address is None and not direct_ingress:  # a Ray this call starts: the port must be free here (one line, not Serve's traceback)
        _check_listen(host, port)
    if config.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("slimml: serving on %s without an API key: anyone who reaches this port can use the model; "
                    "set --api-key or SLIMML_API_KEY", host)
    proxy_port = _direct_ingress(host, port, config, address) if direct_ingress else port
    import ray
    from ray import serve as ray_serve

    from slimml.scale.cluster import connect, nodes_with_cpus, release_ray
    from slimml.serve.app import app

    owns_ray = connect(address)
    stop = stop or threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    deploying = threading.Event()
    deploying.set()

    def on_signal(signum, frame) -> None:
        stop.set()
        if deploying.is_set():  # Serve's start and run block until it answers (minutes, for a deploy that fails):
            raise _StopAsked  # unwind them; the finally below stops what started, and serve returns as after a stop

    if threading.current_thread() is threading.main_thread():
        for s in previous:
            signal.signal(s, on_signal)
    try:
        nodes = nodes_with_cpus()
        cpus = sum(n["cpus"] for n in nodes)
        memory = _replica_memory(config, nodes)
        # the proxy's own end-to-end limit, a little after the replica's (whose 408 names the flag)
        try:
            ray_serve.start(http_options={"host": host, "port": proxy_port,
                                          "request_timeout_s": config.request_timeout_s + 5})
        except RuntimeError as e:  # Serve's proxy: "Failed to bind to address ..." (taken since the check above)
            raise ConfigError(f"Ray Serve could not listen on {host}:{proxy_port} ({str(e).splitlines()[0]}); choose "
                              "another --port, or stop what listens there.") from None
        except (TimeoutError, ray.exceptions.RayActorError) as e:  # the proxy not ready in time: Serve killed it
            raise SlimmlError(
                f"Ray Serve's HTTP proxy did not start in time ({type(e).__name__}: {str(e).splitlines()[0]}): the "
                "machine is too busy; free some cores and start again (on a `ray start` cluster, start Ray with "
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60); its log is under Ray's session folder "
                "(`ray/session_latest/logs` in /tmp or $RAY_TMPDIR)."
            ) from None
        try:
            ray_serve.run(app(config, cpus_per_replica=cpus / config.replicas, memory_bytes=memory), name="slimml",
                          route_prefix="/",
                          logging_config={"enable_access_log": config.access_log})
        except RuntimeError as e:  # Serve's own "Deploying application ... failed"
            raise SlimmlError(
                f"Ray Serve could not start the application ({str(e).splitlines()[0]}); the replicas' logs are "
                "under Ray's session folder (`ray/session_latest/logs` in /tmp or $RAY_TMPDIR)."
            ) from None
        deploying.clear()  # serving: a signal now ends stop.wait() below
        url = f"http://{host}:{port}"
        if ready is not None:
            ready(url)
        stop.wait()
    except _StopAsked:
        pass  # a stop asked while Serve was starting: the same clean stop as one asked while it served
    finally:
        try:
            ray_serve.shutdown()
        finally:
            if owns_ray and release_ray():
                ray.shutdown()
            if threading.current_thread() is threading.main_thread():
                for s, handler in previous.items():
                    signal.signal(s, handler)


class _StopAsked(BaseException):
    """A signal while Serve starts or deploys (its calls block until Serve answers): unwinds them."""


def _check_listen(host: str, port: int) -> None:
    """Refuse, before Ray starts, an address this machine cannot listen on: a port something else
    holds, or a host that is not one of its addresses."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:  # socket.gaierror: "Name or service not known"
        raise ConfigError(f"cannot listen on {host!r} ({e.strerror or e}); give --host an address of this machine, "
                          "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface).") from None
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: a port in TIME_WAIT is free
        try:
            s.bind(where)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"cannot listen on {host} ({e.strerror}): it is not an address of this machine; give "
                                  "--host one of its addresses, or 0.0.0.0 (every interface).") from None
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port, or stop "
                              "what listens there.") from None


def _replica_memory(config: ServeConfig, nodes: list[dict]) -> int | None:
    """For a streamed language model (``memory_budget`` set): the bytes each replica asks Ray for
    (its budget, a full KV cache and the prefix store), refused in one line when the nodes cannot hold the replicas."""
    manifest = read_manifest(config.artifact)
    from slimml.runtime.tasks.registry import kind_of

    if not config.memory_budget or kind_of(manifest) != "text-generation":  # the registry says what it is for
        return None
    from slimml.runtime.engine.budget import fmt_bytes
    from slimml.serve.llm import replica_bytes

    need = replica_bytes(manifest, config.memory_budget, config.max_running, config.prefix_bytes)
    fit = sum(n["memory"] // need for n in nodes)
    if fit < config.replicas:
        per_node = ", ".join(f"{n['address']}: {n['memory'] // need}" for n in nodes)
        raise ConfigError(f"each replica needs {fmt_bytes(need)} (--memory-budget {config.memory_budget}, the KV cache "
                          f"of --max-running {config.max_running} answers at full context and --prefix-cache "
                          f"{config.prefix_cache}), so the cluster holds "
                          f"{fit} of the {config.replicas} replicas asked ({per_node}); lower --replicas, "
                          "--memory-budget, --max-running or --prefix-cache, or add nodes.")
    return need


def _direct_ingress(host: str, port: int, config: ServeConfig, address: str | None) -> int:
    """Turn on Ray Serve's direct ingress with the replica's HTTP port pinned to ``port``;
    return a free port for Serve's proxy. Refused, in one line, where it cannot apply."""
    if config.replicas != 1 or address is not None:
        raise ConfigError("direct ingress serves one replica on a Ray that slimml starts itself (one port, no "
                          "load balancer in front); drop --replicas and --address, or drop --direct-ingress.")
    if "ray.serve" in sys.modules and os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        raise ConfigError("direct ingress must be chosen before Ray Serve is first imported in this process; use "
                          "`slimml serve --direct-ingress`, or call serve(..., direct_ingress=True) before anything "
                          "imports ray.serve.")
    import ray

    if ray.is_initialized():
        raise ConfigError("direct ingress needs a Ray that serve() starts itself, but this process is already "
                          "connected to Ray; call serve(..., direct_ingress=True) first, or drop it.")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the replica will (app._reuse_address)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port.") from None
    # Ray's processes inherit these. A released port is quarantined (150 s by default, for HAProxy to
    # drain) before Serve hands it out again: with one port, a replacement replica could not listen.
    # No load balancer to deregister from either, so no 30 s minimum drain on SIGTERM (in-flight
    # requests are still waited for)
    os.environ.update({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
                       "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1), "RAY_SERVE_PORT_QUARANTINE_S": "0",
                       "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"})
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
