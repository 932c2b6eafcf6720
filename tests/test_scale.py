"""Pipeline stages on a real local Ray cluster of two simulated nodes (``ray.cluster_utils``)."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

from slimml.errors import ConfigError, IntegrityError, SlimmlError, StageError
from slimml.runtime import load
from slimml.scale import split_stages

ray = pytest.importorskip("ray")


def test_split_stages_balances_bytes_and_capacity():
    assert split_stages([10, 10, 10, 10], 2) == [(0, 1), (2, 3)]
    assert split_stages([1, 100, 100, 100, 100, 100, 100, 1], 2) == [(0, 3), (4, 7)]
    assert split_stages([5] * 6, 3, capacities=[1, 1, 2]) == [(0, 0), (1, 1), (2, 5)]
    assert split_stages([7], 1) == [(0, 0)]
    with pytest.raises(ConfigError, match="cannot split 2 shard.* into 3 stages"):
        split_stages([1, 1], 3)
    with pytest.raises(ConfigError, match="one positive capacity per stage"):
        split_stages([1, 1], 2, capacities=[1])


def test_a_stage_loads_only_its_shards_and_chains_to_the_whole(tiny_bert_artifact):
    whole = load(tiny_bert_artifact)
    n = len(whole.manifest.shards)
    head, tail = load(tiny_bert_artifact, shards=(0, 1)), load(tiny_bert_artifact, shards=(2, n - 1))
    assert {f.path for f in head.manifest.files} == {p for s in whole.manifest.shards[:2] for p in (s.file, s.data) if p}
    feeds = whole.tokenize(["a man plays a guitar", "two dogs"])
    mid = head.run(feeds)
    tail.allow_nonfinite = True  # the attention mask activation holds -inf
    out = tail.run({t.name: {**feeds, **mid}[t.name] for t in tail.inputs})
    np.testing.assert_array_equal(out["last_hidden_state"], whole.run(feeds)["last_hidden_state"])
    assert type(tail).__name__ == "Generic"  # its 4-d mask input made it an image embedder
    with pytest.raises(SlimmlError, match=r"cannot encode\(\) on a stage: load\(shards=...\) loads a span of shards, "
                       r"which runs tensors, not its 'sentence-embedding' model; use load\(folder\) without shards= "):
        load(tiny_bert_artifact, shards=(0, n - 1)).encode(["a man plays a guitar"])
    with pytest.raises(Exception, match="not a range of this artifact"):
        load(tiny_bert_artifact, shards=(2, n))


def test_a_free_port_lies_where_starting_ray_does_not_take_it():
    """A port picked by a bind to 0 lay in the kernel's ephemeral range, where Ray's gRPC servers bind a dozen
    ports as Serve starts: taken before the proxy bound it about once in 500 starts (CI failed so once)."""
    import socket

    from slimml.scale.cluster import RAY_WORKER_PORTS_END, free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    if low - RAY_WORKER_PORTS_END <= 1000:
        pytest.skip(f"this machine's ephemeral ports start at {low}: no room between them and Ray's")
    ports = [free_port() for _ in range(50)]
    assert all(RAY_WORKER_PORTS_END < p < low for p in ports) and len(set(ports)) > 40
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free indeed


def test_an_address_where_nothing_answers_is_one_line_at_once():
    """``ray.init`` retried a refused head for minutes (a warning every few seconds, never an error)."""
    from conftest import free_port
    from slimml.scale.cluster import check_reachable  # what connect(address) checks before ray.init

    t = time.perf_counter()
    with pytest.raises(ConfigError, match=r"nothing answers at the Ray address '127\.0\.0\.1:\d+' \(the port refuses "
                                          r"connections\); start the cluster's head there"):
        check_reachable(f"127.0.0.1:{free_port()}")
    assert time.perf_counter() - t < 5
    for left_to_ray in ("auto", "ray://127.0.0.1:1", "garbage"):
        check_reachable(left_to_ray)


def test_a_local_ray_gets_its_token_in_memory_where_home_cannot_keep_it(tmp_path, monkeypatch):
    """A container whose home is read-only or missing: Ray's ``~/.ray/auth_token`` cannot be written,
    and ``ray.init`` failed on it; the token goes to the environment its processes inherit. A home
    that can keep it, a token file there, or a token or mode the user set, is left to Ray."""
    from slimml.scale.cluster import token_in_memory

    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # Ray keeps its token there
    assert not token_in_memory() and "RAY_AUTH_TOKEN" not in os.environ
    (tmp_path / "file").write_text("x")
    for home in (str(tmp_path / "file" / "home"), str(tmp_path / "missing"), ""):  # a file in the way; no home
        monkeypatch.setenv("HOME", home)
        assert token_in_memory() and len(os.environ["RAY_AUTH_TOKEN"]) == 64
        assert not token_in_memory()  # set now: kept
        monkeypatch.delenv("RAY_AUTH_TOKEN")
    (tmp_path / "ray-home" / ".ray").mkdir(parents=True)
    (tmp_path / "ray-home" / ".ray" / "auth_token").write_text("t")
    monkeypatch.setenv("HOME", str(tmp_path / "ray-home"))
    assert not token_in_memory()
    monkeypatch.setenv("HOME", "")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert not token_in_memory() and "RAY_AUTH_TOKEN" not in os.environ


def test_only_a_ray_of_slimmls_own_gets_a_token(tmp_path, monkeypatch):
    """connect() without an address joins RAY_ADDRESS's cluster, or the one `ray start` recorded, as
    ray.init does: a token made up for those would be the wrong one."""
    from slimml.scale.cluster import cluster_address

    def _starts_local():
        return cluster_address(None) is None

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert _starts_local()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")
    assert not _starts_local()
    (tmp_path / "ray" / "ray_current_cluster").unlink()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not _starts_local()


def test_a_web_server_given_as_the_ray_address_is_one_line_not_a_hang(cluster):
    """The dashboard's port (HTTP) given as --address passed the TCP check, then ray.init waited in
    its GCS client for good (over 10 minutes, deaf to Ctrl-C and SIGTERM)."""
    import http.server
    import threading

    from slimml.scale.cluster import check_reachable

    web = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match=r"answers HTTP/1: a web server .* not the cluster's GCS port; give the "
                                              r"port `ray start --head --port PORT` was given"):
            check_reachable(f"127.0.0.1:{web.server_address[1]}")
    finally:
        web.shutdown()
    check_reachable(cluster.address)  # a real GCS passes


CTRL_C_MID_START = """
import os, signal, subprocess, time
import ray, ray._private.services as services
real = services.start_raylet
def start_raylet(*a, **k):  # Ctrl-C while Ray starts: its GCS is up, its raylet not yet
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    return real(*a, **k)
services.start_raylet = start_raylet
from slimml.scale.cluster import connect
try:
    connect()
    print("connected")
