"""Concurrent streaming chat clients against slimml's OpenAI server and llama-cpp-python's.

    python benchmarks/bench_llm_serve.py --artifact ART --gguf FILE.gguf [--budget third|200MB|none]
        [--prepare DIR --source HF_FOLDER] [--clients 1 4 16] [--requests 2] [--max-tokens 64]
        [--rounds 2] [--max-seconds 300] [--threads 2] [--quick] [--out benchmarks/results/llm_serve.json]

Each system runs as its users run it, in its own process, one server at a time, on 127.0.0.1,
and the systems take turns (``--rounds`` rounds, each starting every system afresh, the order
reversed every other round):

- ``slimml``: ``slimml serve ART --max-running 16`` (Ray Serve, continuous batching), the model resident;
- ``slimml-streamed``: the same with ``--memory-budget`` (``third``: a third of the weight bytes,
  what the user of a small machine would give; the rest streams, each pass shared by the batch);
  with ``--cap 1300MB`` (root, cgroup v1) inside a memory cgroup of that size around the server and
  every process it starts (Ray's own hold ~850 MB), started cold: the weights come from the disk;
- ``llama.cpp``: ``python -m llama_cpp.server --model FILE.gguf --n_threads T --n_ctx 2048
  --chat_format zephyr --interrupt_requests False`` (llama-cpp-python's own OpenAI server; by
  default a new request cuts the running stream short, so users with several clients turn that
  off, and the server answers them one at a time).

For each N in ``--clients``, N threads of the ``openai`` client each send ``--requests`` streaming
chat requests back to back (``max_tokens`` each, temperature 0, the same prompts for every system).
Both servers must see the same prompt ids: the artifact's chat template writes what llama.cpp's
``--chat_format zephyr`` writes, and both tokenizers must agree. For a random-weight model whose
vocabulary is a placeholder (no byte tokens, which llama.cpp's tokenizer needs), ``--prepare DIR``
first writes copies of the artifact (weights linked) and of the GGUF (tensors copied) sharing one
byte-fallback vocabulary and that template, and serves those.

Reported per system and N: aggregate output tokens/s (all clients' tokens over the wall time; the
median over rounds), time to first token p50/p99 and inter-token latency p50/p99 (all rounds'
requests pooled), and the finish reasons: ``length`` is a whole answer, ``stop`` one that ended
early (counted in ``short_answers``), ``cut`` one still streaming when the run reached
``--max-seconds`` (its tokens so far count). Tokens are counted from ``usage`` where the server
sends it (``stream_options.include_usage``), else one per content chunk. Ratios: the most over the
fewest clients for each system, and each slimml over llama.cpp at the most clients.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from slimml.scale.cluster import free_port  # where starting Ray does not take it first

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["Tell me about the history of Paris.", "Write a short poem about the sea.",
           "Explain how a bicycle works.", "What should I cook tonight?", "Describe a walk in a forest.",
           "Why is the sky blue?", "Give me three tips for learning a language.", "Summarise the plot of Hamlet."]


# Zephyr's chat format exactly as llama-cpp-python's chat_format "zephyr" writes it, for the artifact
ZEPHYR = """{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | first | default('') -%}
<|system|>
{{ system }}</s>
{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}<|user|>
{% else %}<|assistant|>
{% endif %}

{{ m['content'] }}</s>
{% endfor %}<|assistant|>


