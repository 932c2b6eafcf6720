"""The fused decoder graph (``convert --exporter fused``) and the engine's in-place KV cache.

A tiny Llama (head size 16, as GroupQueryAttention needs a multiple of 16) is converted both ways;
the fused graph's greedy tokens must equal the traced (optimum) graph's and transformers', through
``generate`` and through the engine's cache, resident and streamed.
"""

from __future__ import annotations

import numpy as np
import pytest


from conftest import save_tiny_llama
from slimml.errors import ExportError, FeedError, SlimmlError

NEW = 10


@pytest.fixture(scope="module")
def llama16(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama16"), hidden_size=64, intermediate_size=96)  # head size 16


def _convert(folder, out, exporter, quantize=None):
    """``exporter``'s artifact; "optimum" (the traced graph) is torch.onnx's trace where optimum-onnx
    does not load (transformers 5)."""
    from slimml.convert import ConvertConfig, ExportConfig, convert
    from slimml.convert.export import _optimum_loads

    if exporter == "optimum" and _optimum_loads() is not None:
        exporter = "torch"
    return convert(folder, out, ConvertConfig(export=ExportConfig(task="text-generation-with-past", exporter=exporter),
                                              verify=exporter == "fused", measure_latency=False, quantize=quantize))


@pytest.fixture(scope="module")
def arts(llama16, tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_arts")
    reports = {e: _convert(llama16, root / e, e) for e in ("optimum", "fused")}
    return root, reports


def _prompts():
    return np.random.default_rng(0).integers(3, 512, size=(2, 7))


def _greedy_with_cache(model, ids: np.ndarray, new: int) -> list[list[int]]:
    """The loop a task runs on the engine's hook: prompt pass, then one position per token."""
    b, s = ids.shape
    cache = model.kv_cache(batch=b, capacity=s + new)
    logits = cache.step(ids, np.ones((b, s), np.int64))
    out = []
    for t in range(new):
        nxt = logits[:, -1].argmax(-1).astype(np.int64)
        out.append(nxt)
        if t < new - 1:
            logits = cache.step(nxt[:, None], np.ones((b, cache.length + 1), np.int64))
    return np.stack(out, 1).tolist()


def test_fused_matches_torch_and_the_traced_graph(llama16, arts):
    import torch
    from transformers import LlamaForCausalLM

    from slimml.runtime import load

    root, reports = arts
    checks = reports["fused"].checks
    assert checks["top1_agreement"] == 1.0 and checks["max_abs_diff_vs_torch"] < 1e-4
    ids = _prompts()
    old = load(root / "optimum").generate(ids.tolist(), max_new_tokens=NEW, eos_token_id=()).tokens
    fused = load(root / "fused")
    assert fused.generate(ids.tolist(), max_new_tokens=NEW, eos_token_id=()).tokens == old
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(llama16).eval()
        want = hf.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
                           max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, ids.shape[1]:].tolist()
    assert old == want
    ops = {n.op_type for p in sorted((root / "fused").glob("shard_*.onnx")) for n in __import__("onnx").load(
        str(p), load_external_data=False).graph.node}
    assert "GroupQueryAttention" in ops


@pytest.mark.parametrize("resident", [None, 2])
def test_engine_cache_in_place_equals_generate(arts, resident):
    from slimml.runtime import load

    root, _ = arts
    ids = _prompts()
    want = load(root / "optimum").generate(ids.tolist(), max_new_tokens=NEW, eos_token_id=()).tokens
    model = load(root / "fused", resident=resident, pack=False)
    assert _greedy_with_cache(model, ids, NEW) == want
    cache = model.kv_cache(batch=2, capacity=ids.shape[1] + NEW)
    cache.step(ids, np.ones(ids.shape, np.int64))
    assert cache.length == ids.shape[1] and next(iter(cache.buffers.values())).shape == (2, 2, ids.shape[1] + NEW, 16)
    model.close()


@pytest.mark.parametrize("resident", [None, 2])
def test_logits_only_where_they_are_read(arts, resident):
    """A right-padded prompt pass asked for each row's last real position computes one row of
    logits per prompt, equal to the every-position pass's logits there."""
    from slimml.runtime import load

    root, _ = arts
    model = load(root / "fused", resident=resident, pack=False)
    assert any(t.name == "logits_index" for t in model.inputs)
    lens = np.array([7, 4])
    ids = np.where(np.arange(7)[None, :] < lens[:, None], _prompts(), 0)
    mask = (np.arange(7)[None, :] < lens[:, None]).astype(np.int64)
    full = model.kv_cache(batch=2, capacity=8).run(ids, mask)  # (2, 7, vocab)
    last = model.kv_cache(batch=2, capacity=8).run(ids, mask, at=lens - 1)  # (2, vocab)
    assert full.shape[:2] == (2, 7) and last.shape == (2, full.shape[-1])
    np.testing.assert_allclose(last, full[[0, 1], lens - 1], atol=1e-5)
    feeds = {t.name: np.zeros((2, 2, 0, 16), np.float32) for t in model.inputs if t.name.startswith("past_key_values.")}
    feeds |= {"input_ids": ids, "attention_mask": mask}
    for bad in (7, -1):  # a position the pass does not have: one line naming the range, not ONNX Runtime's error
        with pytest.raises(FeedError, match=r"'logits_index' asks for position .*outside this pass's 0\.\.6"):
            model.run(feeds | {"logits_index": np.array([[bad], [0]])})
    over = {n: np.zeros((2, 2, 3, 16), np.float32) for n in feeds if n.startswith("past_key_values.")}
    over |= {"input_ids": ids[:, :2], "attention_mask": np.ones((2, 5), np.int64), "logits_index": np.array([[1], [1]])}
    with pytest.raises(FeedError, match="one row at a time"):  # GroupQueryAttention's rule, said with what to do
        model.run(over)
    model.close()


def _without_logits_index(src, dst):
    """A copy of the fused artifact ``src`` as the release before ``logits_index`` wrote it: logits
    of every position (the gather taken out of its shard, the input out of the manifest)."""
    import hashlib
    import json
    import shutil

    import onnx

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["inputs"] = [t for t in manifest["inputs"] if t["name"] != "logits_index"]
    for shard in manifest["shards"]:
        path = dst / shard["file"]
        graph = onnx.load(str(path), load_external_data=False)
        gather = [n for n in graph.graph.node if n.op_type == "GatherElements"]
        if not gather:
            continue
        taken = {n.output[0] for n in graph.graph.node if "logits_index" in n.name}
        kept = [n for n in graph.graph.node if n.output[0] not in taken]
        for n in kept:
            n.input[:] = [gather[0].input[0] if i == gather[0].output[0] else i for i in n.input]
        del graph.graph.node[:]
        graph.graph.node.extend(kept)
        kept_inputs = [i for i in graph.graph.input if i.name != "logits_index"]
        del graph.graph.input[:]
        graph.graph.input.extend(kept_inputs)
        onnx.save(graph, str(path))
        shard["inputs"] = [t for t in shard["inputs"] if t["name"] != "logits_index"]
        data = path.read_bytes()
        for f in manifest["files"]:
            if f["path"] == shard["file"]:
                f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_artifacts_from_before_logits_index_still_decode(arts, tmp_path):
    """A fused artifact written before ``logits_index`` generates the same tokens, its logits
    picked from every position (prompts of different lengths: the right-padded first pass)."""
    from slimml.runtime import load

    root, _ = arts
    old = load(_without_logits_index(root / "fused", tmp_path / "old"))
    assert not any(t.name == "logits_index" for t in old.inputs)
    prompts = [p[:n] for p, n in zip(_prompts().tolist(), (7, 4))]
    want = load(root / "fused").generate(prompts, max_new_tokens=NEW, eos_token_id=()).tokens
    assert old.generate(prompts, max_new_tokens=NEW, eos_token_id=()).tokens == want


def test_int4_fused_keeps_the_old_graphs_tokens(llama16, tmp_path):
    from slimml.quantize.config import WeightOnlyConfig
    from slimml.runtime import load

    ids = _prompts()
    tokens = {}
    for exporter in ("optimum", "fused"):
        _convert(llama16, tmp_path / exporter, exporter, WeightOnlyConfig(bits=4))
        model = load(tmp_path / exporter)
        tokens[exporter] = model.generate(ids.tolist(), max_new_tokens=NEW, eos_token_id=()).tokens
        if exporter == "fused":  # every shard at the quantizer's opset: the resident model is one session
            assert model.plan.sessions == 1
    assert tokens["fused"] == tokens["optimum"]


def test_cache_refuses_what_does_not_fit(arts):
    from slimml.runtime import load

    root, _ = arts
    assert load(root / "optimum").kv_cache(batch=1, capacity=8) is None  # concatenating graph: no shared buffer
    model = load(root / "fused")
    cache = model.kv_cache(batch=1, capacity=8)
    with pytest.raises(FeedError, match="do not fit a cache of batch 1"):
        cache.step(np.ones((1, 4), np.int64), np.ones((1, 5), np.int64))
    with pytest.raises(FeedError, match="holds 8 positions and is full"):
        cache.step(np.ones((1, 9), np.int64), np.ones((1, 9), np.int64))
    with pytest.raises(FeedError, match="longer than the model's 128"):
        model.kv_cache(batch=1, capacity=500)
    with pytest.raises(FeedError, match=r"rows 1:3: .* do not fit a cache of 1 rows and 8 positions"):
        cache.run(np.ones((2, 1), np.int64), np.ones((2, 2), np.int64), rows=(1, 3))


@pytest.mark.parametrize("exporter", ["fused", "optimum"])
def test_bench_times_a_batched_prefill_of_either_graph(arts, exporter):
    """``slimml bench ART --batch 4 --seq 32`` on the fused graph was refused by ONNX Runtime
    (GroupQueryAttention takes several rows of several tokens only with no cache before them): a
    timed pass of several tokens is a prefill, over no cache; one token is a decode step."""
    from slimml.runtime import load
    from slimml.runtime.tools.bench import bench

    root, _ = arts
    for resident in (None, 2):
        for seq in (32, 1):
            result = bench(load(root / exporter, resident=resident), batch=4, seq=seq, runs=2, warmup=1)
            assert result.p50_ms > 0 and (result.batch, result.seq) == (4, seq)


def _mixed():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 512, size=n).tolist() for n in (7, 3, 11, 1, 5, 9, 2, 4)]


