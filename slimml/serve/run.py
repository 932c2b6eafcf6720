"""``serve``: start the application on Ray, run until interrupted, then shut Ray's processes down."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slimml import errors
from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.artifact.files import verify_files
from slimml.runtime.artifact.manifest import read_manifest
from slimml.serve.config import ServeConfig
from slimml.runtime.tasks.limits import a_or_an

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

    Returns:
        None, once the server has stopped and what it started (Serve, a local Ray) is shut down.

    Raises:
        ArtifactError / IntegrityError: a missing, malformed or tampered artifact (checked before Ray starts).
        ConfigError: a port out of range or taken, or settings the artifact cannot take (``stages``
            it cannot split, a chat template for a model that does not chat).
        SlimmlError: Ray Serve could not start its proxy or the application (the message says
            where its logs are).

    Example:
        >>> serve(ServeConfig("artifacts/all-MiniLM-L6-v2", replicas=2), port=8000)
    """
    # a wrong path or a damaged file fails here, in one line, before Ray starts (each replica
    # hashes the files again when it loads them)
    manifest = read_manifest(config.artifact)
    verify_files(config.artifact, manifest)
    # every replica and stage checks its copy; the paths made absolute: a replica resolves them from Ray's
    # working folder, not the one slimml serve was started in
    config = dataclasses.replace(config, manifest_sha256=manifest.sha256, artifact=str(Path(config.artifact).resolve()),
                                 cache_dir=str(Path(config.cache_dir).absolute()) if config.cache_dir else None)
    if config.stages:  # what stages cannot split fails here, not in a replica's log
        from slimml.scale.balance import split_stages
        from slimml.scale.pipeline import check_stageable

        check_stageable(Path(config.artifact), manifest)
        split_stages([sh.weight_bytes for sh in manifest.shards], config.stages)
    if config.memory_budget is not None:  # a budget below the largest shard: here, not in a replica's (or a stage's)
        from slimml.runtime.engine.budget import plan_stream  # log once Ray has started; each component's (T5, CLIP)

        for name in manifest.components or [None]:
            try:
                plan_stream(manifest.component(name) if name else manifest, memory_budget=config.memory_budget)
            except SlimmlError as e:
                if name:
                    e.args = (f"the {name} component: {e}", *e.args[1:])
                raise
    if config.chat_template is not None:
        from slimml.runtime.tasks.registry import kind_of

        if kind_of(manifest) != "text-generation":
            raise ConfigError(f"--chat-template is for language models, and {config.artifact} is {a_or_an(kind_of(manifest))} "
                              "artifact; leave --chat-template out.")
    if not 0 < port < 65536:
        raise ConfigError(f"port must be from 1 to 65535, got {port}.")
    from slimml.scale.cluster import cluster_address

    # without --address, Ray joins the cluster RAY_ADDRESS names or a `ray start` here recorded: that is a cluster too
    joins = cluster_address(address)
    if joins is None and not direct_ingress:  # a Ray this call starts: the port must be free here (one line, not Serve's traceback)
        _check_listen(host, port)
    if config.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("slimml: serving on %s without an API key: anyone who reaches this port can use the model; "
                    "set --api-key or SLIMML_API_KEY", host)
    proxy_port = _direct_ingress(host, port, config, joins) if direct_ingress else port
    import ray
    from ray import serve as ray_serve

    from slimml.scale.cluster import connect, nodes_with_cpus, release_ray
    from slimml.serve.app import app

    owns_ray = connect(address)
    stop = stop or threading.Event()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    deploying = threading.Event()
    deploying.set()

    signalled: list[int] = []

    def on_signal(signum, frame) -> None:
        signalled.append(signum)
        stop.set()
        if deploying.is_set():  # Serve's start and run block until it answers (minutes, for a deploy that fails):
            raise _StopAsked  # unwind them; the finally below stops what started, and serve returns as after a stop

    if threading.current_thread() is threading.main_thread():
        for s in previous:
            signal.signal(s, on_signal)
    ours = owns_ray and _started_here(ray)  # a Ray of this process alone: its Serve is ours to start and stop
    started_serve, owns_serve, deployed = ours, False, False
    dead_before: set[tuple[str, int]] = set()
    try:
        nodes = nodes_with_cpus()
        if not ours:  # a cluster others may serve on: refuse to replace or stop what runs there
            started_serve = _check_cluster_serve(joins or address, proxy_port)
            if started_serve and _node_here(nodes):  # Serve's proxy will listen on this machine
                _check_listen(host, proxy_port)
        memory = _replica_memory(config, nodes)
        _check_replica_cpus(config, nodes)
        # the proxy's own end-to-end limit, a little after the replica's (whose 408 names the flag)
        owns_serve = started_serve  # from here, a Serve this server starts is this server's to stop
        try:
            ray_serve.start(http_options={"host": host, "port": proxy_port,
                                          "request_timeout_s": config.request_timeout_s + 5})
        except RuntimeError as e:  # Serve's proxy: "Failed to bind to address ..." (taken since the check above)
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            why = lines[-1] if lines else type(e).__name__  # the cause, not the "ray::ProxyActor.ready() (pid=...)" header
            raise ConfigError(f"Ray Serve could not listen on {host}:{proxy_port} ({why}); choose another --port, or stop "
                              "what listens there.") from None
        except (TimeoutError, ray.exceptions.RayActorError) as e:  # the proxy not ready in time: Serve killed it
            raise SlimmlError(
                f"Ray Serve's HTTP proxy did not start in time ({type(e).__name__}: {str(e).splitlines()[0]}): the "
                "machine is too busy; free some cores and start again (on a `ray start` cluster, start Ray with "
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60); its log is under Ray's session folder "
                "(`ray/session_latest/logs` in /tmp or $RAY_TMPDIR)."
            ) from None
        deployed = True
        try:
            logging.getLogger("ray.serve").addFilter(_own_start)  # "New http_options ... will not be applied": ours were
            try:
                ray_serve.run(app(config, cpus_per_replica=replica_cpus([n["cpus"] for n in nodes], config.replicas),
                                  memory_bytes=memory), name=APP,
                              route_prefix="/",
                              logging_config={"enable_access_log": config.access_log})
            finally:
                logging.getLogger("ray.serve").removeFilter(_own_start)
        except RuntimeError as e:  # Serve's own "Deploying application ... failed"
            why = _replica_error(ray_serve)
            raise SlimmlError(
                f"Ray Serve could not start the application ({why or str(e).splitlines()[0]}); the replicas' logs are "
                "under Ray's session folder (`ray/session_latest/logs` in /tmp or $RAY_TMPDIR)."
            ) from None
        deploying.clear()  # serving: a signal now ends stop.wait() below
        url = f"http://{host}:{port}"
        if ready is not None:
            ready(url)
        dead_before = _dead_ray_processes(ray)
        stop.wait()
    except _StopAsked:
        pass  # a stop asked while Serve was starting: the same clean stop as one asked while it served
    finally:
        try:
            # a SIGTERM may have reached Ray's processes too (a service manager's stop): a moment for them to go
            if owns_serve:
                if not (ours and signal.SIGTERM in signalled and _ray_going(ray, dead_before)):
                    ray_serve.shutdown()
            elif deployed:  # Serve was running before: only this server's application goes
                _delete_app(ray_serve)
        finally:
            if owns_ray and release_ray():
                ray.shutdown()
            if threading.current_thread() is threading.main_thread():
                for s, handler in previous.items():
                    signal.signal(s, handler)


