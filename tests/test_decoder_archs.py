"""Decoders beyond Llama through the fused exporter (``convert/fused_llama.py``), from a Hugging Face
folder and from a GGUF file: sliding attention windows (Mistral, Qwen2), Qwen3's per-head q/k norms,
Phi-3's packed projections, YaRN, Phi-3.5's LongRoPE over half of each head, SmolLM3's layers
without RoPE, Granite's multipliers, OLMo 2's norms, OLMo 3's sliding and YaRN global layers, a Qwen3 GGUF whose head size is not transformers' default, Gemma,
Gemma 2 and Gemma 3 (scaled embeddings, ``1 + w`` norms, GELU, soft-capping, local/global RoPE), and
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE: ONNX Runtime's MoE op).

Each model is tiny (2 layers, hidden 64, vocabulary 300) with seeded random weights; the artifact's
greedy tokens must equal transformers' ``generate(do_sample=False)`` past the sliding window.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from slimml.errors import ExportError, SlimmlError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FUSED = "fused (slimml, GroupQueryAttention)"
VOCAB, PROMPT, NEW = 300, 12, 10  # prompt + new tokens run well past a window of 8


def _gemma(name: str, window: int = 4, **extra):
    """A tiny Gemma with what sets it apart exercised: random norm weights (``x * (1 + w)``), head size
    32 with ``query_pre_attn_scalar`` 24 (the attention scale), a window of 4, Gemma 2's soft-capping at
    caps the random scores and logits reach, Gemma 3's local and global layers (linear scaling on the
    global RoPE only). Eager attention: transformers 4.57's SDPA drops Gemma 2's soft-capping."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=128, initializer_range=0.1,
                 attn_implementation="eager")
    shape.update(extra)
    if name == "gemma":
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**shape))
    elif name == "gemma2":
        shape.setdefault("query_pre_attn_scalar", 24)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **shape, sliding_window=window, attn_logit_softcapping=1.0, final_logit_softcapping=1.5))
    else:
        shape.setdefault("query_pre_attn_scalar", 24)
        shape.setdefault("layer_types", ["sliding_attention", "full_attention"])
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **shape, sliding_window=window, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # Gemma initializes them to 0 (a norm of 1 + 0)
                p.normal_(0.0, 0.3)
    return model.eval()


def _model(name: str):
    if name.startswith("gemma"):
        return _gemma(name)
    from transformers import (MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
    if name == "mistral-window":  # every layer slides
        return MistralForCausalLM(MistralConfig(**shape, sliding_window=8))
    if name == "qwen2-window":  # the layers from max_window_layers on slide
        return Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    if name == "qwen3":  # q/k norms per head; a head size other than hidden / heads
        return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32, tie_word_embeddings=True))
    if name.startswith("smollm3"):  # no RoPE in every fourth layer (here layer 1 of 2), a sliding window in the others
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        window = dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        return SmolLM3ForCausalLM(SmolLM3Config(  # "smollm3-full": every layer full attention, as SmolLM3-3B's config
            **shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, no_rope_layers=[1, 0], tie_word_embeddings=True,
            **({} if name == "smollm3-full" else window)))
    if name == "olmo2":  # norms after attention and MLP only, q/k normed over all heads at once
        from transformers import Olmo2Config, Olmo2ForCausalLM

        model = Olmo2ForCausalLM(Olmo2Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:  # initialized to 1: random, so a misplaced norm shows
                    p.normal_(1.0, 0.3)
        return model
    if name == "olmo3":  # OLMo 2's norms; a sliding layer (plain RoPE, a window of 8) and a global one (YaRN)
        from transformers import Olmo3Config, Olmo3ForCausalLM

        model = Olmo3ForCausalLM(Olmo3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"],
                                             rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32}))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(1.0, 0.3)
        return model
    if name == "granite":  # Llama with multipliers on the embeddings, the attention scores, each block's output, the logits
        from transformers import GraniteConfig, GraniteForCausalLM

        return GraniteForCausalLM(GraniteConfig(**shape, embedding_multiplier=12.0, attention_multiplier=0.1,
                                                residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True))
    if name == "llama-bias":  # attention_bias and mlp_bias: q/k/v/o and gate/up/down biased (random, so each shows)
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**shape, attention_bias=True, mlp_bias=True))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0.0, 0.3)
        return model
    if name == "qwen2-yarn":  # YaRN (Qwen2.5's long-context setting): blended frequencies, cos/sin times its attention factor
        return Qwen2ForCausalLM(Qwen2Config(**shape, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 32}))
    if name == "phi3-longrope":  # Phi-4-mini's shape: LongRoPE over half of each head, original context 16 of 128
        shape.update(num_attention_heads=2, num_key_value_heads=1)  # head size 32, 16 of it rotated
        half = 8  # short/long factors: one per rotated pair
        return Phi3ForCausalLM(Phi3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5,
                                          original_max_position_embeddings=16, rope_scaling={
                                              "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                              "long_factor": [2.0 + 0.5 * i for i in range(half)]}))
    return Phi3ForCausalLM(Phi3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2))  # q/k/v, gate/up packed


def _greedy(model, ids: np.ndarray) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long), max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _generate(art, ids: np.ndarray) -> list[int]:
    from slimml.runtime.loader import load

    model = load(art)
    try:
        return model.generate(ids.tolist(), max_new_tokens=NEW, eos_token_id=()).tokens[0]
    finally:
        model.close()


def _exporter(art) -> str:
    steps = json.loads((art / "manifest.json").read_text())["steps"]
    return next(s for s in steps if s["step"] == "export")["exporter"]


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "qwen3", "phi3", "qwen2-yarn", "phi3-longrope", "smollm3",
                                  "granite", "olmo2", "olmo3", "gemma", "gemma2", "gemma3", "llama-bias"])
