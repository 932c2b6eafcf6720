"""A decoder bigger than memory (forced here by a small ``available_memory``) is still written by the
fused exporter, with its KV cache, and checked without ever being whole in memory: torch one layer
at a time, the artifact streamed. The sharder links the exporter's per-layer data files instead of
copying them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from slimml.convert import ConvertConfig, convert
from slimml.convert.llm_check import SAMPLE_TEXT
from slimml.runtime import load

FUSED = "fused (slimml, GroupQueryAttention)"


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory):
    """A 3-layer Llama (head size 16, as GroupQueryAttention needs) and a word-level tokenizer of the
    built-in evaluation text, so that the perplexity check runs too."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("big_llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    words = sorted(set(SAMPLE_TEXT.split()))[:500]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}))
    return folder, model


@pytest.fixture
def small_memory(monkeypatch, llama_with_tokenizer):
    """A machine whose available memory is twice the model's weights: a third of it is too little."""
    from slimml.convert.weights import weight_bytes
    from slimml.runtime.engine import budget

    folder, _ = llama_with_tokenizer
    monkeypatch.setattr(budget, "available_memory", lambda: 2 * weight_bytes(folder))


def test_a_decoder_bigger_than_memory_gets_the_fused_graph_checked_layer_by_layer(llama_with_tokenizer, small_memory,
                                                                                 tmp_path):
    import torch

    folder, model = llama_with_tokenizer
    report = convert(folder, tmp_path / "art", ConvertConfig())
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert report.task == manifest["task"] == "text-generation-with-past"  # with its KV cache
    assert next(s for s in manifest["steps"] if s["step"] == "export")["exporter"] == FUSED
    assert any(t["name"] == "past_key_values.0.key" for t in manifest["inputs"])
    checks = report.checks
    assert checks["reference"] == "torch, layer by layer (bigger than memory), empty cache"
    assert checks["artifact_run"].startswith("streamed (memory_budget ")
    assert checks["top1_agreement"] == 1.0 and checks["cosine_vs_torch"] > 0.99999
    assert abs(checks["perplexity_rel_diff"]) < 1e-4  # the held-out text, torch also layer by layer
    assert checks["latency_note"].startswith("not measured: bigger than a third of the memory available")

    ids = np.random.default_rng(0).integers(3, 512, size=(1, 9))
    with torch.no_grad():
        want = model.generate(torch.tensor(ids), attention_mask=torch.ones(1, 9, dtype=torch.long), max_new_tokens=8,
                              do_sample=False, pad_token_id=0)[0, 9:].tolist()
    art = load(tmp_path / "art", memory_budget="1GB")
    try:
        assert art.generate(ids.tolist(), max_new_tokens=8, eos_token_id=()).tokens[0] == want
    finally:
        art.close()


def test_a_cache_free_request_bigger_than_memory_stays_layer_by_layer(llama_with_tokenizer, small_memory, tmp_path):
    from slimml.convert.export import ExportConfig, _layerwise

    folder, _ = llama_with_tokenizer
    assert _layerwise(folder, ExportConfig(task="text-generation"))  # cache-free asked for: the layerwise template
    assert not _layerwise(folder, ExportConfig(task="text-generation-with-past"))  # fused writes it, with its cache


def test_the_sharder_links_each_layers_data_file_instead_of_copying_it(llama_with_tokenizer, tmp_path):
    from slimml.convert.fused_llama import export_fused
    from slimml.convert.shard import shard

    folder, _ = llama_with_tokenizer
    path = export_fused(folder, tmp_path / "onnx")
    assert sorted(p.name for p in (tmp_path / "onnx").glob("*.data")) == [
        "model.embed.data", "model.head.data", "model.layers.0.data", "model.layers.1.data", "model.layers.2.data"]
    (tmp_path / "art").mkdir()
    specs = shard(path, tmp_path / "art")
    assert len(specs) == 5
    for spec, group in zip(specs, ["embed", "layers.0", "layers.1", "layers.2", "head"]):
        assert os.stat(tmp_path / "art" / spec.data).st_ino == os.stat(tmp_path / "onnx" / f"model.{group}.data").st_ino


def test_int4_of_a_decoder_bigger_than_memory_runs_its_guard_streamed(llama_with_tokenizer, small_memory, tmp_path):
    from slimml.quantize.config import QuantizeOptions

    folder, _ = llama_with_tokenizer
    config = ConvertConfig(quantize=QuantizeOptions(scheme="int4-weights", target="cpu").to_config(), measure_latency=False)
    report = convert(folder, tmp_path / "int4", config)
    assert report.task == "text-generation-with-past"
    assert report.checks["quantize_drop_metric"] == "perplexity_increase_pct"  # the guard's passes, shard by shard
    assert report.checks["quantize_top1_agreement"] > 0.5
    art = load(tmp_path / "int4", memory_budget="1GB")
    try:
        assert len(art.generate([[5, 6, 7]], max_new_tokens=4, eos_token_id=()).tokens[0]) == 4
    finally:
        art.close()


def test_a_decoder_under_max_drop_searches_its_shards_by_perplexity(llama_with_tokenizer, tmp_path):
    """``--max-drop`` on a language model: when the drop is over it, the search for shards to keep
    float measures each by perplexity, as the drop is measured (it crashed once the classifier
    guard came in)."""
    from slimml.quantize import quantize
    from slimml.quantize.config import GuardConfig, scheme_config

    folder, _ = llama_with_tokenizer
    convert(folder, tmp_path / "f32", ConvertConfig(measure_latency=False))
    config = scheme_config("int4-weights")
    config.guard = GuardConfig(max_drop=0.0, keep_best=True, max_float_shards=1)
    report = quantize(tmp_path / "f32", tmp_path / "int4", config)
    assert report.checks["drop_metric"] == "perplexity_increase_pct" and "max_drop_met" in report.checks
