"""benchmarks/make_offgrid_llama.py: the rotated, channel-scaled Llama computes the same function."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_rotated_llama_gives_the_same_logits_with_weights_off_the_grid():
    import torch
    from make_offgrid_llama import rotate
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:  # norms that are not all ones, so folding them matters
        layer.input_layernorm.weight.data.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.data.uniform_(0.5, 1.5)
    model.model.norm.weight.data.uniform_(0.5, 1.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor(np.random.default_rng(0).integers(0, 256, size=(2, 12)))
    with torch.no_grad():
        want = model(ids).logits
        rotate(model, seed=0)
        got = model(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(float(layer.input_layernorm.weight.detach().min()) == 1.0 for layer in model.model.layers)
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert not torch.allclose(w, before["model.layers.0.mlp.up_proj.weight"])
    spread = w.abs().amax(dim=1)  # the intermediate channels' ranges, scaled by exp(N(0, 0.5))
    assert float(spread.max() / spread.min()) > 3