def test_fused_decoders_generate_as_transformers(name, tmp_path):
    from slimml.convert import ConvertConfig, convert

    model = _model(name).eval()
    model.save_pretrained(tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and "exporter_note" not in report.checks
    assert report.task == "text-generation-with-past" and report.checks["top1_agreement"] == 1.0
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


@pytest.mark.parametrize("name", ["gemma", "gemma-legacy-gelu", "gemma2", "gemma3"])
def test_fused_gemma_logits_equal_transformers_past_the_window(name, tmp_path):
    """A 10-token prompt, then 6 tokens decoded from the cache, past a window of 4: at every step the
    fused graph's logits equal transformers' (eager attention, its own cache). Gemma 1 checkpoints
    say ``hidden_act: "gelu"``: exact GELU to transformers 4.57, the tanh one to 5; each as read."""
    import onnxruntime as ort

    from slimml.convert.export_torch_decoder import cache_keyword, returned_cache
    from slimml.convert.fused_llama import export_fused

    model = _gemma(name.split("-")[0])
    model.save_pretrained(tmp_path / "hf")
    if name == "gemma-legacy-gelu":
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    session = ort.InferenceSession(str(export_fused(tmp_path / "hf", tmp_path / "onnx")), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    seq = np.random.default_rng(0).integers(3, VOCAB, size=(1, 10))
    empty = np.zeros((1, 2, 0, 32), np.float32)  # (B, kv_heads, past, head_dim)
    feeds = {"input_ids": seq, "attention_mask": np.ones_like(seq), "logits_index": np.arange(10)[None],
             **{f"past_key_values.{i}.{t}": empty for i in range(2) for t in ("key", "value")}}
    cache, diffs = None, []
    for _ in range(7):
        out = dict(zip(names, session.run(None, feeds)))
        with torch.no_grad():
            ref = model(torch.tensor(feeds["input_ids"]), **{cache_keyword(model): cache}, use_cache=True)
        cache = returned_cache(ref)
        diffs.append(float(np.abs(out["logits"] - ref.logits.numpy()).max()))
        token = np.array([[int(ref.logits[0, -1].argmax())]])
        seq = np.concatenate([seq, token], axis=1)
        feeds = {"input_ids": token, "attention_mask": np.ones_like(seq), "logits_index": np.zeros((1, 1), np.int64),
                 **{f"past_key_values.{i}.{t}": out[f"present.{i}.{t}"] for i in range(2) for t in ("key", "value")}}
    assert max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "smollm3-full", "olmo3"])
def test_the_layer_by_layer_reference_keeps_each_layers_type(name, tmp_path):
    """The check of a decoder bigger than memory runs torch one layer at a time: Gemma's sliding and
    global layers (Gemma 3: with their own RoPE) each run as their own type, Gemma 2 eagerly, and
    SmolLM3's layers without RoPE without it."""
    from slimml.convert.layerwise import streamed_reference

    model = _model(name)
    model.save_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, 10))
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(streamed_reference(tmp_path / "hf")({"input_ids": ids})["logits"] - want).max() < 1e-4


@pytest.mark.parametrize("scheme", ["int4-weights", "int8"])
def test_a_quantized_gemma_generates(scheme, tmp_path):
    """The decoder recipes quantize the fused Gemma graph (FastGelu MLP, sandwich norms, scaled tied
    embedding) and it generates; random weights, so no claim on the tokens."""
    from slimml.convert import ConvertConfig, convert
    from slimml.quantize.config import scheme_config

    _gemma("gemma3").save_pretrained(tmp_path / "hf")
    _save_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False, quantize=scheme_config(scheme)))
    steps = json.loads((tmp_path / "art" / "manifest.json").read_text())["steps"]
    assert steps[-1]["step"] == "quantize" and steps[-1]["backend"] == "lm", steps[-1]
    tokens = _generate(tmp_path / "art", np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT)))
    assert len(tokens) == NEW and all(0 <= t < VOCAB for t in tokens)


MIXTURES = {  # each routing rule and weight layout the fused graph's MoE op is given
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),  # w1/w3/w2, renormalized
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),  # raw top-k weights, a sigmoid-gated shared expert
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      norm_topk_prob=True, mlp_only_layers=[0]),  # renormalized, a dense first layer, q/k norms
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2),  # q/k normed over all heads
    "granitemoeshared": dict(model_type="granitemoeshared", num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48, embedding_multiplier=12.0, attention_multiplier=0.1,
                             residual_multiplier=0.22, logits_scaling=8.0),  # stacked experts, a shared MLP, multipliers
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"]),  # biases, sinks, a window, YaRN, clamped SwiGLU
}


def _mixture(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(MIXTURES[name])
    model_type = kw.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape, **kw)).eval()
    if model_type == "gpt_oss":
        _lively_gpt_oss(model)
    return model


def _lively_gpt_oss(model) -> None:
    """A random gpt-oss whose biases and sinks matter and whose gate values go well past the clamp at 7."""
    with torch.no_grad():
        for n, param in model.named_parameters():
            if n.endswith(("_bias", "sinks", "proj.bias", "router.bias")):
                param.normal_(0.0, 0.5)
            elif n.endswith("gate_up_proj"):
                param.normal_(0.0, 2.0)