APP = "slimml"  # the Serve application's name (at route "/")


def _own_start(record: logging.LogRecord) -> bool:
    """Leave out Serve's "Connecting to existing Serve app ... New http_options/controller_options
    will not be applied." that ``serve.run`` logs after this server's own ``serve.start``: the options
    were applied there, and the line told users their --port or timeouts were ignored."""
    return not str(record.msg).startswith("Connecting to existing Serve app")


def _started_here(ray) -> bool:
    """Whether the Ray this process is connected to is one it started (its GCS and raylet are this
    process's children), not a cluster it joined: ``ray.init()`` without an address joins the
    cluster ``RAY_ADDRESS`` names or a ``ray start`` on this machine recorded, whose Serve others
    may use."""
    try:
        node = ray._private.worker._global_node
        return node is not None and bool(node.all_processes)
    except Exception:  # noqa: BLE001 -- Ray's internals moved: not known to be ours, so treated as shared
        return False


def _dead_ray_processes(ray) -> set[tuple[str, int]]:
    """This process's own Ray's processes (GCS, raylet, dashboard, log monitor, ...) that have
    exited, as (kind, pid); empty where it cannot tell."""
    try:
        node = ray._private.worker._global_node
        return {(kind, p.pid) for kind, p in node.dead_processes()} if node is not None else set()
    except Exception:  # noqa: BLE001 -- Ray's internals moved: none known dead
        return set()


def _ray_going(ray, dead_before: set[tuple[str, int]], wait_s: float = 1.0) -> bool:
    """Whether a process of this process's own Ray exits within ``wait_s`` (beyond ``dead_before``,
    those gone while it served): a stop signalled to the server's whole process group (a service
    manager's, systemd's KillMode=control-group) reached Ray's processes too (its dashboard and log
    monitor go at once, GCS seconds later), and Serve's shutdown would wait 30 s on a controller
    that is gone, then 60 s on the GCS; ``ray.shutdown`` ends the rest."""
    deadline = time.monotonic() + wait_s
    while True:
        if _dead_ray_processes(ray) - dead_before:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def replica_cpus(nodes: list[int], replicas: int) -> float:
    """The most CPUs each of ``replicas`` replicas can have with every one placed on a node of
    ``nodes`` (their CPU counts): a replica lives on one node, so the cluster's CPUs / replicas asked
    2 CPUs a replica of two 1-CPU nodes, which Ray never placed (the deploy waited forever).

    Example:
        >>> replica_cpus([4, 4], 3), replica_cpus([1, 1], 1), replica_cpus([2], 4)
        (2.0, 1.0, 0.5)
    """
    candidates = sorted({n / k for n in nodes for k in range(1, replicas + 1)}, reverse=True)
    return next(c for c in candidates if sum(int(n / c + 1e-9) for n in nodes) >= replicas)


