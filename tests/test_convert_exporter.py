"""Which exporter ``convert`` picks by default (``--exporter auto``).

A decoder the fused exporter can write (Llama, Mistral without a sliding window, Qwen2; head size a
multiple of 16) is written as ONNX Runtime's fused graph with its KV cache, with the default task
too: a causal LM is converted to generate, and generating wants the cache. Anything fused cannot
write falls back to optimum-onnx with the reason in the report, never a failure.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from slimml.convert import ConvertConfig, ExportConfig, convert
from slimml.runtime import load

FUSED = "fused (slimml, GroupQueryAttention)"


def _llama(folder, head_dim: int = 16, **extra):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def _export_step(out) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return next(s for s in manifest["steps"] if s["step"] == "export")


def test_default_convert_of_a_llama_writes_the_fused_graph_with_its_cache(tmp_path):
    import torch

    model = _llama(tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.task == "text-generation-with-past"
    assert _export_step(tmp_path / "art")["exporter"] == FUSED
    assert "exporter_note" not in report.checks
    assert report.checks["top1_agreement"] == 1.0 and report.checks["cosine_vs_torch"] > 0.99999



    ids = np.random.default_rng(0).integers(3, 512, size=(1, 9))
    with torch.no_grad():
        want = model.generate(torch.tensor(ids), attention_mask=torch.ones(1, 9, dtype=torch.long), max_new_tokens=8,
                              do_sample=False, pad_token_id=0)[0, 9:].tolist()
    art = load(tmp_path / "art")
    try:
        assert art.generate(ids.tolist(), max_new_tokens=8, eos_token_id=()).tokens[0] == want
    finally:
        art.close()


def test_with_past_falls_back_to_optimum_with_the_reason(tiny_llama_dir, tmp_path):
    """tiny_llama_dir's head size is 8: GroupQueryAttention cannot run it, optimum can (or, where
    optimum-onnx does not load, under transformers 5, the torch exporter)."""
    from slimml.convert.export import _optimum_loads

    report = convert(tiny_llama_dir, tmp_path / "art", ConvertConfig(export=ExportConfig(task="text-generation-with-past"),
                                                                    measure_latency=False, verify=False))
    assert report.task == "text-generation-with-past"
    step = _export_step(tmp_path / "art")
    traced, name = ("optimum-onnx", "optimum-onnx") if _optimum_loads() is None else ("torch.onnx", "torch.onnx.export")
    assert step["exporter"] == traced
    assert "multiple of 16, not 8" in step["note"] and step["note"].endswith(f"exported with {name}")
    assert report.checks["exporter_note"] == step["note"]


def test_a_llama_fused_does_not_write_falls_back_and_matches_torch(tmp_path):
    """An activation fused does not write (ReLU): optimum's graph with its KV cache (generating wants it),
    checked against torch."""
    _llama(tmp_path / "hf", hidden_act="relu")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.task == "text-generation-with-past"
    assert "SiLU MLPs" in report.checks["exporter_note"] and report.checks["exporter_note"].endswith("with its KV cache")
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    art = load(tmp_path / "art")
    try:
        assert any(t.name.startswith("past_key_values") for t in art.manifest.inputs)
        assert len(art.generate([[5, 9, 11]], max_new_tokens=4, eos_token_id=()).tokens[0]) == 4
    finally:
        art.close()


@pytest.mark.parametrize("task", ["text-generation", "auto"])
def test_auto_keeps_optimum_where_fused_does_not_apply(tmp_path, tiny_bert_dir, task):
    from slimml.convert.export import _auto_fused

    _llama(tmp_path / "hf")
    if task == "text-generation":  # a cache-free graph asked for by name: optimum's, no note
        assert _auto_fused(tmp_path / "hf", task) == (False, None)
    else:  # not a decoder: nothing to say
        assert _auto_fused(tiny_bert_dir, task) == (False, None)
    assert _auto_fused(tmp_path / "hf", "text-generation-with-past") == (True, None)


def test_exporter_optimum_still_traces_a_llama_fused_could_write(tmp_path):
    from slimml.convert.export import _optimum_loads

    if _optimum_loads() is not None:
        pytest.skip("optimum-onnx does not load with this transformers")
    _llama(tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(
        export=ExportConfig(task="text-generation-with-past", exporter="optimum"), measure_latency=False, verify=False))
    assert _export_step(tmp_path / "art")["exporter"] == "optimum-onnx"
    assert report.task == "text-generation-with-past" and "exporter_note" not in report.checks
    # without --task too: generating wants the cache (it was the cache-free graph, silently)
    report = convert(tmp_path / "hf", tmp_path / "auto", ConvertConfig(
        export=ExportConfig(exporter="optimum"), measure_latency=False, verify=False))
    assert report.task == "text-generation-with-past" and _export_step(tmp_path / "auto")["exporter"] == "optimum-onnx"