@pytest.mark.parametrize("name", list(MIXTURES))
def test_fused_mixtures_of_experts_generate_as_transformers(name, tmp_path):
    """Mixtures of experts through the fused graph, with transformers 4.57 as with 5: the experts are
    ONNX Runtime's MoE op fed the router's logits, the router stays a float MatMul; greedy tokens equal
    transformers' own (random weights large enough that the routing differs token to token)."""
    import onnx

    from slimml.convert import ConvertConfig, convert

    model = _mixture(name)
    model.save_pretrained(tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    ops = [n.op_type for f in (tmp_path / "art").glob("*.onnx") for n in onnx.load(f, load_external_data=False).graph.node]
    assert ops.count("MoE") == (1 if name == "qwen3_moe" else 2)  # Qwen3-MoE's mlp_only_layers: layer 0 dense
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)
    from slimml.runtime.loader import load

    art = load(tmp_path / "art")  # prompts of other lengths in one batch: every row routed as alone
    try:
        prompts = [ids[0].tolist(), ids[0, :5].tolist()]
        assert art.generate(prompts, max_new_tokens=6, eos_token_id=()).tokens == [
            art.generate([p], max_new_tokens=6, eos_token_id=()).tokens[0] for p in prompts]
    finally:
        art.close()


FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _as_mxfp4(folder) -> None:
    """gpt-oss's experts rewritten as OpenAI ships them: MXFP4 ``_blocks`` (two e2m1 codes a byte, low
    nibble first, 32 values a block) and ``_scales`` (a power of two a block, biased by 127), stored
    (experts, out, in), with the config's ``quantization_config``."""
    from safetensors.numpy import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = {}
        for name, w in load_file(f).items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = w
                continue
            blocks = np.swapaxes(w.astype(np.float32), 1, 2).reshape(w.shape[0], w.shape[2], -1, 32)
            exp = np.floor(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30))) - 2  # the largest value near 6 x 2^exp
            codes = np.abs(blocks[..., None] / np.exp2(exp)[..., None, None] - FP4).argmin(-1).astype(np.uint8)
            tensors[name + "_blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
            tensors[name + "_scales"] = (exp + 127).astype(np.uint8)
        save_file(tensors, f, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


def test_a_gpt_oss_checkpoint_in_mxfp4_converts_from_its_own_codes(tmp_path):
    """gpt-oss as OpenAI ships it (experts in MXFP4): the fused exporter decodes the blocks itself, one
    expert at a time; the check compares with transformers' float32 reading (it dequantizes MXFP4 to
    bf16 on a CPU, cast back exactly: an e2m1 code times a power of two fits bf16), and greedy tokens equal it."""
    from transformers import AutoModelForCausalLM

    from slimml.convert import ConvertConfig, convert

    _mixture("gpt_oss").save_pretrained(tmp_path / "hf")
    _as_mxfp4(tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).float().eval()
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


def _gpt_oss_gguf(folder, path, template: str) -> None:
    """The gpt-oss folder as llama.cpp's converter (``conversion/gpt_oss.py``) writes it: gate and up split
    from OpenAI's interleaved rows, MXFP4 experts repacked as GGML blocks (the scale byte, then 16 bytes
    holding values 0-15 in low nibbles and 16-31 in high ones), float experts as (experts, out, in),
    the sinks as ``attn_sinks.weight``, YaRN and the window as fields; an o200k byte-level BPE."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    c = json.loads((folder / "config.json").read_text())
    rope = c.get("rope_scaling") or c["rope_parameters"]  # transformers 5 saves rope_parameters (theta inside)
    state = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, value in (("block_count", c["num_hidden_layers"]), ("context_length", c["max_position_embeddings"]),
                       ("embedding_length", c["hidden_size"]), ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", c["num_attention_heads"]), ("attention.head_count_kv", c["num_key_value_heads"]),
                       ("attention.key_length", c["head_dim"]), ("attention.value_length", c["head_dim"]),
                       ("expert_count", c["num_local_experts"]), ("expert_used_count", c["num_experts_per_tok"]),
                       ("attention.sliding_window", c["sliding_window"]), ("expert_feed_forward_length", c["intermediate_size"]),
                       ("rope.scaling.original_context_length", rope["original_max_position_embeddings"])):
        w.add_uint32(f"gpt-oss.{key}", value)
    for key, value in (("rope.freq_base", c.get("rope_theta") or rope["rope_theta"]),
                       ("attention.layer_norm_rms_epsilon", c["rms_norm_eps"]), ("rope.scaling.factor", rope["factor"]),
                       ("rope.scaling.yarn_beta_fast", rope["beta_fast"]), ("rope.scaling.yarn_beta_slow", rope["beta_slow"])):
        w.add_float32(f"gpt-oss.{key}", float(value))
    w.add_string("gpt-oss.rope.scaling.type", "yarn")
    state_bpe = json.loads(_bpe().to_str())["model"]
    vocab = sorted(state_bpe["vocab"], key=state_bpe["vocab"].get)
    vocab += [f"<|reserved_{i}|>" for i in range(VOCAB - len(vocab) - 3)] + ["<|end|>", "<|start|>", "<|return|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(vocab)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state_bpe["merges"]])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    w.add_eot_token_id(VOCAB - 3)  # <|end|>: closes each harmony message, not the answer
    w.add_chat_template(template)

    def ggml_mxfp4(blocks, scales):  # OpenAI's (..., n, 16) codes, low nibble first -> GGML's 17-byte blocks
        codes = np.stack((blocks & 0x0F, blocks >> 4), -1).reshape(*blocks.shape[:-1], 32)
        qs = codes[..., :16] | (codes[..., 16:] << 4)
        return np.concatenate((scales[..., None], qs), -1).reshape(*blocks.shape[:-2], -1).astype(np.uint8)

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
             **{f"self_attn.{a}_proj.{k}": f"attn_{b}.{k}" for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
                for k in ("weight", "bias")}}
    mx = c.get("quantization_config", {}).get("quant_method") == "mxfp4"
    for name, a in state.items():
        if name in top:
            w.add_tensor(top[name], a.astype(np.float32))
            continue
        i, rest = name.split(".")[2], name.split(".", 3)[3]
        blk = f"blk.{i}."
        if rest in names:
            w.add_tensor(blk + names[rest], a.astype(np.float32))
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(blk + "ffn_gate_exps.bias", np.ascontiguousarray(a[..., ::2], np.float32))
            w.add_tensor(blk + "ffn_up_exps.bias", np.ascontiguousarray(a[..., 1::2], np.float32))
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(blk + "ffn_down_exps.bias", a.astype(np.float32))
        elif rest == "mlp.experts.gate_up_proj_blocks":
            scales = state[name.replace("_blocks", "_scales")]
            w.add_tensor(blk + "ffn_gate_exps.weight", ggml_mxfp4(a[:, ::2], scales[:, ::2]), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(blk + "ffn_up_exps.weight", ggml_mxfp4(a[:, 1::2], scales[:, 1::2]), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif rest == "mlp.experts.down_proj_blocks":
            w.add_tensor(blk + "ffn_down_exps.weight", ggml_mxfp4(a, state[name.replace("_blocks", "_scales")]),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif rest == "mlp.experts.gate_up_proj":  # float experts: (experts, in, out) -> (experts, out, in)
            w.add_tensor(blk + "ffn_gate_exps.weight", np.ascontiguousarray(a[..., ::2].transpose(0, 2, 1), np.float32))
            w.add_tensor(blk + "ffn_up_exps.weight", np.ascontiguousarray(a[..., 1::2].transpose(0, 2, 1), np.float32))
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(blk + "ffn_down_exps.weight", np.ascontiguousarray(a.transpose(0, 2, 1), np.float32))
        else:
            assert rest.endswith("_scales"), rest
    w.add_file_type(38 if mx else 0)  # MOSTLY_MXFP4_MOE, ALL_F32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("experts", ["mxfp4", "float"])
def test_a_gpt_oss_gguf_is_read_by_slimml_and_keeps_its_mxfp4_codes(experts, tmp_path):
    """A gpt-oss GGUF (no transformers reads one whole: 4.57 knows no gpt-oss GGUF, 5.24 misreads the
    YaRN fields every such file has) is read by slimml: the folder it writes holds the source's
    tensors byte for byte (the MXFP4 codes as OpenAI ships them), the artifact generates as the model,
    and the tokenizer and chat template come from the file."""
    from transformers import AutoModelForCausalLM

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.gguf_gpt_oss import gpt_oss_folder

    src = tmp_path / "hf"
    _mixture("gpt_oss").save_pretrained(src)
    if experts == "mxfp4":
        _as_mxfp4(src)
    template = "{% for m in messages %}<|start|>{{ m['role'] }} {{ m['content'] }}<|return|>{% endfor %}"
    _gpt_oss_gguf(src, tmp_path / "oss.gguf", template)
    gpt_oss_folder(tmp_path / "oss.gguf", tmp_path / "read")
    from safetensors.numpy import load_file

    ours = {k: v for f in (tmp_path / "read").glob("*.safetensors") for k, v in load_file(f).items()}
    theirs = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(ours) == set(theirs) and all(np.array_equal(ours[k], theirs[k].astype(ours[k].dtype)) for k in ours)

    report = convert(tmp_path / "oss.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).float().eval()
    ids = np.random.default_rng(0).integers(3, VOCAB - 3, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json"))
    text = "the cat sat on the mat"
    assert tok.decode(tok.encode(text).ids) == text and tok.encode("<|start|>").ids[-1] == VOCAB - 2  # one id
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert (tmp_path / "art" / manifest["tokenizer"]["chat_template"]).read_text() == template
    assert json.loads((tmp_path / "read" / "generation_config.json").read_text())["eos_token_id"] == [VOCAB - 1, 0]  # and <|endoftext|>
    assert manifest["source"]["gguf"]["gguf_file_type"] == (
        "MXFP4_MOE" if experts == "mxfp4" else "F32")


def test_a_gpt_oss_in_mxfp4_bigger_than_memory_is_checked_layer_by_layer(tmp_path, monkeypatch):
    """gpt-oss-20b in MXFP4 (13 GB) is more than a third of a 24 GB machine, so its check runs torch one
    layer at a time: that reference decodes the MXFP4 experts too (it read only float tensors)."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.weights import weight_bytes
    from slimml.runtime.engine import budget

    _mixture("gpt_oss").save_pretrained(tmp_path / "hf")
    _as_mxfp4(tmp_path / "hf")
    monkeypatch.setattr(budget, "available_memory", lambda: 2 * weight_bytes(tmp_path / "hf"))
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["reference"].startswith("torch, layer by layer")
    assert report.checks["top1_agreement"] == 1.0 and report.checks["max_abs_diff_vs_torch"] < 1e-4


def test_a_bfloat16_checkpoint_is_checked_against_its_float32_computation(tmp_path):
    """transformers 5 loads a bf16 checkpoint in bf16 by default; the check computes the source in
    float32, as the artifact does (in bf16 the same weights' logits differ by about 1e-2)."""
    from slimml.convert import ConvertConfig, convert

    _model("qwen3").to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    report = convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4


@pytest.mark.parametrize("scheme, name", [("int4-weights", "qwen2_moe"), ("int8", "qwen2_moe"), ("int4-weights", "gpt_oss")])
def test_a_quantized_mixture_of_experts_keeps_its_routers_float(scheme, name, tmp_path):
    """The decoder recipes on a fused mixture of experts: experts to QMoE (4-bit or 8-bit blocks of 32
    computed at accuracy_level 4, as the dense layers; gpt-oss's biases and clamped SwiGLU kept), the
    other MatMuls to MatMulNBits, the routers (one column an expert) left float; it generates."""
    import onnx

    from slimml.convert import ConvertConfig, convert
    from slimml.quantize.config import scheme_config

    _mixture(name).save_pretrained(tmp_path / "hf")
    _save_tokenizer(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False, quantize=scheme_config(scheme)))
    steps = json.loads((tmp_path / "art" / "manifest.json").read_text())["steps"]
    assert steps[-1]["step"] == "quantize" and steps[-1]["backend"] == "lm", steps[-1]
    assert steps[-1]["experts"]["moe_nodes"] == 2 and steps[-1]["experts"]["grid"] == (  # calibrated: GPTQ / equalized
        "fitted, GPTQ" if name == "gpt_oss" else "equalized and symmetric")  # Qwen2-MoE's experts: 32 wide, one block
    nodes = [n for f in (tmp_path / "art").glob("*.onnx") for n in onnx.load(f, load_external_data=False).graph.node]
    qmoe = [n for n in nodes if n.op_type == "QMoE"]
    assert len(qmoe) == 2 and not [n for n in nodes if n.op_type == "MoE"]
    assert {a.i for n in qmoe for a in n.attribute if a.name == "expert_weight_bits"} == {4 if scheme == "int4-weights" else 8}
    assert {(a.name, a.i) for n in qmoe for a in n.attribute if a.name in ("block_size", "accuracy_level")} == {
        ("block_size", 32), ("accuracy_level", 4)}
    routers = ("", "shared_expert/") if name == "qwen2_moe" else ("",)
    assert sorted(n.name for n in nodes if n.op_type == "MatMul") == sorted(
        f"/model/layers.{i}/{p}moe/router/MatMul" for i in range(2) for p in routers)
    if name == "gpt_oss":
        assert all(n.input[4] and n.input[7] for n in qmoe)  # the experts' biases
        assert all(n.input[11] and n.input[12] for n in qmoe)  # fitted asymmetric blocks: zero points
        assert {a.f for n in qmoe for a in n.attribute if a.name == "swiglu_limit"} == {7.0}
    tokens = _generate(tmp_path / "art", np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT)))
    assert len(tokens) == NEW and all(0 <= t < VOCAB for t in tokens)


