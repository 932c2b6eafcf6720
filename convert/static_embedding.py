"""Static embeddings (sentence-transformers' ``StaticEmbedding``: model2vec's potion models,
static-retrieval-mrl) as an ONNX graph slimml writes itself.

Such a model is a table of token vectors: a text's embedding is the mean of its tokens' rows
(``nn.EmbeddingBag``), tokenized without special tokens, then the pipeline's projections and
normalisation. The graph is the table lookup (``Gather``, padding zeroed by the mask); the mean,
the projections and the normalisation are the artifact's pooling record, as for a transformer.
The tokenizer is shipped without its post-processor, so the runtime adds no special tokens, and
with the truncation the library applies (none, unless the saved tokenizer sets one).
"""

from __future__ import annotations

from pathlib import Path
import numpy as np

from slimml.convert.exported import Exported
from slimml.convert.sources import Source, sentence_transformers_pooling, st_module_tensors, static_module, write_st_dense
from slimml.errors import SourceError

TOKENIZER_FILE = "tokenizer.json"
TABLE_KEYS = ("embedding.weight", "embeddings")  # sentence-transformers' name, model2vec's
OUTPUT = "last_hidden_state"  # the token vectors, as a transformer's token states are named
# the longest text in tokens where the saved tokenizer sets no truncation (the library cuts none; the
# runtime cuts a text to model.limits.max_text_chars characters first, 16,384 by default)
UNTRUNCATED = 1 << 16
TASKS = ("auto", "sentence-similarity", "feature-extraction")
TABLE = "embeddings.word_embeddings.weight"  # named as the runtime finds a token table: ids are checked against its rows


def export_static(source: Source, work_dir: Path, task: str, exporter: str, opset: int | None) -> Exported:
    """Write ``source`` (kind ``"static"``) as ``work_dir/onnx/model.onnx`` with its tokenizer and
    projections beside it.

    ``task`` ``feature-extraction`` gives each token's vector (no pooling); otherwise the artifact
    computes the library's sentence embedding.

    Raises:
        SourceError: another exporter or task asked for, a table that does not fit the tokenizer,
            weights that are not a float table, in one line; nothing is written.
    """
    folder = source.path
    if exporter != "auto":
        raise SourceError(f"{folder} is a static embedding (a table of token vectors), whose graph slimml writes itself; "
                          f"--exporter {exporter} does not apply: leave --exporter out.")
    if task not in TASKS:
        raise SourceError(f"{folder} is a static embedding: it computes sentence embeddings (--task auto) or token "
                          f"vectors (--task feature-extraction), not {task!r}; leave --task out.")
    pooling = sentence_transformers_pooling(folder) if task != "feature-extraction" else None
    module = static_module(folder)
    table = _table(module)
    onnx_dir = work_dir / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    max_length = _write_tokenizer(module, onnx_dir, rows=table.shape[0])
    _write_graph(table, onnx_dir / "model.onnx", opset or 17)
    if pooling is not None and pooling.get("dense"):
        write_st_dense(folder, pooling, onnx_dir, width=table.shape[1])
    return Exported(
        onnx_path=onnx_dir / "model.onnx", task="sentence-embedding" if pooling else "feature-extraction",
        pooling=pooling, pooling_dir=onnx_dir, tokenizer_dir=onnx_dir,
        tokenizer={"file": TOKENIZER_FILE, "max_length": max_length, "pad_token": None, "pad_id": 0},
        info={"hf_task": "feature-extraction", "exporter": "static",
              "static_embedding": {"tokens": int(table.shape[0]), "dimensions": int(table.shape[1])}},
    )


def _table(module: Path) -> np.ndarray:
    """The module's (tokens, dimensions) float32 table; a file holding more than the table (model2vec's
    newer token weights or vocabulary mapping, which sentence-transformers does not read) is refused."""
    tensors = st_module_tensors(module, "StaticEmbedding")
    keys = [k for k in TABLE_KEYS if k in tensors]
    if len(keys) != 1 or len(tensors) != 1 or tensors[keys[0]].ndim != 2 or 0 in tensors[keys[0]].shape:
        raise SourceError(f"{module}'s StaticEmbedding weights hold {', '.join(sorted(tensors)) or 'nothing'}, not one "
                          f"(tokens, dimensions) table named {' or '.join(TABLE_KEYS)} as sentence-transformers reads it "
                          "(model2vec's token weights or vocabulary mapping are not part of it); save the model with "
                          "sentence-transformers (SentenceTransformer(modules=[StaticEmbedding.from_model2vec(path)]).save(out)) "
                          "and convert that folder.")
    table = np.ascontiguousarray(tensors[keys[0]], dtype=np.float32)
    if not np.isfinite(table).all():
        raise SourceError(f"{module}'s embedding table holds NaN or infinite values; restore the model from its source.")
    return table


def _write_tokenizer(module: Path, onnx_dir: Path, rows: int) -> int:
    """The module's ``tokenizer.json`` without its post-processor (no special tokens: the library
    tokenizes with ``add_special_tokens=False``) and without padding; returns the longest text in tokens."""
    from tokenizers import Tokenizer

    path = module / TOKENIZER_FILE
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- tokenizers' own exception for a missing or damaged file
        raise SourceError(f"could not read the StaticEmbedding tokenizer {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          "restore the folder as sentence-transformers saved it.") from None
    if tok.get_vocab_size(with_added_tokens=True) > rows:
        raise SourceError(f"{path} has {tok.get_vocab_size(with_added_tokens=True)} tokens and the embedding table "
                          f"{rows} rows, so some tokens have no vector; restore the tokenizer the table was made with.")
    truncation = tok.truncation  # kept by the library (it clears only the padding)
    if truncation and str(truncation.get("direction", "right")).lower() != "right":
        raise SourceError(f"{path} cuts long texts from the left, and slimml's runtime cuts them from the right, so "
                          "texts past its max_length would embed otherwise; set the tokenizer's truncation direction to "
                          "right (or remove its truncation) and save the model again.")
    tok.post_processor = None
    tok.no_padding()
    tok.no_truncation()  # the runtime sets max_length itself
    tok.save(str(onnx_dir / TOKENIZER_FILE))
    return int(truncation["max_length"]) if truncation else UNTRUNCATED


def _write_graph(table: np.ndarray, path: Path, opset: int) -> None:
    """``last_hidden_state = table[input_ids] * attention_mask``: each token's vector, zero where padded."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    tokens = ["batch", "sequence"]
    graph = helper.make_graph(
        [helper.make_node("Gather", [TABLE, "input_ids"], ["token_vectors"], axis=0),
         helper.make_node("Cast", ["attention_mask"], ["mask_float"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["mask_float", "last_axis"], ["mask_column"]) if opset >= 13 else
         helper.make_node("Unsqueeze", ["mask_float"], ["mask_column"], axes=[-1]),  # axes an attribute before opset 13
         helper.make_node("Mul", ["token_vectors", "mask_column"], [OUTPUT])],
        "static_embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, tokens),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, tokens)],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [*tokens, table.shape[1]])],
        [numpy_helper.from_array(table, TABLE)]
        + ([numpy_helper.from_array(np.array([-1], np.int64), "last_axis")] if opset >= 13 else []),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="slimml")
    onnx.checker.check_model(model)
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