except KeyboardInterrupt:
    print("interrupted, initialized", ray.is_initialized())
deadline = time.monotonic() + 30  # Ray's workers leave on their own once the raylet is gone: seconds when busy
while True:
    left = subprocess.run(["pgrep", "-f", os.environ["RAY_TMPDIR"]], capture_output=True, text=True).stdout.split()
    left = [p for p in left if int(p) != os.getpid()]
    if not left or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print("left", len(left))
"""


def test_ctrl_c_while_ray_starts_leaves_none_of_its_processes(ray_env):
    """Ctrl-C in the middle of ``ray.init`` (a notebook, a script that catches it) raised there and left
    the processes Ray had started running beside a process that lives on (seen: 4); now the signal
    waits for the start, and Ray is shut down before it is delivered."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_TMPDIR": str(ray_env / "ctrlc"), "HF_HUB_OFFLINE": "1"}
    (ray_env / "ctrlc").mkdir()
    out = subprocess.run([sys.executable, "-c", CTRL_C_MID_START], env=env, capture_output=True, text=True, timeout=180)
    assert "interrupted, initialized False" in out.stdout and "left 0" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.fixture(scope="module")
def cluster(ray_env):
    """Two nodes of one CPU each, the driver connected; stopped afterwards."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                       "resources": {"node_a": 1}})
    c.add_node(num_cpus=1, resources={"node_b": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def test_pipeline_equals_the_single_process_runtime_on_two_nodes(cluster, tiny_bert_artifact):
    from slimml.scale import pipeline

    local = load(tiny_bert_artifact)
    model = pipeline(tiny_bert_artifact, stages=2, microbatch=3)
    try:
        seg = model.plan.segments[0]
        nodes = [i["node"] for i in seg.stage_info()]
        assert len(set(nodes)) == 2  # STRICT_SPREAD: one stage per node
        assert "2 Ray stage(s)" in model.plan.describe()
        texts = [f"sentence number {i} about {'cats ' * (i % 5)}" for i in range(11)]
        feeds = local.tokenize(texts)
        want, got = local.run(feeds), model.run(feeds)
        np.testing.assert_allclose(got["last_hidden_state"], want["last_hidden_state"], atol=1e-5)
        np.testing.assert_allclose(model.encode(texts, batch_size=4), local.encode(texts, batch_size=4), atol=1e-5)
        stats = seg.stage_stats()
        assert all(s["calls"] >= 3 for s in stats) and all(s["busy_s"] > 0 for s in stats)
        model.check_files()
    finally:
        model.close()
    assert not seg.actors


def test_pipeline_generates_like_the_single_process_runtime(cluster, tiny_llama_past_artifact):
    from slimml.scale import pipeline

    local = load(tiny_llama_past_artifact)
    model = pipeline(tiny_llama_past_artifact, stages=2, microbatch=2)
    try:
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
        assert model.generate(prompts, max_new_tokens=6).tokens == local.generate(prompts, max_new_tokens=6).tokens
        # a stage runs each call once its inputs are there, not in the order the calls were made: a call whose
        # upstream never comes (a cancelled request's) held every later call, /health's too, for Ray's 30 s wait
        import ray

        upstream = ray.remote(num_cpus=0)(lambda: time.sleep(60)).remote()
        waiting = model.plan.segments[0].actors[1].run.remote({}, upstream)
        t0 = time.monotonic()
        ray.get(model.plan.segments[0].actors[1].stats.remote(False), timeout=20)
        assert time.monotonic() - t0 < 10
        ray.cancel(waiting, force=False)
        ray.cancel(upstream, force=True)
    finally:
        model.close()


def test_stages_stream_within_their_budget(cluster, tiny_llama_past_artifact):
    from slimml.scale import pipeline

    local = load(tiny_llama_past_artifact)
    model = pipeline(tiny_llama_past_artifact, stages=2, resident=2)  # K=2 inside each stage
    try:
        plans = [i["plan"] for i in model.plan.segments[0].stage_info()]
        assert any("streamed" in p for p in plans), plans
        prompts = [[5, 6, 7, 8], [9, 10]]
        assert model.generate(prompts, max_new_tokens=4).tokens == local.generate(prompts, max_new_tokens=4).tokens
    finally:
        model.close()


def test_balance_by_node_memory_and_bad_stage_counts(cluster, tiny_bert_artifact):
    from slimml.scale import pipeline

    with pytest.raises(ConfigError, match="into 99 stages"):
        pipeline(tiny_bert_artifact, stages=99)
    with pytest.raises(ConfigError, match="balance must be"):
        pipeline(tiny_bert_artifact, stages=2, balance="vibes")
    model = pipeline(tiny_bert_artifact, stages=2, balance="memory")
    try:
        groups = model.plan.segments[0].groups
        assert groups[0][0] == 0 and groups[-1][1] == len(model.manifest.shards) - 1
    finally:
        model.close()
    for bad, words in (({"cpus_per_stage": -1}, "cpus_per_stage must be a number > 0"),  # was: Ray's raylet died
                       ({"cpus_per_stage": 0}, "cpus_per_stage must be a number > 0"),
                       ({"timeout_s": 0}, "timeout_s must be a number of seconds > 0")):
        with pytest.raises(ConfigError, match=words):
            pipeline(tiny_bert_artifact, stages=2, **bad)
    model = pipeline(tiny_bert_artifact, stages=3)  # 3 stages on 2 CPUs: a share of a CPU each (was 1 each: no room)
    try:
        assert model.plan.segments[0].sessions == 3
        np.testing.assert_allclose(model.encode(["a text"]), load(tiny_bert_artifact).encode(["a text"]), atol=1e-5)
    finally:
        model.close()


def test_closing_one_pipeline_keeps_the_ray_others_share(cluster):
    """slimml's own Ray connection is shared: the last of its users shuts it down (closing the first of
    two pipelines shut Ray down under the second). A connection the caller made is never slimml's."""
    from slimml.scale import cluster as connection

    try:
        connection._holders = 0
        assert connection.connect(None) is False  # the test's own ray.init: the caller's
        connection._holders = 1  # as if slimml had started Ray for a first pipeline
        assert connection.connect(None) is True and connection._holders == 2  # a second pipeline shares it
        assert connection.release_ray() is False and connection.release_ray() is True  # the last one shuts it down
    finally:
        connection._holders = 0