"""


def pieces(vocab_size: int) -> list[str]:
    """A Llama-style vocabulary both tokenizers read alike: <unk> <s> </s>, the 256 byte tokens,
    then placeholder words. With no merges, text becomes its UTF-8 bytes in both (SentencePiece's
    byte fallback), so a prompt is the same ids on either server."""
    return ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *(f"\u2581w{i}" for i in range(259, vocab_size))]


def prepare(source: Path, gguf_in: Path, artifact_in: Path, out: Path) -> tuple[Path, Path]:
    """Copies of a random-weight model's artifact and GGUF that share one real vocabulary and
    the Zephyr chat template (the stock placeholder vocabulary has no byte tokens, which
    llama.cpp's tokenizer needs). The weights are linked (artifact) or copied (GGUF) as they are."""
    import hashlib

    import gguf
    from bench_llm_quality import write_gguf_tensors  # this folder's llama.cpp file helpers

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    names = pieces(vocab_size)
    art = out / "artifact"
    art.mkdir(exist_ok=True)
    manifest = json.loads((artifact_in / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["path"].startswith("shard_") and not (art / f["path"]).exists():
            try:
                os.link(artifact_in / f["path"], art / f["path"])
            except OSError:
                import shutil

                shutil.copy2(artifact_in / f["path"], art / f["path"])
    special = [{"id": i, "content": names[i], "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i in range(3)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
                 "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                                    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
                 "pre_tokenizer": None,
                 "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                                            {"Sequence": {"id": "A", "type_id": 0}}],
                                    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                                    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
                 "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                                              {"type": "ByteFallback"}, {"type": "Fuse"},
                                                              {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
                 "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                           "vocab": {p: i for i, p in enumerate(names)}, "merges": []}}
    (art / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (art / "chat_template.jinja").write_text(ZEPHYR)
    manifest["files"] = [f for f in manifest["files"] if f["path"].startswith("shard_")]
    for name in ("tokenizer.json", "chat_template.jinja"):
        data = (art / name).read_bytes()
        manifest["files"].append({"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest["tokenizer"] = {"file": "tokenizer.json", "max_length": 2048, "chat_template": "chat_template.jinja"}
    manifest["name"] = source.name + "-int4"
    (art / "manifest.json").write_text(json.dumps(manifest, indent=1))

    reader = gguf.GGUFReader(str(gguf_in))
    gguf_out = out / (gguf_in.stem + "-vocab.gguf")
    writer = gguf.GGUFWriter(str(gguf_out), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith(("GGUF.", "tokenizer.")):
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(names)
    writer.add_token_scores([0.0] * len(names))
    T = gguf.TokenType
    writer.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * (len(names) - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    write_gguf_tensors(writer, reader)
    return art, gguf_out


def weight_bytes(artifact: Path) -> int:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return sum(f["bytes"] for f in manifest["files"] if ".onnx" in f["path"])


def command(kind: str, args, port: int) -> list[str]:
    if kind.startswith("slimml"):
        cmd = [args.slimml_python, "-m", "slimml", "serve", str(args.artifact), "--port", str(port),
               "--max-running", str(max(args.clients)), "--max-waiting", "64"]
        return cmd + (["--memory-budget", args.budget] if kind == "slimml-streamed" else []) + (
            ["--direct-ingress"] if kind == "slimml-direct" else [])
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf), "--n_threads", str(args.threads),
            "--n_ctx", str(args.n_ctx), "--chat_format", args.template, "--interrupt_requests", "False",
            "--host", "127.0.0.1", "--port", str(port)]


def start(cmd: list[str], threads: int, log: Path, group=None) -> subprocess.Popen:
    """The server, in its own session (and inside ``group``, a memory cgroup, with all it starts)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    # run from the log's folder: `python -m slimml` imports the interpreter's own slimml, not one in our working folder
    return subprocess.Popen(cmd, env=env, cwd=log.parent, stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                            start_new_session=True, preexec_fn=group.enter if group is not None else None)


def capped(cap: str | None):
    """A memory cgroup of ``cap`` around the streamed server and every process it starts (Ray's
    too), the page cache dropped first so its weights come from the disk; None without a cap."""
    if cap is None:
        return None
    from bench_llm_stream import Cgroup  # this folder's cgroup v1 helper (root)

    from slimml.runtime.engine.budget import parse_bytes

    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("1")
    return Cgroup(parse_bytes(cap))


def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server did not start within {timeout:g} s; its log: {log}")


def stop(proc: subprocess.Popen) -> None:
    """End the server and everything it started (its process group: Ray's processes too)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def release(group) -> None:
    """End what is left in ``group`` (Ray's processes outside the server's process group), say its
    peak, and remove it."""
    print(f"cgroup peak {group.peak()['peak_bytes'] / 1e6:.0f} MB of {group.limit / 1e6:.0f} MB", flush=True)
    for pid in (group.path / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    group.__exit__(None, None, None)


def one_request(client, model: str, prompt: str, max_tokens: int, deadline: float, open_streams: set) -> dict:
    """One streamed chat; closed at ``deadline`` (then ``cut``, its tokens counted as chunks): by
    this thread at its next chunk, or by :func:`clients_run`'s watchdog while it waits for one."""
    t0 = time.perf_counter()
    times, tokens, finish, cut = [], None, None, False
    try:
        stream = client.with_options(timeout=max(1.0, deadline - time.monotonic())).chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        open_streams.add(stream)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if getattr(chunk, "usage", None):
                tokens = chunk.usage.completion_tokens
            if time.monotonic() > deadline and finish is None:
                stream.close()
                cut = True
                break
    except Exception as e:  # a read that timed out at the deadline is a cut answer, anything else an error
        if time.monotonic() < deadline - 0.5:
            raise
        del e
        cut = True
    finally:
        open_streams.discard(locals().get("stream"))
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - t0 if times else None, "gaps": gaps, "tokens": tokens if tokens is not None else len(times),
            "from_usage": tokens is not None, "finish": "cut" if cut else finish}


def clients_run(port: int, model: str, clients: int, requests: int, max_tokens: int, seconds: float,
                ramp: float = 0.0) -> dict:
    """``clients`` threads, each sending ``requests`` streamed chats back to back, within ``seconds``;
    client ``c`` sends its first after ``c * ramp / clients`` seconds (0: all at once, a burst)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(c: int) -> None:
        time.sleep(c * ramp / clients)
        for r in range(requests):
            if time.monotonic() > deadline:
                return
            try:
                out = one_request(client, model, PROMPTS[(c + r) % len(PROMPTS)], max_tokens, deadline, open_streams)
            except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                with lock:
                    errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                continue
            with lock:
                results.append(out)

    open_streams: set = set()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for stream in list(open_streams):  # still waiting at the deadline (a server answering one at a time)
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - closing a stream another thread reads may race; it is cut either way
            pass
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "results": results,
            "errors": errors}


def model_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def summary(runs: list[dict], max_tokens: int) -> dict:
    """One system at one N: the median rate over rounds, latencies pooled over rounds."""
    import numpy as np

    results = [r for run in runs for r in run["results"]]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 4) if xs else None  # noqa: E731
    finishes: dict[str, int] = {}
    for r in results:
        finishes[str(r["finish"])] = finishes.get(str(r["finish"]), 0) + 1
    rates = [run["tokens_per_s"] for run in runs]
    return {"clients": runs[0]["clients"], "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": round(statistics.median(rates), 2), "tokens_per_s_rounds": [round(x, 2) for x in rates],
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
            "finish_reasons": finishes, "cut_at_deadline": finishes.get("cut", 0),
            "short_answers": sum(r["tokens"] < max_tokens and r["finish"] != "cut" for r in results),
            "tokens_from_usage": all(r["from_usage"] for r in results),
            "errors": [e for run in runs for e in run["errors"]]}


def ratios(systems: dict[str, list[dict]], clients: list[int]) -> dict:
    lo, hi = min(clients), max(clients)
    out: dict = {}
    for kind, rows in systems.items():
        by = {r["clients"]: r for r in rows}
        out[kind] = {f"tokens_per_s_{hi}_over_{lo}": _ratio(by[hi]["tokens_per_s"], by[lo]["tokens_per_s"]),
                     f"ttft_p99_{hi}_over_{lo}": _ratio(by[hi]["ttft_p99_s"], by[lo]["ttft_p99_s"])}
    if "llama.cpp" in systems:
        ref = {r["clients"]: r for r in systems["llama.cpp"]}[hi]["tokens_per_s"]
        for kind in systems:
            if kind != "llama.cpp":
                mine = {r["clients"]: r for r in systems[kind]}[hi]["tokens_per_s"]
                out[kind][f"tokens_per_s_vs_llama_cpp_at_{hi}"] = _ratio(mine, ref)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True, help="slimml with-past artifact with a tokenizer and chat template")
    ap.add_argument("--budget", default="third",
                    help="--memory-budget of the streamed run, e.g. 200MB; 'third': a third of the weights; 'none': no streamed run")
    ap.add_argument("--gguf", type=Path, default=None, help="the same model and bits as GGUF, for llama-cpp-python's server")
    ap.add_argument("--cap", default=None,
                    help="run the streamed server inside a memory cgroup of this size around all its processes "
                         "(e.g. 1300MB; root, cgroup v1), cold: a model larger than the memory it has")
    ap.add_argument("--template", default="zephyr", help="llama.cpp's --chat_format (the artifact's template must match it)")
    ap.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's --n_ctx (the model's context)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ramp", type=float, default=0.0,
                    help="seconds over which the N clients start (0: all at once); e.g. 4 for arrivals spread as a "
                         "running service sees them")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every system, alternated")
    ap.add_argument("--max-seconds", type=float, default=300,
                    help="each (system, clients) run is closed after this long: answers still streaming are cut "
                         "and counted as made (finish 'cut'), so a slow server bounds the run, not hangs it")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's --n_threads (slimml takes Ray's CPUs)")
    ap.add_argument("--systems", nargs="+", default=None, help="a subset of: slimml slimml-streamed llama.cpp slimml-direct (--direct-ingress: no Serve proxy)")
    ap.add_argument("--prepare", type=Path, default=None, metavar="DIR",
                    help="first write, into DIR, copies of --artifact and --gguf sharing one byte-fallback vocabulary "
                         "and the Zephyr template (for random-weight models with a placeholder vocabulary), and serve those")
    ap.add_argument("--source", type=Path, default=None, help="with --prepare: the HF folder (its config's vocab_size)")
    ap.add_argument("--slimml-python", default=sys.executable,
                    help="the interpreter that runs `slimml serve` (another checkout's venv; default: this one)")
    ap.add_argument("--quick", action="store_true", help="one round, one request of 32 tokens per client")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "llm_serve.json")
    args = ap.parse_args()
    args.artifact, args.gguf = args.artifact.resolve(), args.gguf.resolve() if args.gguf else None
    if args.quick:
        args.rounds, args.requests, args.max_tokens, args.max_seconds = 1, 1, 32, min(args.max_seconds, 90)
    if args.prepare is not None:
        art, gguf_file = args.prepare / "artifact", args.prepare / (args.gguf.stem + "-vocab.gguf")
        if not (art / "manifest.json").exists() or not gguf_file.exists():
            art, gguf_file = prepare(args.source, args.gguf, args.artifact, args.prepare)
        args.artifact, args.gguf = art, gguf_file
    if args.budget == "third":
        args.budget = f"{weight_bytes(args.artifact) // 3 // 1_000_000}MB"
    systems = args.systems or (["slimml"] + (["slimml-streamed"] if args.budget != "none" else [])
                               + (["llama.cpp"] if args.gguf else []))
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_llm_serve"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, list[dict]]] = {k: {n: [] for n in args.clients} for k in systems}
    commands = {k: " ".join(command(k, args, 0)).replace(" --port 0", "") for k in systems}
    t_start = time.time()
    for rnd in range(args.rounds):
        for kind in systems if rnd % 2 == 0 else systems[::-1]:  # alternated: neither always first
            port = free_port()
            log = logs / f"{kind}.log"
            group = capped(args.cap) if kind == "slimml-streamed" else None
            if group is not None:
                group.__enter__()
            proc = start(command(kind, args, port), args.threads, log, group)
            try:
                wait_ready(port, proc, log)
                name = model_name(port)
                clients_run(port, name, 1, 1, 4, args.max_seconds)  # warm-up, not counted
                for n in args.clients:
                    run = clients_run(port, name, n, args.requests, args.max_tokens, args.max_seconds, args.ramp)
                    runs[kind][n].append(run)
                    print(f"round {rnd + 1} {kind:16s} clients {n:3d}: {run['tokens_per_s']:7.1f} tok/s "
                          f"({run['tokens']} tokens in {run['wall_s']:.1f} s, {len(run['errors'])} errors)", flush=True)
            finally:
                stop(proc)
                if group is not None:
                    release(group)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "commands": commands,
              "seconds": round(time.time() - t_start), "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
              "systems": {k: [summary(runs[k][n], args.max_tokens) for n in args.clients] for k in systems}}
    report["ratios"] = ratios(report["systems"], args.clients)
    for kind, rows in report["systems"].items():
        for r in rows:
            print(f"{kind:16s} clients {r['clients']:3d}: {r['tokens_per_s']:7.1f} tok/s, TTFT p50 {r['ttft_p50_s']} s "
                  f"p99 {r['ttft_p99_s']} s, ITL p50 {r['itl_p50_s']} s p99 {r['itl_p99_s']} s, "
                  f"finish {r['finish_reasons']}, short {r['short_answers']}, errors {len(r['errors'])}")
    print(json.dumps(report["ratios"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
