"""Check an encoder-decoder artifact (T5, BART, Whisper) against its unsharded graphs and torch.

The check runs what generation runs: the encoder once, the decoder's first step, then a few
steps of the decoder with its cache, once through the unsharded ONNX graphs and once through
the sharded components, comparing every output of every step (logits and each layer's cache).
Against torch it compares the encoder's output and the first step's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.export import Exported
from slimml.convert.sources import Source
from slimml.runtime.tools.bench import sample_feeds
from slimml.runtime.artifact.manifest import Manifest
from slimml.runtime.tasks.seq2seq import ENCODER, sample_encoder_batches
from slimml.runtime.tasks.seq2seq_search import Decoder, Search, greedy
from slimml.runtime.engine.session import make_session

STEPS = 4


def check_seq2seq(folder: Path, manifest: Manifest, src: Source, exported: Exported, texts: list[str]) -> dict[str, Any]:
    from slimml.runtime.loader import load

    model = load(folder, device="cpu")  # the artifact's own integrity check runs here
    encoder = model.parts[ENCODER]
    if model.text is not None or manifest.preprocessor:  # two texts, or (Whisper) features of two noise recordings
        feeds = sample_encoder_batches(model, texts[:2], batch_size=2, limit=1)[0]
    elif "input_ids" in {t.name for t in encoder.inputs}:  # a text model without a tokenizer: token ids
        feeds = sample_feeds(encoder.inputs, batch=2, seq=16, source=manifest.source)
    else:  # Whisper without its feature extractor: features of the length its encoder takes
        frames = 2 * int(manifest.source.get("max_source_positions") or 1500)
        feeds = sample_feeds(encoder.inputs, batch=2, seq=frames, source=manifest.source)
    spec = manifest.seq2seq
    start = np.full((next(iter(feeds.values())).shape[0], 1), spec["decoder_start_token_id"], dtype=np.int64)
    inputs = {n: {t.name for t in p.inputs} for n, p in model.parts.items()}

    def trace(run):
        steps: list[dict[str, np.ndarray]] = []
        tokens = list(greedy(Decoder(run, inputs, feeds, on_step=steps.append), start, Search(max_length=1 + STEPS)))
        return steps, tokens

    sessions = {n: make_session(path, "cpu") for n, path in exported.graphs.items()}

    def run_graph(name, f):
        s = sessions[name]
        outs = [o.name for o in s.get_outputs()]
        return dict(zip(outs, s.run(outs, f)))

    want, want_tokens = trace(run_graph)
    encoder_want = run_graph(ENCODER, feeds)["last_hidden_state"]
    sessions.clear()  # the unsharded graphs are freed before the artifact runs
    got, got_tokens = trace(lambda name, f: model.parts[name].run(f))
    diffs = [float(np.abs(g[k] - w[k]).max()) for g, w in zip(got, want) for k in w if k in g]
    checks: dict[str, Any] = {"max_abs_diff": max(diffs), "decoder_steps_checked": len(got),
                              "same_tokens_as_graph": [t.tolist() for t in got_tokens] == [t.tolist() for t in want_tokens]}
    theirs = _torch_reference(src, exported, feeds, start)
    if theirs is not None:
        hidden, logits = theirs
        checks["max_abs_diff_vs_torch"] = max(float(np.abs(encoder_want - hidden).max()),
                                              float(np.abs(got[0]["logits"] - logits).max()))
    model.close()
    search = spec.get("search") or {}  # the generation config as convert read it
    if search.get("do_sample") is True and int(search.get("num_beams") or 1) > 1:
        checks["decoding"] = ("beam search: the generation config's do_sample is not followed with its beams "
                              "(slimml does not sample beams; generate(num_beams=1) samples)")
    return {k: round(v, 8) if isinstance(v, float) else v for k, v in checks.items()}


def _torch_reference(src: Source, exported: Exported, feeds: dict[str, np.ndarray], start: np.ndarray):
    """The torch model's encoder output and first-step logits on the same inputs, or None."""
    if src.kind != "huggingface":
        return None
    import torch
    from optimum.exporters.tasks import TasksManager

    task = exported.info.get("hf_task", "")
    model = TasksManager.get_model_from_task(task, str(src.path), library_name="transformers", local_files_only=True,
                                             torch_dtype=torch.float32).float().eval()  # as the artifact computes
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
    with torch.no_grad():
        encoded = model.get_encoder()(**tensors)
        out = model(**tensors, decoder_input_ids=torch.from_numpy(start), encoder_outputs=encoded, use_cache=False)
    return encoded.last_hidden_state.float().numpy(), out.logits.float().numpy()
