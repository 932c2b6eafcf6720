"""What slimml checks in a shard's ONNX file before ONNX Runtime sees it, and after.

Hashes (``files.verify_files``) prove a file is the one the manifest lists; they do not prove
the manifest is honest. An artifact from elsewhere can list, with correct hashes, a shard whose
ONNX ``external_data`` points at ``../../home/me/.ssh/id_rsa``, which ONNX Runtime would read
as weights. So each shard file is parsed (without loading any weights) and every external
tensor must live in the shard's own listed data file, inside its bounds.

After load, :class:`slimml.runtime.artifact.watch.FileWatch` notices files changed under a running model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from slimml.errors import ArtifactError
from slimml.runtime.artifact.files import safe_path
from slimml.runtime.artifact.manifest import Manifest, ShardSpec

# initializer names that hold learned absolute positions: (max_positions, hidden)
_POSITION_TABLES = ("position_embeddings", "position_embedding", "pos_embed", "wpe", "embed_positions")
# initializer names of token-embedding tables: (vocab_size, hidden); input_ids index their rows
_TOKEN_TABLES = ("word_embeddings", "embed_tokens", "wte", "tok_embeddings")
# initializer names of segment tables (BERT's token types): token_type_ids index their rows, and ONNX's
# Gather takes a negative index from the end, so -1 would silently read segment 1
_TYPE_TABLES = ("token_type_embeddings",)
# a vision tower's position table counts patches, not tokens (CLIP holds both towers in one graph)
_VISION_PARTS = ("vision", "visual", "image", "patch")


@dataclass
class ShardFacts:
    """What parsing a shard file told us."""

    external_tensors: int  # weights stored in the shard's data file
    max_positions: int | None  # rows of a learned position-embedding table, when the shard has one
    vocab_size: int | None = None  # rows of a token-embedding table, when the shard has one
    type_vocab_size: int | None = None  # rows of a token-type (segment) table, when the shard has one


def check_shard_file(folder: Path, shard: ShardSpec, boundary: bool = True) -> ShardFacts:
    """Parse ``shard.file`` (weights not loaded) and confine its external data to ``shard.data``;
    ``boundary``: its graph's inputs and outputs must be the ones ``shard`` lists (False for a graph
    slimml rewrote itself, a packed cache entry, which the shard's entry does not describe).

    Raises:
        ArtifactError: the file is not ONNX, or a tensor's ``external_data`` location is not the
            shard's own data file (``..``, an absolute path, another file), or reaches past its end.
    """
    import onnx  # parsing only; onnx is a base dependency, imported when a model loads
    from onnx import external_data_helper

    path = safe_path(folder, shard.file)
    try:
        model = onnx.load_model_from_string(path.read_bytes())  # never follows external data
    except Exception as e:  # protobuf's DecodeError and friends
        raise ArtifactError(
            f"{shard.file} is not a readable ONNX file ({type(e).__name__}); the artifact is damaged: re-convert it."
        ) from None
    field = _undecodable_text(model)
    if field is not None:
        raise ArtifactError(
            f"{shard.file} holds a {field!r} that is not valid UTF-8; the file is damaged: re-convert it."
        )
    if boundary:
        _check_boundary(shard, model.graph)
    data = safe_path(folder, shard.data).resolve() if shard.data else None
    data_size = data.stat().st_size if data is not None and data.is_file() else 0
    count, positions, vocab, types = 0, None, None, None
    looked_up = _looked_up(model.graph)
    for t in _tensors(model):
        if (len(t.dims) == 2 and any(k in t.name for k in _POSITION_TABLES) and t.dims[0] > 0
                and not any(k in t.name.lower() for k in _VISION_PARTS)):
            positions = int(t.dims[0])
        if len(t.dims) == 2 and any(k in t.name for k in _TOKEN_TABLES) and t.dims[0] > 0 and t.name in looked_up:
            vocab = int(t.dims[0])  # not a tied lm_head's transposed copy (hidden, vocab), which a MatMul reads
        if len(t.dims) == 2 and any(k in t.name for k in _TYPE_TABLES) and t.dims[0] > 0:
            types = int(t.dims[0])
        if not external_data_helper.uses_external_data(t):
            continue
        count += 1
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        target = None
        if loc and "\x00" not in loc and not os.path.isabs(loc) and ".." not in Path(loc).parts:  # NUL: refused, not ValueError
            target = (path.parent / loc).resolve()
        if data is None or target != data:
            raise ArtifactError(
                f"{shard.file}: weight {t.name!r} reads its data from {loc!r}, which is not the shard's own data "
                f"file {shard.data!r}; refusing to load it (an artifact may only read files it lists). Copy the "
                "artifact again from where it was made, or convert the model again."
            )
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
        except ValueError:
            offset, length = -1, -1
        if offset < 0 or (length >= 0 and offset + length > data_size) or offset > data_size:
            raise ArtifactError(
                f"{shard.file}: weight {t.name!r} reads bytes {offset}..{offset + max(length, 0)} of {shard.data}, "
                f"which has {data_size}; the artifact is damaged: re-convert it."
            )
    return ShardFacts(external_tensors=count, max_positions=positions, vocab_size=vocab, type_vocab_size=types)


def _check_boundary(shard: ShardSpec, graph) -> None:
    """The shard's graph takes the inputs and gives the outputs its manifest entry lists, of the
    dtypes it lists: a graph swapped under honest hashes (or a manifest that lies about it) is refused
    at load, not run into an error that blames the caller's feeds, or into outputs of another shape."""
    from onnx import helper

    weights = {t.name for t in graph.initializer}
    takes = {v.name: v for v in graph.input if v.name not in weights}
    gives = {v.name: v for v in graph.output}
    listed_in, listed_out = {t.name: t for t in shard.inputs}, {t.name: t for t in shard.outputs}
    unfed = sorted(set(takes) - set(listed_in))
    missing = sorted(set(listed_out) - set(gives))
    wrong = [n for n, t in [*listed_in.items(), *listed_out.items()]
             if (v := takes.get(n) or gives.get(n)) is not None and v.type.tensor_type.elem_type
             and _dtype(helper, v.type.tensor_type.elem_type) not in (None, t.dtype)]
    shaped = [n for n, t in [*listed_in.items(), *listed_out.items()]
              if (v := takes.get(n) or gives.get(n)) is not None and not _same_shape(v, t.shape)]
    if unfed or missing or wrong or shaped:
        what = (f"takes {unfed[0]!r}, which its manifest entry does not list" if unfed else
                f"does not give {missing[0]!r}, which its manifest entry lists" if missing else
                f"holds {wrong[0]!r} in another dtype than its manifest entry lists" if wrong else
                f"holds {shaped[0]!r} in another shape than its manifest entry lists")
        raise ArtifactError(f"{shard.file}'s graph {what}; the artifact is damaged or was tampered with: re-convert it.")