@pytest.mark.parametrize("resident", [None, 2])
def test_prompts_of_different_lengths_are_one_batch_equal_to_each_alone(arts, resident):
    from slimml.runtime import load

    root, _ = arts
    model = load(root / "fused", resident=resident, pack=False)
    prompts = _mixed()
    ends = ()
    for second in (False, True):  # rows that run to the end; then rows that stop early and leave the pass
        alone = [model.generate([p], max_new_tokens=NEW, eos_token_id=ends).tokens[0] for p in prompts]
        batch = model.generate(prompts, max_new_tokens=NEW, eos_token_id=ends)
        assert batch.tokens == alone and batch.passes == NEW
        assert batch.tokens == load(root / "optimum").generate(prompts, max_new_tokens=NEW, eos_token_id=ends).tokens
        ends = ends if second else (alone[0][2], alone[3][5], alone[6][1])
    assert {len(t) for t in batch.tokens} != {NEW}  # some rows did stop early
    model.close()


@pytest.mark.parametrize("exporter", ["fused", "optimum"])
def test_continuous_batch_rows_join_and_leave_each_answer_as_alone(arts, exporter, monkeypatch):
    from collections import deque

    from slimml.runtime import load
    from slimml.runtime.tasks.generation import rows
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    monkeypatch.setattr(rows, "FIRST_CAPACITY", 8)  # the slot buffer grows while rows hold positions
    root, _ = arts
    model = load(root / exporter)
    prompts = _mixed()
    configs = [GenerationConfig(max_new_tokens=6 + i % 5, temperature=0.9 if i % 2 else 0.0, seed=i, eos_token_id=(402,))
               for i in range(len(prompts))]
    alone = [model.generate([p], config=c).tokens[0] for p, c in zip(prompts, configs)]
    batch = ContinuousBatch(model, max_batch=3, prefill_tokens=12)  # 3 rows, at most 12 prompt tokens a step
    waiting = deque(batch.prepare(p, c) for p, c in zip(prompts, configs))
    seqs = list(waiting)
    seqs[5].cancel()  # gone before its turn
    admitted, most = [], 0
    while waiting or batch.rows:
        joining = batch.take(waiting)
        admitted.append(len(joining))
        batch.admit(joining)
        most = max(most, len(batch.rows))
        if seqs[2].tokens and not seqs[2].finish_reason:
            seqs[2].cancel()  # gone mid-answer: its row is freed at the next step
        batch.step()
    assert [s.tokens for i, s in enumerate(seqs) if i not in (2, 5)] == [a for i, a in enumerate(alone) if i not in (2, 5)]
    assert seqs[2].tokens == alone[2][: len(seqs[2].tokens)]
    assert [seqs[i].finish_reason for i in (2, 5, 7)] == ["cancelled", "cancelled", "length"]
    assert most == 3 and max(admitted) <= 3 and batch.cache_bytes == 0 and not batch.rows
    assert batch.passes < sum(len(a) for a in alone)  # passes were shared