def test_a_dead_stage_is_named_and_comes_back(cluster, tiny_bert_artifact):
    from slimml.scale import pipeline

    local = load(tiny_bert_artifact)
    model = pipeline(tiny_bert_artifact, stages=2, max_restarts=3, timeout_s=60)
    try:
        feeds = local.tokenize(["a dog runs", "a cat sleeps"])
        seg = model.plan.segments[0]
        for attempt in range(3):
            ray.kill(seg.actors[1], no_restart=False)  # the process dies; Ray restarts it
            try:
                model.run(feeds)
            except StageError as e:
                assert re.search(r"pipeline stage 1 \(shards .*\) died.*not retried for you", str(e)), str(e)
                break
            # a call sent once Ray knew of the death waited for the restart and ran: kill it again
        else:
            pytest.fail("three calls right after killing stage 1 all ran on its restarted process")
        deadline = time.monotonic() + 60
        while True:  # the documented recovery: retry once the stage is back
            try:
                out = model.run(feeds)
                break
            except StageError:
                assert time.monotonic() < deadline, "the restarted stage never came back"
                time.sleep(0.5)
        np.testing.assert_allclose(out["last_hidden_state"], local.run(feeds)["last_hidden_state"], atol=1e-5)
    finally:
        model.close()


def test_a_stage_dead_for_good_says_so_not_retry(cluster, tiny_bert_artifact):
    """A stage killed for good (or past max_restarts) said "retry once the stage is back", which never happens."""
    from slimml.scale import pipeline

    model = pipeline(tiny_bert_artifact, stages=2, max_restarts=1, timeout_s=60)
    try:
        feeds = load(tiny_bert_artifact).tokenize(["a dog runs"])
        model.run(feeds)
        ray.kill(model.plan.segments[0].actors[1], no_restart=True)
        with pytest.raises(StageError, match=r"pipeline stage 1 .* died \(\w+\) and will not come back: Ray restarts a "
                                             r"stage at most 1 time\(s\) .* create it again"):
            model.run(feeds)
        with pytest.raises(StageError, match="will not come back"):  # the server's probe: its replica is replaced
            model.check_files()
    finally:
        model.close()