def _same_shape(value, listed) -> bool:
    """The graph's shape of ``value`` agrees with the manifest's ``listed``: the same rank, and the
    same size wherever both give a number (a name, or a graph without shapes, agrees with anything)."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape") or listed is None:
        return True
    dims = tensor.shape.dim
    if len(dims) != len(listed):
        return False
    return all(not (d.HasField("dim_value") and isinstance(n, int) and not isinstance(n, bool)) or d.dim_value == n
               for d, n in zip(dims, listed))


def _dtype(helper, elem_type: int) -> str | None:
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None


def verify_shard(folder: Path, manifest: Manifest, shard: ShardSpec) -> ShardFacts:
    """Everything to check before (re)creating a session for one shard: its files' size and sha256,
    then its external data. Call it wherever a shard's session is made after ``load`` (a shard
    evicted and reloaded, a session rebuilt): a file corrupted on disk since is refused, not run.

    Raises:
        IntegrityError / ArtifactError: as ``verify_file`` and ``check_shard_file``.
    """
    from slimml.runtime.artifact.files import verify_file

    for entry in manifest.files:
        if entry.path in (shard.file, shard.data):
            verify_file(folder, entry)
    return check_shard_file(folder, shard)


def _undecodable_text(message) -> str | None:
    """The first string field holding bytes that are not UTF-8 (protobuf hands those back as bytes).

    ONNX Runtime would choke on them while formatting its own error message, and its Python
    wrapper prints that to stdout; refuse them first.
    """
    stack = [message]
    while stack:
        msg = stack.pop()
        for fd, value in msg.ListFields():
            repeated = getattr(fd, "is_repeated", None)
            repeated = fd.label == fd.LABEL_REPEATED if repeated is None else repeated
            values = value if repeated else [value]
            if fd.type == fd.TYPE_STRING:
                if any(isinstance(v, bytes) for v in values):
                    return fd.name
            elif fd.type == fd.TYPE_MESSAGE:
                stack.extend(values)
    return None


# ops between a table's initializer and the Gather that reads its rows (a quantized or half-precision table)
_TABLE_PASSES = ("DequantizeLinear", "Cast", "Identity")


def _looked_up(graph) -> set[str]:
    """Names whose rows a Gather reads: its data input (and a block-quantized one's scales and zero
    points), and the tensors that reach it through :data:`_TABLE_PASSES` (``DequantizeLinear(table_q) -> Gather``)."""
    found = {x for n in graph.node if n.op_type in ("Gather", "GatherBlockQuantized") and n.input  # its data, scales
             for x in (n.input[0], *n.input[2:])}
    passes = [n for n in graph.node if n.op_type in _TABLE_PASSES and n.input and n.output]
    grew = True
    while grew:
        grew = False
        for n in passes:
            if n.output[0] in found and n.input[0] not in found:
                found.add(n.input[0])
                grew = True
    return found


def _tensors(model):
    """Every TensorProto in the model: initializers, sparse parts, constants, subgraphs, functions."""
    graphs = [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs or nodes:
        if graphs:
            g = graphs.pop()
            yield from g.initializer
            for sp in g.sparse_initializer:
                yield sp.values
                yield sp.indices
            nodes.extend(g.node)
            continue
        node = nodes.pop()
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values
                yield a.sparse_tensor.indices
            if a.HasField("g"):
                graphs.append(a.g)
            graphs.extend(a.graphs)


def vocab_size(facts: list[ShardFacts]) -> int | None:
    """Rows of the model's token-embedding table, when one is found: token ids must be below it."""
    sizes = [f.vocab_size for f in facts if f.vocab_size]
    return min(sizes) if sizes else None