def test_a_fused_graph_that_disagrees_with_torch_is_refused(tmp_path, monkeypatch):
    """A misread window (one position short) stands for any fused-exporter bug: the float check
    refuses the artifact in one line naming --exporter optimum, and nothing is written."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert import fused_family

    _model("mistral-window").save_pretrained(tmp_path / "hf")
    windows = fused_family._windows
    monkeypatch.setattr(fused_family, "_windows", lambda c: [w - 1 for w in windows(c)])
    with pytest.raises(ExportError, match=r"disagrees with the source model in torch .* convert with --exporter optimum\.$"):
        convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not (tmp_path / "art").exists()


def test_longrope_past_its_original_context_takes_the_long_factors(tmp_path):
    """A prompt longer than LongRoPE's original context (20 > 16) runs with the long factors at every
    position, as transformers switches; the logits equal its own at every position."""
    import onnxruntime as ort

    from slimml.convert.fused_llama import export_fused

    model = _model("phi3-longrope").eval()
    model.save_pretrained(tmp_path / "hf")
    session = ort.InferenceSession(str(export_fused(tmp_path / "hf", tmp_path / "onnx")), providers=["CPUExecutionProvider"])
    for length in (12, 20):  # short factors, then long
        ids = np.random.default_rng(length).integers(3, VOCAB, size=(1, length))
        empty = np.zeros((1, 1, 0, 32), np.float32)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "logits_index": np.arange(length)[None],
                 **{f"past_key_values.{i}.{t}": empty for i in range(2) for t in ("key", "value")}}
        with torch.no_grad():
            want = model(torch.tensor(ids)).logits.numpy()
        assert np.abs(session.run(["logits"], feeds)[0] - want).max() < 1e-4, length


def test_longrope_prompts_on_either_side_of_the_switch_batch_as_alone(tmp_path):
    """Prompts longer and shorter than LongRoPE's original context (16) in one batch: each is
    prefilled with its own factors (passes of their own), so each answer equals transformers' for
    that prompt alone, through generate and through the server's continuous batch (where a sequence
    alone is run again whole when it grows past the switch, as generate runs it)."""
    from collections import deque

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load
    from slimml.runtime.tasks.generation.config import GenerationConfig
    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    model = _model("phi3-longrope").eval()
    model.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    source = json.loads((tmp_path / "art" / "manifest.json").read_text())["source"]
    assert source["rope_switch"] == 16 and source["rope_reprefill"] is True
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (20, 6, 18, 4)]
    want = [_greedy(model, np.array([p]))[:6] for p in prompts]
    art = load(tmp_path / "art")
    try:
        assert art.generate(prompts, max_new_tokens=6, eos_token_id=()).tokens == want
        batch = ContinuousBatch(art, max_batch=4)
        seqs = [batch.prepare(p, GenerationConfig(max_new_tokens=6, eos_token_id=())) for p in prompts]
        waiting = deque(seqs)
        while waiting or batch.rows:
            batch.admit(batch.take(waiting))
            batch.step()
        assert [s.tokens for s in seqs] == want
        one = batch.prepare(prompts[1][:4], GenerationConfig(max_new_tokens=16, eos_token_id=()))  # alone, past the switch
        batch.admit([one])
        while batch.rows:
            batch.step()
        with torch.no_grad():  # transformers re-runs it at the switch too
            ref = model.generate(torch.tensor([prompts[1][:4]]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert one.tokens == ref[0, 4:].tolist()
        # beam search does not run its beams again whole at the switch: refused where they would cross it
        with pytest.raises(SlimmlError, match=r"grows past 16 positions, as its generate does, and its beam search does "
                                              r"not: ask for at most 11 new tokens"):
            art.generate([prompts[1]], max_new_tokens=16, num_beams=2, eos_token_id=())
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompts[1]]), max_new_tokens=11, num_beams=2, do_sample=False, pad_token_id=0)
        assert art.generate([prompts[1]], max_new_tokens=11, num_beams=2, eos_token_id=()).tokens[0] == ref[0, 6:].tolist()
        with torch.no_grad():  # a prompt past the switch already: its beams run with the long factors throughout
            ref = model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, num_beams=2, do_sample=False, pad_token_id=0)
        assert art.generate([prompts[0]], max_new_tokens=8, num_beams=2, eos_token_id=()).tokens[0] == ref[0, 20:].tolist()
    finally:
        art.close()


def test_a_rotary_width_ort_cannot_take_falls_back_to_optimum(tmp_path):
    """GroupQueryAttention rotates a multiple of 16 values of a head: a quarter of 16 is refused, by name."""
    from slimml.convert.fused_llama import can_export_fused

    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.25)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").touch()
    assert "rotates a multiple of 16 values of each head, not 4" in can_export_fused(tmp_path)


def _bpe():
    """A byte-level BPE of at most VOCAB tokens, trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "a model of the decoder", "tokens and their merges"] * 20, trainer)
    return tok


