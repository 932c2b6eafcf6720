"""A language model's check: perplexity and top-1 agreement on held-out text.

Logits compared at random inputs say nothing about whether a language model still predicts
text: a misread config or a lossy quantization passes a cosine check. So a decoder artifact is
scored on real text, the same token windows through the artifact and through the reference (the
source model as the installed transformers computes it, or the float artifact for a quantized
one): the perplexity of each, their relative difference, and how often their most likely next
token agrees.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from slimml.convert.check import refuse_nonfinite
from slimml.errors import DataError
from slimml.runtime.tasks.generation.scoring import decoder_feeds, past_shapes, score_run, windows_of  # noqa: F401
# (decoder_feeds, past_shapes, score_run: the runtime's, which model.perplexity uses; imported from here by their callers)


# A short English sample (written for slimml) for when no --eval-text is given: ~450 tokens.
SAMPLE_TEXT = """\
The village sat at the bottom of a narrow valley, where the river slowed and spread into a wide, shallow pool. \
In the summer the children waded across it to reach the orchards on the far side, and in the winter the old men \
watched the ice from the bench outside the baker's shop, arguing about whether it would hold. Nobody could remember \
a year when the bridge had not needed repairs. The council met every spring to discuss the problem, and every spring \
it decided to wait for better prices.

The new teacher arrived in September with two suitcases and a box of books. She had grown up in the city and had \
never lived more than a short walk from a train station. On her first morning she asked the class to write about the \
river. Most of the pupils wrote about fish, or about the time the water rose so high that it reached the church steps. \
One boy wrote that the river was the reason the village existed at all, because the first families had come to build \
a mill, and the mill had needed the water more than the people had needed anything else.

By the end of the year the school had started a small museum in the room behind the library. Parents brought old \
photographs, tools and letters, and the children wrote labels for each object. The museum opened on a rainy Saturday \
in June. More than two hundred people came, which was nearly everyone who lived in the valley, and the council \
announced that afternoon that the bridge would finally be rebuilt.

Scientists who study rivers say that the shape of a valley records its history. A steep, narrow channel suggests \
fast water and hard rock; a broad plain with gentle bends points to a slower river carrying fine sediment over many \
thousands of years. Floods move that sediment in sudden bursts, and a single storm can change the course of a stream \
more than a century of ordinary weather. Engineers who design bridges must therefore plan not only for the river as \
it is today, but for the river as it might become.
"""

DEFAULT_WINDOW = 256  # tokens per scored window
DEFAULT_BUDGET = 1024  # tokens scored in all


def read_eval_text(path: str | os.PathLike | None) -> tuple[str, str]:
    """The held-out text and where it came from (``"built-in sample"`` or the file's name).

    Raises:
        DataError: the file is missing, unreadable or too short to score.
    """
    if path is None:
        return SAMPLE_TEXT, "built-in sample"
    from slimml.runtime.tools.evaluate import read_text  # as `slimml eval --data` reads it: UTF-8, or refused

    p = Path(path)
    text = read_text(p)
    if len(text.split()) < 50:
        raise DataError(f"the evaluation text {p} has fewer than 50 words; give a longer UTF-8 text file with --eval-text.")
    return text, p.name


def token_windows(tokenizer_file: str | os.PathLike, text: str, window: int = DEFAULT_WINDOW,
                  budget: int = DEFAULT_BUDGET) -> np.ndarray:
    """The text's token ids cut into consecutive windows of ``window`` tokens, at most ``budget``
    tokens in all: an int64 array ``(n_windows, size)``, ``size <= window`` so that a text shorter than the
    budget is used nearly whole."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.no_padding()
    tok.no_truncation()
    try:
        ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)[:budget]
    except Exception as e:  # tokenizers' own: a character outside a vocabulary with no unknown token
        raise DataError(f"the model's tokenizer ({Path(tokenizer_file).name}) cannot encode the evaluation text ({e}); "
                        "give a text it can encode with --eval-text, or fix the tokenizer (a GGUF file: its "
                        "tokenizer.ggml.unknown_token_id).") from None
    if len(ids) < 2:
        raise DataError(f"the model's tokenizer ({Path(tokenizer_file).name}) turns the evaluation text ({len(text)} "
                        f"characters) into {len(ids)} token(s), too few to score: give a longer text with --eval-text, "
                        "or, if the text is long, fix the tokenizer (a GGUF file's tokenizer.ggml.* fields).")
    return windows_of(ids, window)  # windows of equal length covering (nearly) every token


