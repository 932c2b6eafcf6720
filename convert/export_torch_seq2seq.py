"""Encoder-decoders (T5, BART, Whisper) through ``torch.onnx.export``, without optimum-onnx.

optimum-onnx needs transformers < 4.58; this writes the same three graphs with any transformers,
named as optimum names them, so the splitter, ``runtime.tasks.seq2seq`` and the quantizers see
what they see there:

- ``encoder_model.onnx``: ``input_ids``, ``attention_mask`` (Whisper: ``input_features``) ->
  ``last_hidden_state``;
- ``decoder_model.onnx`` (the first step): ``input_ids``, ``encoder_attention_mask``,
  ``encoder_hidden_states`` -> ``logits``, and each layer's ``present.N.decoder.key/value`` (its
  self-attention) and ``present.N.encoder.key/value`` (its cross-attention over the encoder);
- ``decoder_with_past_model.onnx`` (every later step): ``input_ids``, ``encoder_attention_mask``,
  ``past_key_values.N.{decoder,encoder}.{key,value}`` -> ``logits``, ``present.N.decoder.key/value``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimml.errors import ExportError

SEQ2SEQ_TYPES = ("t5", "mt5", "bart", "mbart", "marian", "whisper")  # written and checked here
_KINDS = ("decoder.key", "decoder.value", "encoder.key", "encoder.value")


def seq2seq_export_reason(config: dict[str, Any]) -> str | None:
    """Why :func:`export_torch_seq2seq` cannot write a model of ``config``, or None."""
    if config.get("model_type") not in SEQ2SEQ_TYPES:
        return (f"the torch exporter writes the encoder-decoders {', '.join(SEQ2SEQ_TYPES)}, not "
                f"{config.get('model_type')!r}")
    return None


def export_torch_seq2seq(folder: Path, onnx_dir: Path, task: str, opset: int | None = None) -> None:
    """Write ``folder``'s encoder-decoder for ``task`` (``text2text-generation``, or
    ``automatic-speech-recognition`` for Whisper) into ``onnx_dir`` as the three graphs above.

    Raises:
        ExportError: transformers could not load the model, or a trace failed (the first line says why).
    """
    import torch
    from optimum.exporters.tasks import TasksManager

    from slimml.convert.export_torch import trace
    from slimml.convert.export_torch_decoder import traceable_seq2seq

    base = task.removesuffix("-with-past")
    try:
        model = TasksManager.get_model_from_task(base, str(folder), library_name="transformers", local_files_only=True,
                                                 attn_implementation="eager", torch_dtype=torch.float32).float().eval()
    except Exception as e:
        raise ExportError(f"transformers could not load {folder.name} as {base!r} ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:200]}); pass --task with the model's task.") from None
    audio = model.config.model_type == "whisper"
    layers = getattr(model.config, "decoder_layers", None) or model.config.num_decoder_layers
    encoder_names = ("input_features",) if audio else ("input_ids", "attention_mask")
    enc_example = _encoder_example(model, audio)
    text_axes = {0: "batch_size", 1: "encoder_sequence_length"}
    enc_axes = {"input_features": {0: "batch_size"}} if audio else {n: text_axes for n in encoder_names}
    enc_axes["last_hidden_state"] = {0: "batch_size", 1: "encoder_sequence_length"}

    def failed(part: str):
        return lambda why: (f"torch.onnx.export could not write {folder.name}'s {part} ({why}); install optimum-onnx with "
                            "transformers 4.57 (pip install 'transformers==4.57.6' 'optimum-onnx==0.1.0').")

    with torch.no_grad():
        hidden = model.get_encoder()(**dict(zip(encoder_names, enc_example)), return_dict=True).last_hidden_state
    module = _modules()
    mask = None if audio else enc_example[1]
    ids = torch.tensor([[model.config.decoder_start_token_id or 0]] * hidden.shape[0])
    dec_names = ("input_ids", *(() if audio else ("encoder_attention_mask",)), "encoder_hidden_states")
    dec_example = (ids, *(() if audio else (mask,)), hidden)
    present = [f"present.{i}.{k}" for i in range(layers) for k in _KINDS]
    cache_axes = {"decoder": "past_decoder_sequence_length + 1", "encoder": "encoder_sequence_length_out"}
    axes = {"input_ids": {0: "batch_size", 1: "decoder_sequence_length"}, "encoder_attention_mask": text_axes,
            "encoder_hidden_states": {0: "batch_size", 1: "encoder_sequence_length"},
            "logits": {0: "batch_size", 1: "decoder_sequence_length"}}
    for name in present:  # present.N.decoder.key: the decoder's positions so far; .encoder.: the encoder's length
        axes[name] = {0: "batch_size", 2: cache_axes[name.split(".")[2]]}
    past_names = [n.replace("present.", "past_key_values.", 1) for n in present]
    past_axes = {n: {0: "batch_size", 2: "past_decoder_sequence_length" if ".decoder." in n else "encoder_sequence_length_out"}
                 for n in past_names}
    step_names = ("input_ids", *(() if audio else ("encoder_attention_mask",)), *past_names)
    step_out = ("logits", *[n for n in present if ".decoder." in n])
    with traceable_seq2seq(model):
        trace(module["encoder"](model, encoder_names).eval(), enc_example, onnx_dir / "encoder_model.onnx", encoder_names,
              ("last_hidden_state",), enc_axes, opset, failed=failed("encoder"))
        trace(module["decoder"](model, dec_names, layers).eval(), dec_example, onnx_dir / "decoder_model.onnx", dec_names,
              ("logits", *present), axes, opset, failed=failed("decoder"))
        with torch.no_grad():  # the first step's caches: the example the step after it is traced with
            first = module["decoder"](model, dec_names, layers)(*dec_example)
        nxt = first[0][:, -1:].argmax(-1)
        trace(module["with_past"](model, step_names, layers).eval(), (nxt, *(() if audio else (mask,)), *first[1:]),
              onnx_dir / "decoder_with_past_model.onnx", step_names, step_out,
              {**axes, **past_axes, "input_ids": {0: "batch_size"}, "logits": {0: "batch_size"}},
              opset, failed=failed("decoder with its cache"))
    for graph in ("encoder_model", "decoder_model", "decoder_with_past_model"):
        _unlabel_interleaved(onnx_dir / f"{graph}.onnx")


def _unlabel_interleaved(onnx_path: Path) -> int:
    """Take the layer out of the names of nodes traced ahead of their layer, inside another's:
    transformers 5's T5 and BART share shape computations between their layers' cross-attention, and
    the trace names them after a later layer, so the splitter saw that layer begin inside the one
    before and cut the decoder otherwise than the decoder with past (whose shards then could not read
    the decoder's weights). A layer's own nodes are its longest unbroken run and what follows it; a
    node of it before that run, within another layer's span, is renamed. Returns how many were."""
    import onnx

    from slimml.convert.shard import LAYER_RE, layer_key

    model = onnx.load(str(onnx_path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type != "Constant"]  # the splitter makes constants weights
    keys = [layer_key(n) for n in nodes]
    span: dict[str, list[int]] = {}
    run: dict[str, tuple[int, int]] = {}  # layer -> (length, start) of its longest unbroken run
    start = 0
    for i, k in enumerate(keys):
        if k is not None:
            span.setdefault(k, [i, i])[1] = i
        if i + 1 == len(keys) or keys[i + 1] != k:
            if k is not None and i + 1 - start > run.get(k, (0, 0))[0]:
                run[k] = (i + 1 - start, start)
            start = i + 1
    ahead = [n for i, (n, k) in enumerate(zip(nodes, keys))
             if k is not None and i < run[k][1] and any(lo < i < hi for other, (lo, hi) in span.items() if other != k)]
    if not ahead:
        return 0

    def bare(text: str) -> str:
        return LAYER_RE.sub(lambda m: m.group(0).replace(".", "").replace("_", ""), text)

    renamed = {o: bare(o) for n in ahead for o in n.output}
    for n in ahead:
        n.name = bare(n.name)
    for n in model.graph.node:
        n.input[:] = [renamed.get(x, x) for x in n.input]
        n.output[:] = [renamed.get(x, x) for x in n.output]
    onnx.save(model, str(onnx_path))
    return len(ahead)


def _encoder_example(model: Any, audio: bool) -> tuple[Any, ...]:
    import torch

    if audio:  # 30 s of log-mel frames, as Whisper's feature extractor pads every clip
        frames = 2 * model.config.max_source_positions
        return (torch.randn(2, model.config.num_mel_bins, frames, generator=torch.Generator().manual_seed(0)),)
    ids = torch.tensor([[13, 8, 2372, 19, 207, 1], [13, 207, 1, 0, 0, 0]]) % model.config.vocab_size
    return ids, (torch.arange(6) < torch.tensor([[6], [3]])).long()


def _modules() -> dict[str, type]:
    """The wrapper modules the exporter traces (a function, so that importing this file needs no torch)."""
    import torch
    from transformers.cache_utils import EncoderDecoderCache

    from slimml.convert.export_torch_decoder import cache_keyword, cache_tensors, dynamic_cache, returned_cache

    class Encoder(torch.nn.Module):
        def __init__(self, model, names):
            super().__init__()
            self.model, self.names = model, names

        def forward(self, *args):
            return self.model.get_encoder()(**dict(zip(self.names, args)), return_dict=True).last_hidden_state

    def layer_tensors(cache, layers):
        own, cross = cache_tensors(cache.self_attention_cache), cache_tensors(cache.cross_attention_cache)
        return [t for i in range(layers) for t in (*own[i], *cross[i])]

    class Step(torch.nn.Module):
        """A decoder step called with its inputs by name (``names``) over ``layers`` layers."""

        def __init__(self, model, names, layers):
            super().__init__()
            self.model, self.names, self.layers = model, names, layers

        def step(self, feeds, cache, hidden):
            mask = {"attention_mask": feeds["encoder_attention_mask"]} if "encoder_attention_mask" in feeds else {}
            return self.model(decoder_input_ids=feeds["input_ids"], encoder_outputs=(hidden,), **{cache_keyword(self.model): cache},
                              use_cache=True, return_dict=True, **mask)

    class Decoder(Step):
        """The first step: the start tokens over the encoder's output; every layer's caches out."""

        def forward(self, *args):
            feeds = dict(zip(self.names, args))
            out = self.step(feeds, EncoderDecoderCache(dynamic_cache({}), dynamic_cache({})), feeds["encoder_hidden_states"])
            return (out.logits, *layer_tensors(returned_cache(out), self.layers))

    class WithPast(Step):
        """A later step: one token per row with both caches fed back; the self-attention cache out."""

        def forward(self, *args):
            feeds = dict(zip(self.names, args))
            own = dynamic_cache({i: (feeds[f"past_key_values.{i}.decoder.key"], feeds[f"past_key_values.{i}.decoder.value"])
                                 for i in range(self.layers)})
            cross = dynamic_cache({i: (feeds[f"past_key_values.{i}.encoder.key"], feeds[f"past_key_values.{i}.encoder.value"])
                                   for i in range(self.layers)})
            cache = EncoderDecoderCache(own, cross)
            for i in range(self.layers):  # the cross-attention cache is complete: the encoder's output is not read again
                cache.is_updated[i] = True
            key = feeds["past_key_values.0.encoder.key"]
            width = self.model.config.d_model
            stand_in = key.new_zeros(key.shape[0], key.shape[2], width)  # the encoder's length, for the masks
            out = self.step(feeds, cache, stand_in)
            tensors = cache_tensors(returned_cache(out).self_attention_cache)
            return (out.logits, *[t for i in range(self.layers) for t in tensors[i]])

    return {"encoder": Encoder, "decoder": Decoder, "with_past": WithPast}
