"""Decoders the fused exporter does not write, traced with their KV cache by the torch exporter
(``convert/export_torch_decoder.py``), with the installed transformers (4.57 or 5).

Each tiny random model is converted and must generate what transformers' own ``generate`` gives,
for a batch of two prompts of different lengths (the left padding, the cache fed back every token).
What sets each family apart: GPT-2 (learned positions, Conv1D), GPT-NeoX (partial rotary, parallel
residual), Phi (LayerNorm, partial rotary, biases), Falcon (grouped KV heads), Cohere (interleaved
rotary through ``repeat_interleave``), BLOOM (ALiBi, no positions), StarCoder2 (optimum-onnx 0.1.0
does not know it: ``--exporter auto`` falls back to this exporter under 4.57 too).
"""

from __future__ import annotations

import json

import pytest

from slimml.errors import ExportError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 300
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=128, initializer_range=0.3)
FAMILIES = {
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=0.3),
    "gpt_neox": dict(SMALL, rotary_pct=0.25),
    "phi": dict(SMALL, partial_rotary_factor=0.5),
    "falcon": dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                   num_kv_heads=2, initializer_range=0.3),
    "cohere": dict(SMALL, num_key_value_heads=2),
    "bloom": dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.3),
    "starcoder2": dict(SMALL, num_key_value_heads=2),
}
PROMPTS = [[5, 9, 13, 2, 7, 30, 41], [11, 4]]


def _save(name: str, folder, **extra) -> object:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not hasattr(transformers.models, name):
        pytest.skip(f"this transformers has no {name}")
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **{**FAMILIES.get(name, SMALL), **extra})
    model = AutoModelForCausalLM.from_config(config).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    return model


def _expected(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_decoder_fused_does_not_write_generates_as_transformers(name, tmp_path):
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig
    from slimml.runtime import load

    model = _save(name, tmp_path / "hf")
    exporter = "auto" if name == "starcoder2" else "torch"
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter=exporter),
                                                                      measure_latency=False))
    assert report.task == "text-generation-with-past"
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    steps = json.loads((tmp_path / "art" / "manifest.json").read_text())["steps"]
    assert next(s for s in steps if s["step"] == "export")["exporter"] == "torch.onnx"
    art = load(tmp_path / "art")
    try:
        got = art.generate(PROMPTS, max_new_tokens=8, eos_token_id=()).tokens
    finally:
        art.close()
    assert got == [_expected(model, p, 8) for p in PROMPTS]


def test_without_the_cache_too(tmp_path):
    """``--task text-generation --exporter torch``: the cache-free graph, each token over the whole sequence."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig
    from slimml.runtime import load

    model = _save("gpt_neox", tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(
        export=ExportConfig(exporter="torch", task="text-generation"), measure_latency=False))
    assert report.task == "text-generation"
    art = load(tmp_path / "art")
    try:
        assert not [i for i in art.engine.inputs if i.name.startswith("past_key_values.")]
        assert art.generate(PROMPTS, max_new_tokens=6, eos_token_id=()).tokens == [_expected(model, p, 6) for p in PROMPTS]
    finally:
        art.close()


def test_a_mixture_of_experts_is_refused_in_one_line(tmp_path):
    """Tracing would record the experts the example routes to: refused by name, nothing written."""
    from slimml.convert import ConvertConfig, convert

    _save("mixtral", tmp_path / "hf", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ExportError, match=r"^mixture-of-experts decoders \(num_local_experts: 4\) are not written by "
                                          r"slimml's exporters yet .*; convert a model slimml's exporters write, or "
                                          r"export this one to ONNX yourself and convert the .onnx file\.$"):
        convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not (tmp_path / "art").exists()


def test_continuous_batching_shares_passes_and_keeps_each_answer(tmp_path):
    """The server's batch (rows joining and leaving a running batch, the cache fed back per row) on a
    traced decoder: every answer equals the one it gets alone, greedy and seeded-sampled."""
    from collections import deque

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.export import ExportConfig
    from slimml.runtime import load
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    _save("phi", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter="torch"), measure_latency=False,
                                                             verify=False))
    model = load(tmp_path / "art")
    try:
        prompts = [[(7 * i + j) % VOCAB for j in range(3 + 2 * i)] for i in range(5)]
        configs = [GenerationConfig(max_new_tokens=4 + i, temperature=0.8 if i % 2 else 0.0, seed=i, eos_token_id=())
                   for i in range(5)]
        alone = [model.generate([p], config=c).tokens[0] for p, c in zip(prompts, configs)]
        batch = ContinuousBatch(model, max_batch=2)
        waiting = deque(batch.prepare(p, c) for p, c in zip(prompts, configs))
        seqs = list(waiting)
        while waiting or batch.rows:
            batch.admit(batch.take(waiting))
            batch.step()
        assert [s.tokens for s in seqs] == alone
        assert batch.passes < sum(map(len, alone))
    finally:
        model.close()