def id_limits(facts: list[ShardFacts]) -> dict[str, int]:
    """The id inputs whose values index a table, with its rows: ``input_ids`` the token
    embeddings, ``token_type_ids`` the segment table. Values outside ``[0, rows)`` are refused."""
    limits = {"input_ids": vocab_size(facts)}
    types = [f.type_vocab_size for f in facts if f.type_vocab_size]
    if types:
        limits["token_type_ids"] = min(types)
    return {k: v for k, v in limits.items() if v}


def max_sequence_length(facts: list[ShardFacts], manifest: Manifest) -> int | None:
    """The longest sequence the model takes: its position table's rows, less the rows its position
    ids skip (the source's ``max_tokens``: RoBERTa's 514 rows take 512 tokens); else the smaller of the
    tokenizer's max_length and the source config's ``max_position_embeddings`` (rotary decoders
    have no table, and without a tokenizer nothing else bounds a sequence of ids)."""
    tables = [f.max_positions for f in facts if f.max_positions]
    if tables:
        tokens = (manifest.source or {}).get("max_tokens")
        return min(tables + ([tokens] if type(tokens) is int and tokens > 0 else []))
    known = []
    if manifest.tokenizer and manifest.tokenizer.get("max_length"):
        known.append(int(manifest.tokenizer["max_length"]))
    positions = (manifest.source or {}).get("max_position_embeddings")
    if type(positions) is int and positions > 0:
        known.append(positions)
    return min(known) if known else None