def test_a_tampered_shard_is_refused_by_its_stage(cluster, tiny_bert_artifact, tmp_path):
    import shutil

    from slimml.scale import pipeline

    bad = tmp_path / "bad"
    shutil.copytree(tiny_bert_artifact, bad)
    data = bad / load(tiny_bert_artifact).manifest.shards[-1].data
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="sha256") as e:
        pipeline(bad, stages=2)
    assert type(e.value) is IntegrityError and "\n" not in str(e.value)  # slimml's one line, not Ray's traceback
    assert not [a for a in ray.util.list_named_actors()]  # nothing left behind


def test_verify_rehashes_what_the_driver_reads_too(cluster, tiny_bert_artifact, tmp_path):
    """A pipeline's verify() re-hashed only the stages' shards; the tokenizer this process reads is
    re-hashed as well now (load's verify() always did)."""
    import shutil

    from slimml.scale import pipeline

    art = tmp_path / "art"
    shutil.copytree(tiny_bert_artifact, art)
    model = pipeline(art, stages=2)
    try:
        model.verify()
        with open(art / "tokenizer.json", "a") as f:
            f.write(" ")
        with pytest.raises(IntegrityError, match="tokenizer.json"):
            model.verify()
    finally:
        model.close()


def test_a_ray_start_that_fails_is_one_line(monkeypatch):
    """Ray's own start failing (under load: "The current node timed out during startup") was a raw
    traceback from `slimml serve`; now one line that says what to do."""
    from slimml.errors import SlimmlError
    from slimml.scale import cluster

    def timed_out(*args, **kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the Ray "
                        "processes failed to startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    with pytest.raises(SlimmlError, match=r"^Ray did not start \(The current node timed out during startup.*\); the "
                                          r"machine may be too busy: free some cores"):
        cluster.connect()