def artifact_context(folder: str | os.PathLike, manifest: Any) -> int | None:
    """The positions the artifact in ``folder`` takes (as its runtime reads them), without loading it."""
    from slimml.runtime.artifact.integrity import check_shard_file, max_sequence_length

    return max_sequence_length([check_shard_file(Path(folder), s) for s in manifest.shards], manifest)


def torch_scores(folder: str | os.PathLike, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`score_run` for the Hugging Face model in ``folder`` as the installed transformers computes it (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from slimml.convert.layerwise import streamed_reference
    from slimml.convert.weights import weight_bytes
    from slimml.runtime.engine.budget import bigger_than_memory

    if bigger_than_memory(weight_bytes(Path(folder))):  # never whole in memory: one layer at a time
        return score_run(streamed_reference(Path(folder)), lambda ids: {"input_ids": ids}, windows)
    from slimml.convert.fused_family import reference_kwargs

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                                 **reference_kwargs(folder)).float().eval()  # MXFP4 experts: bf16 on a CPU

    def run(feeds: dict) -> dict:
        with torch.no_grad():
            return {"logits": model(input_ids=torch.from_numpy(feeds["input_ids"])).logits.numpy()}

    try:
        return score_run(run, lambda ids: {"input_ids": ids}, windows)
    finally:
        del model


def compare(ours: tuple[np.ndarray, np.ndarray], reference: tuple[np.ndarray, np.ndarray], names=("artifact", "source")) -> dict[str, Any]:
    """Perplexities, their relative difference (``ours / reference - 1``) and top-1 agreement."""
    ppl = float(np.exp(ours[0].mean()))
    ref = float(np.exp(reference[0].mean()))
    return {
        f"perplexity_{names[0]}": round(ppl, 4), f"perplexity_{names[1]}": round(ref, 4),
        "perplexity_rel_diff": round(ppl / ref - 1.0, 6), "top1_agreement": round(float((ours[1] == reference[1]).mean()), 6),
        "eval_tokens": int(ours[0].size),
    }


def check_language_model(folder: Path, manifest: Any, source_folder: Path, eval_text: str | os.PathLike | None = None) -> dict[str, Any]:
    """The artifact in ``folder`` against its source's transformers model on held-out text."""
    from slimml.convert.layerwise import check_load_options
    from slimml.runtime.loader import load

    text, origin = read_eval_text(eval_text)
    model = load(folder, device="cpu", **check_load_options(manifest))  # streamed when bigger than memory
    try:
        context = model.max_sequence_length  # a window never passes the model's positions
        window = min(DEFAULT_WINDOW, context) if context else DEFAULT_WINDOW
        windows = token_windows(folder / manifest.tokenizer["file"], text, window=window)
        reference = torch_scores(source_folder, windows)
        refuse_nonfinite(source_folder.name, reference[0], "losses")  # NaN there is its weights, not ours
        names = [t.name for t in manifest.inputs]
        past = past_shapes(manifest.inputs)
        ours = score_run(model.run, lambda ids: decoder_feeds(names, ids, past), windows)
    finally:
        model.close()
    found = compare(ours, reference) | {"eval_text": origin, "eval_window": window, "eval_max_tokens": DEFAULT_BUDGET}
    vocab = int(manifest.source.get("vocab_size") or 0)
    if vocab and found["perplexity_source"] > 2 * vocab:  # worse than guessing among the vocabulary
        found["source_note"] = (f"the source model itself scores perplexity {found['perplexity_source']:.4g} on the "
                                f"eval text, over twice its vocabulary ({vocab}): its tokenizer or weights are broken "
                                "(a GGUF file: check its tokenizer.ggml.* fields); fix the source, or pass --eval-text "
                                "with text it was trained on")
    return found


def is_language_model(manifest: Any) -> bool:
    """A decoder with a tokenizer whose output is ``logits`` over the vocabulary."""
    return (str(manifest.task).startswith("text-generation") and manifest.tokenizer is not None
            and any(t.name == "logits" for t in manifest.outputs) and any(t.name == "input_ids" for t in manifest.inputs))