def _save_tokenizer(folder) -> None:
    """A tokenizer beside the model, as every real folder has one: what makes it a language model to
    quantize's decoder recipes and to convert's perplexity check."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=_bpe(), bos_token="<|endoftext|>", eos_token="<|endoftext|>").save_pretrained(folder)


def _gguf_tokenizer_fields(writer) -> None:
    """A byte-level BPE of VOCAB tokens trained here, written as llama.cpp writes a "gpt2" tokenizer."""
    state = json.loads(_bpe().to_str())["model"]
    vocab = sorted(state["vocab"], key=state["vocab"].get)
    vocab += [f"<|unused{i}|>" for i in range(VOCAB - len(vocab))]  # a small corpus stops the trainer early
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)


def _gguf(model, path, arch: str, tokenizer=None, norm_offset: float = 0.0, extra=None, **fields) -> None:
    """``model`` as a float32 GGUF file, names and metadata as llama.cpp's converter writes ``arch``
    (``fields``: more ``arch.KEY`` values; ``norm_offset``: added to the norms, as llama.cpp stores
    Gemma's ``1 + w``)."""
    gguf = pytest.importorskip("gguf")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads), ("attention.head_count_kv", c.num_key_value_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim)):
        w.add_uint32(f"{arch}.{key}", value)
    theta = getattr(c, "rope_theta", None) or c.rope_parameters.get("rope_theta") or c.rope_parameters["full_attention"]["rope_theta"]
    w.add_float32(f"{arch}.rope.freq_base", float(theta))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps))
    for key, value in fields.items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_file_type(0)
    (tokenizer or _gguf_tokenizer_fields)(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, a in (extra or {}).items():  # tensors llama.cpp adds (Phi-3's LongRoPE factors)
        w.add_tensor(name, a)
    state = model.state_dict()
    experts = {}  # transformers 4.x: one tensor an expert, stacked as llama.cpp writes them (transformers 5's layout)
    for name in [n for n in state if ".mlp.experts." in n and n.split(".")[5].isdigit()]:
        layer, _, kind = name.rsplit(".", 5)[0], None, name.split(".")[6]
        experts.setdefault((layer, kind), []).append(state.pop(name))
    for (layer, kind), parts in experts.items():
        if kind == "gate_proj":
            state[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(parts), torch.stack(experts[layer, "up_proj"])], 1)
        elif kind == "down_proj":
            state[f"{layer}.mlp.experts.down_proj"] = torch.stack(parts)
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:  # tied: llama.cpp writes no output tensor
            continue
        a = t.float().numpy() + (norm_offset if "norm" in name else 0.0)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):  # transformers 5's experts
            block = f"blk.{name.split('.')[2]}"
            inner = a.shape[1] // 2
            parts = ({"gate_exps": a[:, :inner], "up_exps": a[:, inner:]} if name.endswith("gate_up_proj")
                     else {"down_exps": a} if name.endswith("down_proj") else {"gate_inp": a})
            for part, array in parts.items():
                w.add_tensor(f"{block}.ffn_{part}.weight", np.ascontiguousarray(array, np.float32))
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's interleaved rotary order
            n = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        base, kind = name.rsplit(".", 1)  # weight or bias (Qwen2's q/k/v)
        w.add_tensor(f"{names.get_name(base)}.{kind}", a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _sentencepiece_fields(writer) -> None:
    """A sentencepiece ("llama") vocabulary of VOCAB tokens as Gemma's GGUF files hold one: pad, eos,
    bos, unk, the 256 byte tokens (byte fallback), then words."""
    words = ["\u2581" + w for w in ("the cat sat on mat a model of decoder tokens and their merges is it to in for"
                                     " with as was by at be this from or an are not but all were when we there can").split()]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:VOCAB])
    writer.add_token_scores([0.0] * 260 + [-float(i + 1) for i in range(VOCAB - 260)])
    writer.add_token_types([3, 3, 3, 2, *([6] * 256), *([1] * (VOCAB - 260))])
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)