def test_a_stop_asked_while_a_start_fails_is_the_stop(monkeypatch):
    """Ctrl-C during a start that then failed was swallowed: the failure ("Ray did not start") came out
    instead of the KeyboardInterrupt."""
    import os
    import signal

    from slimml.scale import cluster

    def interrupted_then_failed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", interrupted_then_failed)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        cluster.connect()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_stages_refuse_a_language_model_with_its_cache_in_place(tiny_llama_past_artifact, tmp_path):
    """A fused decoder (its KV cache in place beside each layer) served with --stages answered every
    /v1/generate with a plain 500 (the cache pass took each stage for a streamed segment)."""
    import json
    import shutil

    from slimml.scale import pipeline
    from slimml.serve import ServeConfig, serve

    art = tmp_path / "art"
    shutil.copytree(tiny_llama_past_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["source"]["exporter"] = "fused"  # what `--exporter fused` records
    (art / "manifest.json").write_text(json.dumps(manifest))
    for start in (lambda: pipeline(art, stages=2), lambda: serve(ServeConfig(str(art), stages=2))):
        with pytest.raises(ConfigError, match="KV cache lives in place beside each layer .* serve it whole"):
            start()


def test_a_server_joining_a_cluster_leaves_what_serves_there_alone(cluster, tiny_bert_artifact):
    """A second `slimml serve --address` on a cluster replaced the first's application (the same
    name, at the same route), said it served on a port nobody listened on, and stopping either
    shut Serve down for both, and for any other application there."""
    import socket
    import threading

    import requests
    from ray import serve as ray_serve

    from conftest import free_port
    from slimml.serve import ServeConfig, serve
    from slimml.serve.run import _serve_port

    @ray_serve.deployment
    class Other:
        def __call__(self, request):
            return "other"

    with socket.socket() as held:  # a port something on this machine (a node of the cluster) listens on
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(ConfigError, match=rf"cannot listen on 127\.0\.0\.1:{held.getsockname()[1]} "):
            serve(ServeConfig(str(tiny_bert_artifact)), port=held.getsockname()[1], address=cluster.address)
    port = free_port()
    ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        ray_serve.run(Other.bind(), name="other", route_prefix="/other")
        with pytest.raises(ConfigError, match=r"already runs application\(s\) other; a second server would replace"):
            serve(ServeConfig(str(tiny_bert_artifact)), port=port, address=cluster.address)
        assert ray_serve.status().applications["other"].status == "RUNNING"  # left alone
        ray_serve.delete("other")
        with pytest.raises(ConfigError, match=rf"already listens on port {port}; give --port {port}"):
            serve(ServeConfig(str(tiny_bert_artifact)), port=free_port(), address=cluster.address)
        urls, stop = [], threading.Event()  # Serve running, no application, the same port: joined, then left
        thread = threading.Thread(target=serve, args=(ServeConfig(str(tiny_bert_artifact)),), daemon=True,
                                  kwargs={"port": port, "address": cluster.address, "ready": urls.append, "stop": stop})
        thread.start()
        deadline = time.monotonic() + 120
        while not urls:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        assert requests.get(f"{urls[0]}/health", timeout=30).status_code == 200
        stop.set()
        thread.join(120)
        assert not thread.is_alive()
        assert "slimml" not in ray_serve.status().applications  # its own application gone, Serve still up
        assert _serve_port() == port
    finally:
        ray_serve.shutdown()


def test_a_server_whose_ray_joins_a_cluster_on_its_own_leaves_what_serves_there_alone(cluster, tiny_bert_artifact):
    """Without --address, ray.init joins the cluster RAY_ADDRESS names (or the one a `ray start` here
    recorded): slimml serve took it for a Ray of its own, skipped the checks --address gets, replaced
    the application serving there, said it served on a port nobody listened on, and shut Serve down
    for the whole cluster when it stopped."""
    import subprocess
    import sys

    from ray import serve as ray_serve

    from conftest import free_port

    @ray_serve.deployment
    class Other:
        def __call__(self, request):
            return "other"

    port = free_port()
    ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        ray_serve.run(Other.bind(), name="other", route_prefix="/other")
        try:
            out = subprocess.run([sys.executable, "-m", "slimml", "serve", str(tiny_bert_artifact), "--port", str(free_port())],
                                 env={**os.environ, "RAY_ADDRESS": cluster.address, "HF_HUB_OFFLINE": "1"},
                                 capture_output=True, text=True, timeout=150)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"slimml serve started on the cluster beside 'other': {e.stderr!s:.2000}")
        assert out.returncode == 1 and re.search(r"Ray Serve on the cluster at \S+ already runs application\(s\) other; ",
                                                 out.stderr), out.stderr[-2000:]
        assert ray_serve.status().applications["other"].status == "RUNNING"  # left alone
    finally:
        ray_serve.shutdown()