def test_fused_refuses_a_head_size_gqa_cannot_run(tiny_llama_dir, tmp_path):
    from slimml.convert.fused_llama import export_fused

    with pytest.raises(ExportError, match=r"multiple of 16, not 8\. Use --exporter optimum\.$"):
        export_fused(tiny_llama_dir, tmp_path / "x")


def _family(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    if name == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True, use_sliding_window=False))
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=None))
    return LlamaForCausalLM(LlamaConfig(**shape, rope_theta=500000.0, rope_scaling={  # Llama 3's RoPE scaling
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}))


@pytest.mark.parametrize("name", ["qwen2", "mistral", "llama3-rope"])
def test_fused_families_match_torch(name, tmp_path):
    import onnxruntime as ort
    import torch

    from slimml.convert.fused_llama import export_fused

    torch.manual_seed(0)
    model = _family(name).eval()
    model.save_pretrained(tmp_path / "hf")
    session = ort.InferenceSession(str(export_fused(tmp_path / "hf", tmp_path / "onnx")), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(3, 512, size=(2, 40))  # past original_max_position_embeddings
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    feeds |= {f"past_key_values.{i}.{kv}": np.zeros((2, 2, 0, 16), np.float32) for i in range(2) for kv in ("key", "value")}
    feeds["logits_index"] = np.broadcast_to(np.arange(40), (2, 40)).copy()  # every position's logits
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(session.run(["logits"], feeds)[0] - want).max() < 1e-4


def test_fp16_keeps_the_cache_in_fp16_bound_in_place(arts, tmp_path):
    """``--quantize fp16`` makes the KV cache's inputs and outputs fp16 (not fp32 with a Cast of the
    whole cache each pass): the engine's buffers are the ones attention reads and writes, at half
    the memory. The artifact runs on CPU too, its greedy tokens the fp32 artifact's."""
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config
    from slimml.runtime import load

    root, _ = arts
    quantize(root / "fused", tmp_path / "fp16", scheme_config("fp16", target="cuda"))
    model = load(tmp_path / "fp16")
    cache = {t.name: t.dtype for t in [*model.manifest.inputs, *model.manifest.outputs]
             if t.name.startswith(("past_key_values.", "present."))}
    assert cache and set(cache.values()) == {"float16"}
    assert {t.dtype for t in model.manifest.inputs if t.name in ("input_ids", "attention_mask")} == {"int64"}
    assert next(t.dtype for t in model.manifest.outputs if t.name == "logits") == "float32"
    kv = model.kv_cache(batch=1, capacity=8)
    assert {b.dtype for b in kv.buffers.values()} == {np.dtype("float16")}
    prompts = _prompts().tolist()
    assert model.generate(prompts, max_new_tokens=NEW).tokens == load(root / "fused").generate(prompts, max_new_tokens=NEW).tokens