def test_a_qwen3_gguf_of_another_head_size_converts_fused(tmp_path):
    """transformers 4.57 reads a Qwen3 GGUF's head size as its class default (128); slimml reads the
    file's attention.key_length, so a Qwen3 of head size 32 converts and generates as the model."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from slimml.convert import ConvertConfig, convert

    model = _model("qwen3").eval()
    _gguf(model, tmp_path / "tiny-qwen3.gguf", "qwen3")
    report = convert(tmp_path / "tiny-qwen3.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


def test_a_qwen3_moe_gguf_converts_with_its_experts(tmp_path):
    """A Qwen3-MoE GGUF as llama.cpp writes one (experts as 3-D ``ffn_{gate,up,down}_exps``, the router
    ``ffn_gate_inp``, the expert size in ``expert_feed_forward_length``): read by transformers, written
    by the fused exporter with ONNX Runtime's MoE op, it generates as the model."""
    pytest.importorskip("gguf")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from slimml.convert import ConvertConfig, convert

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)).eval()
    _gguf(model, tmp_path / "tiny-qwen3moe.gguf", "qwen3moe", expert_count=4, expert_used_count=2,
          expert_feed_forward_length=32)
    report = convert(tmp_path / "tiny-qwen3moe.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["top1_agreement"] == 1.0 and report.checks["max_abs_diff_vs_torch"] < 1e-4
    assert _exporter(tmp_path / "art") == FUSED
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


def test_a_qwen2_moe_gguf_converts_with_its_shared_expert(tmp_path):
    """A Qwen2-MoE GGUF as llama.cpp's converter writes one now (the shared expert's gate a (1, hidden)
    matrix): transformers 4.57 skips every field of the file (it reads them under ``qwen2_moe``, and
    maps ``qwen2moe``) and both 4.57 and 5 make the gate (1, 1, hidden), so neither loads it alone;
    slimml lends the reader both fixes, and the artifact generates as the model."""
    pytest.importorskip("gguf")
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from slimml.convert import ConvertConfig, convert

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, tie_word_embeddings=False)).eval()
    _gguf(model, tmp_path / "tiny-qwen2moe.gguf", "qwen2moe", expert_count=4, expert_used_count=2,
          expert_feed_forward_length=32, expert_shared_feed_forward_length=48)
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    mapped = set(GGUF_CONFIG_MAPPING)
    report = convert(tmp_path / "tiny-qwen2moe.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert set(GGUF_CONFIG_MAPPING) == mapped  # lent only while the reader reads
    assert report.checks["top1_agreement"] == 1.0 and _exporter(tmp_path / "art") == FUSED
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


def test_a_long_context_phi3_gguf_keeps_its_longrope(tmp_path):
    """A Phi-3.5-style GGUF keeps LongRoPE as llama.cpp writes it (factor tensors, the original
    context as a field), which transformers' reader drops: slimml reads it back, and the artifact
    generates as the Hugging Face model, across the switch (the prompt 12, the switch at 16)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from slimml.convert import ConvertConfig, convert

    model = _model("phi3-longrope").eval()
    c = model.config
    scaling = getattr(c, "rope_scaling", None) or c.rope_parameters
    extra = {"rope_factors_short.weight": np.array(scaling["short_factor"], np.float32),
             "rope_factors_long.weight": np.array(scaling["long_factor"], np.float32)}
    def tokenizer(writer):  # Phi-3's reader wants a pad id
        _gguf_tokenizer_fields(writer)
        writer.add_pad_token_id(0)

    _gguf(model, tmp_path / "tiny-phi3.gguf", "phi3", tokenizer=tokenizer, extra=extra, **{"rope.dimension_count": 16,
          "rope.scaling.original_context_length": 16, "rope.scaling.attn_factor": 1.32})
    report = convert(tmp_path / "tiny-phi3.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


def _llama3_divisors(c) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a Llama 3 scaling, as its converter computes them."""
    import math

    r = getattr(c, "rope_scaling", None) or c.rope_parameters
    theta = getattr(c, "rope_theta", None) or r["rope_theta"]
    dim = c.hidden_size // c.num_attention_heads
    low, high, old = r["low_freq_factor"], r["high_freq_factor"], r["original_max_position_embeddings"]
    out = []
    for f in 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(r["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(out, np.float32)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_a_scaled_rope_in_a_gguf_is_kept(name, tmp_path):
    """transformers' GGUF reader keeps only rope.freq_base: a Llama 3.x file's baked ``rope_freqs``
    (here with an original context of 32, not Llama's 8192, so the parameters are solved from the
    divisors) and a file's YaRN fields are read back, and the artifact generates as the model."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimml.convert import ConvertConfig, convert

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, pad_token_id=0)
    if name == "llama3":
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})).eval()
        _gguf(model, tmp_path / "m.gguf", "llama", extra={"rope_freqs.weight": _llama3_divisors(model.config)})
    else:
        model = _model("qwen2-yarn").eval()
        _gguf(model, tmp_path / "m.gguf", "qwen2", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                                    "rope.scaling.original_context_length": 32})
    report = convert(tmp_path / "m.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


def test_llama_3_2s_rope_freqs_give_back_its_own_scaling():
    """Llama-3.2-1B's values (theta 500000, head size 64, factor 32, bounds 1 and 4, context 8192)."""
    from types import SimpleNamespace

    from slimml.convert.gguf_rope import _llama3

    scaling = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = SimpleNamespace(rope_theta=500000.0, hidden_size=2048, num_attention_heads=32, rope_scaling=scaling)
    assert _llama3(_llama3_divisors(c), c, "llama") == {"rope_type": "llama3", **scaling}


def test_a_rope_freqs_tensor_no_llama3_scaling_makes_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    from slimml.convert.gguf import missed_config

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_tensor("rope_freqs.weight", np.array([1.0, 3.0, 1.5, 8.0], np.float32))  # not monotone: no llama3 scaling
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SlimmlError, match=r"rope_freqs tensor .* matches no Llama 3 scaling .* convert the original Hugging Face folder"):
        missed_config(tmp_path / "m.gguf", transformers.LlamaConfig(hidden_size=32, num_attention_heads=4))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_converts_fused(arch, tmp_path):
    """A Gemma 2/3 GGUF as llama.cpp writes one (norms stored as 1 + w, a sentencepiece vocabulary, no
    attention scale; Gemma 2's soft-caps, Gemma 3's linear RoPE scaling for the global layers):
    transformers' reader leaves the scale at 256, the caps at their defaults and drops the scaling;
    slimml reads them as llama.cpp runs the file, and the artifact generates as the model. Gemma 3
    with six layers: five sliding (a window of 4), one global."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from slimml.convert import ConvertConfig, convert

    if arch == "gemma2":
        model = _gemma(arch, query_pre_attn_scalar=32)  # llama.cpp's scale: head_dim
        fields = {"attention.sliding_window": 4, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 1.5}
    else:
        model = _gemma(arch, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32)
        fields = {"attention.sliding_window": 4, "rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
    _gguf(model, tmp_path / f"tiny-{arch}.gguf", arch, tokenizer=_sentencepiece_fields, norm_offset=1.0, **fields)
    report = convert(tmp_path / f"tiny-{arch}.gguf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert _exporter(tmp_path / "art") == FUSED and report.checks["top1_agreement"] == 1.0
    ids = np.random.default_rng(0).integers(3, VOCAB, size=(1, PROMPT))
    assert _generate(tmp_path / "art", ids) == _greedy(model, ids)


@pytest.mark.parametrize("arch, fields, config, want", [
    ("gpt2", {"context_length": 256}, "GPT2Config", {"n_positions": 256}),
    ("phi3", {"rope.dimension_count": 24, "attention.sliding_window": 2047}, "Phi3Config",
     {"partial_rotary_factor": 0.75, "sliding_window": 2047}),
    ("qwen3", {"attention.key_length": 64}, "Qwen3Config", {"head_dim": 64}),
    ("llama", {"attention.key_length": 32, "rope.dimension_count": 32}, "LlamaConfig", {}),
    ("qwen3moe", {"attention.key_length": 64, "expert_feed_forward_length": 64}, "Qwen3MoeConfig",
     {"head_dim": 64, "moe_intermediate_size": 64, "norm_topk_prob": True}),  # llama.cpp renormalizes Qwen3-MoE's
    ("gemma2", {"block_count": 46}, "Gemma2Config", {"query_pre_attn_scalar": 32}),  # the 27B: hidden / heads
    ("gemma3", {"block_count": 26, "attention.key_length": 64}, "Gemma3TextConfig", {"head_dim": 64, "query_pre_attn_scalar": 64}),
])
def test_config_values_the_gguf_reader_drops_are_read_from_the_file(tmp_path, arch, fields, config, want):
    gguf = pytest.importorskip("gguf")
    from slimml.convert.gguf import missed_config

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    for key, value in fields.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shape = {"hidden_size": 128, "num_attention_heads": 4} if arch != "gpt2" else {}
    assert missed_config(tmp_path / "m.gguf", getattr(transformers, config)(**shape)) == want
    if arch == "qwen3moe":  # llama.cpp's name for what transformers lists as qwen3_moe: read, not refused
        from slimml.convert.gguf import inspect_gguf

        assert inspect_gguf(tmp_path / "m.gguf")["architecture"] == "qwen3moe"


def test_a_tokenizer_that_cannot_encode_the_eval_text_is_named(tmp_path):
    """transformers' tokenizer from a Gemma GGUF without an unknown token fails on any character
    outside its vocabulary: the check names the tokenizer and --eval-text, in one line."""
    from tokenizers import Tokenizer, models

    from slimml.convert.llm_check import token_windows
    from slimml.errors import DataError

    Tokenizer(models.Unigram([("a", -1.0), ("b", -1.0)], unk_id=None)).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"^the model's tokenizer \(tokenizer.json\) cannot encode the evaluation text "
                                        r"\(.*\); give a text it can encode with --eval-text"):
        token_windows(tmp_path / "tokenizer.json", "ab x " * 60)


@pytest.mark.parametrize("kind, match", [
    ("newer", r"names model_type 'newfangled', which the installed transformers .* does not know; install a transformers that knows it"),
    ("custom code", r"^hf needs its own modeling code \(auto_map in its config\), which slimml does not run; export it"),
])
def test_a_folder_transformers_cannot_build_is_refused_in_one_line(tmp_path, kind, match):
    from slimml.convert import ConvertConfig, convert

    _model("mistral-window").save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if kind == "newer":
        config |= {"model_type": "newfangled", "architectures": ["NewfangledForCausalLM"]}
    else:
        config |= {"model_type": "mycustom", "architectures": ["MyForCausalLM"],
                   "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}}
        (tmp_path / "hf" / "configuration_my.py").write_text("from transformers import MistralConfig\n\n\n"
                                                            "class MyConfig(MistralConfig):\n    model_type = 'mycustom'\n")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimmlError, match=match):
        convert(tmp_path / "hf", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert not (tmp_path / "art").exists()