def test_cpus_per_replica_no_node_has_is_one_line_not_a_silent_wait(cluster, tiny_bert_artifact):
    """--cpus-per-replica 2 on two 1-CPU nodes: Ray never placed the replica, and serve waited with no
    word (a user's timeout killed it after 100 s)."""
    from slimml.serve import ServeConfig, serve

    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"--cpus-per-replica 2 for 1 replica\(s\), but a replica lives on one node and "
                                          r"the nodes hold 0 \(.*1 CPUs.*\); lower --cpus-per-replica"):
        serve(ServeConfig(str(tiny_bert_artifact), cpus_per_replica=2), address=cluster.address)
    assert time.monotonic() - t0 < 60


def test_an_address_ray_finds_itself_is_checked_as_a_given_one(ray_env):
    """RAY_ADDRESS naming a port nothing listens on: ray.init retried for good (13 minutes, deaf to SIGTERM),
    where --address with the same value is refused in seconds; a parse error named the address None."""
    import subprocess
    import sys

    code = "from slimml.scale.cluster import connect\nconnect()"
    for value, said in (("127.0.0.1:1", r"nothing answers at the Ray address '[0-9.]+:1' \(the port refuses connections\)"
                                        r".*; Ray found that address itself \(RAY_ADDRESS"),
                        ("garbage", r"could not join the Ray cluster at 'garbage' \(RAY_ADDRESS.*unset RAY_ADDRESS too")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAY_ADDRESS": value}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 1 and re.search(said, out.stderr), out.stderr[-1500:]