def _check_cluster_serve(address: str | None, port: int) -> bool:
    """On a cluster slimml joined: refuse to start where Ray Serve already runs an application (a
    second slimml serve replaced the first's, at its port, and stopping either stopped both) or
    listens on another port; return whether Serve still has to be started (then it is this server's
    to shut down)."""
    from ray import serve as ray_serve

    where = f"the cluster at {address}" if address else "this process's Ray"
    apps = sorted(ray_serve.status().applications)
    if apps:
        raise ConfigError(
            f"Ray Serve on {where} already runs application(s) {', '.join(apps)}; a second server would replace or "
            "stop them. Stop that server first, serve this model on a cluster of its own, or put the models in one "
            "Serve config (docs/serve.yaml) and run it with `serve run`."
        )
    running = _serve_port()
    if running is None:
        return True
    if running != port:
        raise ConfigError(f"Ray Serve on {where} already listens on port {running}; give --port {running} (one port a "
                          "cluster), or serve on a cluster of its own.")
    return False


def _serve_port() -> int | None:
    """The HTTP port of the Serve instance running on this Ray, or None where none runs."""
    from ray.serve.context import _get_global_client  # ray[serve] is pinned: checked against 2.60

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    options = client.get_serve_details().get("http_options") or {}
    return int(options.get("port") or 8000)


def _node_here(nodes: list[dict]) -> bool:
    """Whether this machine is one of the cluster's nodes."""
    import ray

    here = ray.util.get_node_ip_address()
    return any(n.get("address") == here for n in nodes)


def _replica_error(ray_serve) -> str | None:
    """The last exception line a failed replica left in Serve's status (``slimml.errors.ConfigError:
    ...`` becomes its message), where there is one."""
    try:
        status = ray_serve.status().applications.get(APP)
        texts = [d.message for d in status.deployments.values()] + [status.message] if status else []
    except Exception:  # noqa: BLE001 -- no status to read: Serve's own message stands
        return None
    for text in texts:
        lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
        for line in reversed(lines):
            found = re.match(r"(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)", line)
            if found:
                return found.group(2) if found.group(1) in _SLIMML_ERRORS else f"{found.group(1)}: {found.group(2)}"
    return None


_SLIMML_ERRORS = {name for name, kind in vars(errors).items() if isinstance(kind, type) and issubclass(kind, SlimmlError)}


def _delete_app(ray_serve) -> None:
    try:
        ray_serve.delete(APP)
    except Exception as e:  # noqa: BLE001 -- the cluster gone, or the app never deployed: nothing of ours is left
        log.debug("slimml: deleting the Serve application: %s", e)


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

    if not config.memory_budget or kind_of(manifest) != "text-generation" or config.stages:  # stages: the replica
        return None  # holds no model (the stage actors stream it), no KV cache and no prefix store
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


def _check_replica_cpus(config: ServeConfig, nodes: list[dict]) -> None:
    """Refuse, in one line, ``cpus_per_replica`` that the nodes cannot give ``replicas`` replicas
    (a replica lives on one node): Ray never placed them, and the deploy waited with no word."""
    cpus = config.cpus_per_replica
    if not cpus or config.stages:  # stages: the replica asks no CPUs (its stages do)
        return
    fit = sum(int(n["cpus"] / cpus + 1e-9) for n in nodes)
    if fit < config.replicas:
        per_node = ", ".join(f"{n['address']}: {n['cpus']:g} CPUs" for n in nodes)
        raise ConfigError(f"--cpus-per-replica {cpus:g} for {config.replicas} replica(s), but a replica lives on one "
                          f"node and the nodes hold {fit} ({per_node}); lower --cpus-per-replica or --replicas, or add "
                          "nodes (leave --cpus-per-replica out to share each node's CPUs).")


def _direct_ingress(host: str, port: int, config: ServeConfig, address: str | None) -> int:
    """Turn on Ray Serve's direct ingress with the replica's HTTP port pinned to ``port``;
    return a free port for Serve's proxy. Refused, in one line, where it cannot apply."""
    if config.replicas != 1 or address is not None:
        raise ConfigError("direct ingress serves one replica on a Ray that slimml starts itself (one port, no load "
                          "balancer in front); drop --replicas and --address (without --address, Ray still joins the "
                          "cluster RAY_ADDRESS names or a `ray start` on this machine recorded: unset it, or `ray stop` "
                          "that cluster), or drop --direct-ingress.")
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
    from slimml.scale.cluster import free_port

    # where Ray's own processes, starting, do not take it before the proxy binds it; not the replica's
    return free_port(host, avoid=frozenset((port, port + 1)))
