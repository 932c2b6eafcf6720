"""Split one ONNX graph into self-contained shards at layer boundaries.

The splitter works on any graph. It walks the nodes in topological order and, for every cut
position, counts the activations that would cross it (tensors made before the cut and read
after it; model inputs and weights do not count, since every shard can take those directly).
Good cuts are where few tensors cross: between the layers of a transformer that is the hidden
state plus side tensors such as the extended attention mask. Layers are found from node names
(``/encoder/layer.3/...``, ``/model/layers.7/...``, ``/transformer/h.0/...``); without them,
cuts are placed where the fewest tensors cross and shards are balanced by weight bytes.

Each shard is written as ``shard_NNN.onnx`` with its weights in ``shard_NNN.onnx.data``, so a
shard can be loaded, memory-mapped or dropped on its own, and models over 2 GB work. Weights are
read one shard at a time, so splitting needs about one shard's worth of memory, not the model's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from slimml.convert.graph_prep import node_uses, prepare, toposort
from slimml.errors import ConfigError, ExportError
from slimml.runtime.artifact.manifest import ShardSpec, TensorSpec

if TYPE_CHECKING:  # onnx loads when a graph is sharded, not when the CLI reads ShardConfig
    import onnx

# "layer.3", "layers.12", "h.0", "block.2", "blocks.5" between "/" or "." separators.
LAYER_RE = re.compile(r"(?:^|[/.])(layers?|h|blocks?|block)[._](\d+)(?=[/._]|$)")
_WEIGHT_MIN_BYTES = 1024  # initializers smaller than this are constants, not weights


@dataclass
class ShardConfig:
    """How to split a graph.

    Args:
        mode: ``"per-layer"`` (one shard per detected layer, plus embeddings and head), ``"count"``
            (``count`` shards balanced by weight bytes) or ``"size"`` (shards of at most
            ``max_mb`` megabytes of weights where a cut allows).
        count: number of shards for ``mode="count"``.
        max_mb: megabytes of weights per shard for ``mode="size"``.
    """

    mode: str = "per-layer"
    count: int | None = None
    max_mb: float | None = None

    def __post_init__(self):
        if self.mode not in ("per-layer", "count", "size"):
            raise ConfigError(f"unknown shard mode {self.mode!r}; use 'per-layer', a number of shards, or --shard-size MB.")
        if self.mode == "count" and (self.count is None or self.count < 1):
            raise ConfigError(f"--shards must be 'per-layer' or a whole number >= 1, got {self.count!r}.")
        if self.mode == "size" and (self.max_mb is None or self.max_mb <= 0):
            raise ConfigError(f"--shard-size must be a positive number of MB, got {self.max_mb!r}.")

    @classmethod
    def parse(cls, shards: str | int | None = "per-layer", shard_size_mb: float | None = None) -> ShardConfig:
        """Build from the CLI's ``--shards per-layer|N`` and ``--shard-size MB``.

        Args:
            shards: ``"per-layer"`` (or None), or a number of shards (an int, or its text).
            shard_size_mb: megabytes of weights a shard at most; not with a number of shards.

        Returns:
            The :class:`ShardConfig`.

        Raises:
            ConfigError: both given, or a ``shards`` that is neither ``"per-layer"`` nor a whole number >= 1.

        Example:
            >>> ShardConfig.parse("4")
            ShardConfig(mode='count', count=4, max_mb=None)
        """
        if shard_size_mb is not None:
            if shards not in (None, "per-layer"):
                raise ConfigError(f"--shards {shards} and --shard-size {shard_size_mb:g} each decide the shards; give one "
                                  "of them.")
            return cls(mode="size", max_mb=shard_size_mb)
        if shards is None or shards == "per-layer":
            return cls()
        try:
            return cls(mode="count", count=int(shards))
        except ValueError:
            raise ConfigError(f"--shards must be 'per-layer' or a whole number, got {shards!r}.") from None


@dataclass
class _Graph:
    """The facts about a graph that choosing cuts needs."""

    nodes: list[onnx.NodeProto]
    uses: list[set[str]]  # tensor names each node reads, subgraph captures included
    producer: dict[str, int]  # activation name -> index of the node making it
    weights: dict[str, onnx.TensorProto]
    inputs: list[str]
    outputs: list[str]
    live: np.ndarray  # live[i]: activations crossing a cut before node i (i in 0..n)
    cum_bytes: np.ndarray  # cum_bytes[i]: weight bytes first used by nodes[:i]
    layer_of: list[str | None]
    files: dict[str, set[str]]  # external data file -> the weights stored in it


def shard(model_path: str | os.PathLike, out_dir: str | os.PathLike, config: ShardConfig | None = None,
          prefix: str = "shard") -> list[ShardSpec]:
    """Split the ONNX model at ``model_path`` into shards written to ``out_dir``.

    Args:
        model_path: an ONNX file; external data beside it is read one shard at a time.
        out_dir: a folder (made where missing); gets ``shard_NNN.onnx`` and ``shard_NNN.onnx.data`` files.
        prefix: the files' name before ``_NNN`` (two chains in one folder need two prefixes).
        config: how to choose the cuts (default: per layer).

    Returns:
        The shards' specs (file names, weight bytes, inputs with where they come from, outputs),
        ready for the manifest.

    Example:
        >>> specs = shard("model.onnx", "out/", ShardConfig(mode="count", count=4))
    """
    import onnx

    config = config or ShardConfig()
    model_path, out_dir = Path(model_path), Path(out_dir)
    if not model_path.is_file():
        raise ConfigError(f"{model_path} is not an ONNX file; give the path of the .onnx graph to shard.")
    out_dir.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(model_path), load_external_data=False)
    prepare(model.graph, model_path.parent)
    g = _analyse(model)
    cuts = choose_cuts(g, config)
    types = _value_types(model)
    bounds = [0, *cuts, len(g.nodes)]
    specs: list[ShardSpec] = []
    made_in: dict[str, int] = {}  # activation -> shard index that outputs it
    for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        later = set().union(*g.uses[hi:]) if hi < len(g.nodes) else set()
        spec = _write_shard(model, model_path.parent, g, index, lo, hi, later, types, made_in, out_dir, prefix)
        for t in spec.outputs:
            made_in[t.name] = index
        specs.append(spec)
    return specs


def _analyse(model: onnx.ModelProto) -> _Graph:
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in weights]
    nodes = toposort(list(graph.node), set(weights) | set(inputs))
    uses = [node_uses(n) for n in nodes]
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = i
    n = len(nodes)
    last_use: dict[str, int] = {}
    for i, u in enumerate(uses):
        for name in u:
            if name in producer:
                last_use[name] = i
    diff = np.zeros(n + 2, dtype=np.int64)
    for name, c in last_use.items():
        p = producer[name]
        diff[p + 1] += 1
        diff[c + 1] -= 1
    live = np.cumsum(diff)[: n + 1]
    node_bytes = np.zeros(n, dtype=np.int64)
    seen: set[str] = set()
    for i, u in enumerate(uses):
        for name in u:
            if name in weights and name not in seen:
                seen.add(name)
                node_bytes[i] += _nbytes(weights[name])
    cum = np.concatenate([[0], np.cumsum(node_bytes)])
    files: dict[str, set[str]] = {}
    for t in graph.initializer:
        location = _location(t)
        if location is not None:
            files.setdefault(location, set()).add(t.name)
    return _Graph(
        nodes=nodes,
        uses=uses,
        producer=producer,
        weights=weights,
        inputs=inputs,
        outputs=[o.name for o in graph.output],
        live=live,
        cum_bytes=cum,
        layer_of=[layer_key(nd) for nd in nodes],
        files=files,
    )


def choose_cuts(g: _Graph, config: ShardConfig) -> list[int]:
    """Cut positions (a cut at i puts nodes[:i] before it), strictly increasing, in 1..n-1."""
    n = len(g.nodes)
    if n < 2:
        return []
    layer_cuts = _layer_cuts(g)
    if config.mode == "per-layer":
        if layer_cuts:
            return layer_cuts
        # no layer names: a balanced fallback, no shard holding only constants (axes, shapes: under 1 KiB,
        # or 1% of a graph smaller than 100 KiB), so a graph whose weights sit in one node (a static
        # embedder's table) stays one shard
        cuts = choose_cuts(g, ShardConfig(mode="count", count=min(4, n)))
        least = min(1024, g.cum_bytes[-1] / 100)
        share = lambda lo, hi: g.cum_bytes[hi] - g.cum_bytes[lo] >= least  # noqa: E731
        kept: list[int] = []
        for c in cuts:
            if share(kept[-1] if kept else 0, c) and share(c, n):
                kept.append(c)
        return kept
    candidates = _min_cuts(g) if not layer_cuts else sorted(set(layer_cuts) | set(_min_cuts(g)))
    total = int(g.cum_bytes[-1])
    if config.mode == "count":
        cuts: list[int] = []
        for k in range(1, config.count):
            target = total * k / config.count
            pool = [c for c in candidates if not cuts or c > cuts[-1]]
            if not pool:
                break
            cuts.append(min(pool, key=lambda c: (abs(int(g.cum_bytes[c]) - target), g.live[c])))
        return sorted(set(cuts))
    limit = config.max_mb * 1e6
    cuts, start = [], 0
    while True:
        ahead = [c for c in candidates if c > start]
        if not ahead or g.cum_bytes[-1] - g.cum_bytes[start] <= limit:
            return cuts
        fits = [c for c in ahead if g.cum_bytes[c] - g.cum_bytes[start] <= limit]
        start = max(fits) if fits else min(ahead)  # a piece with no cut point inside (one weight matrix) stays whole
        cuts.append(start)


def _layer_cuts(g: _Graph) -> list[int]:
    """One cut before each detected layer and one after the last, at the fewest crossing tensors."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, key in enumerate(g.layer_of):
        if key is not None:
            first.setdefault(key, i)
            last[key] = i
    keys = sorted(first, key=first.get)
    if len(keys) < 2:
        return []
    heavy = [i for i, u in enumerate(g.uses) if any(w in g.weights and _nbytes(g.weights[w]) >= _WEIGHT_MIN_BYTES for w in u)]
    cuts = []
    prev_end = 0
    for key in keys:
        hi = first[key]
        # the cut goes after the previous layer and after any weight-bearing glue before this
        # layer (an embedding lookup), and at or before this layer's first node
        lo = max([prev_end] + [i + 1 for i in heavy if prev_end <= i < hi])
        if hi >= 1:  # nothing before the first node: no cut
            cuts.append(_best_in(g, min(max(lo, 1), hi), hi))
        prev_end = last[key] + 1
    tail_heavy = [i for i in heavy if i >= prev_end]
    if prev_end < len(g.nodes) and tail_heavy:  # a head with weights (final norm, lm_head) after the last layer
        cuts.append(_best_in(g, prev_end, tail_heavy[0]))
    return sorted({c for c in cuts if 0 < c < len(g.nodes)})


def _best_in(g: _Graph, lo: int, hi: int) -> int:
    """The position in [lo, hi] with the fewest crossing activations; ties go to the latest."""
    hi = max(lo, hi)
    window = g.live[lo : hi + 1]
    best = int(window.min())
    return lo + int(np.flatnonzero(window == best)[-1])


def _min_cuts(g: _Graph) -> list[int]:
    """Positions where the fewest activations cross, inside the weight-bearing part of the graph."""
    n = len(g.nodes)
    interior = np.arange(1, n)
    if len(interior) == 0:
        return []
    has_w = np.flatnonzero(np.diff(g.cum_bytes) > 0)
    if len(has_w) >= 2:
        interior = np.arange(has_w[0] + 1, has_w[-1] + 1)
    floor = int(g.live[interior].min())
    return [int(i) for i in interior if g.live[i] <= floor + 1]


def _write_shard(model, src_dir, g, index, lo, hi, later, types, made_in, out_dir, prefix="shard") -> ShardSpec:
    import onnx
    from onnx import external_data_helper, helper

    nodes = g.nodes[lo:hi]
    made = {o for nd in nodes for o in nd.output if o}
    read = set().union(*g.uses[lo:hi]) if nodes else set()
    graph_outputs = set(g.outputs)
    in_names = sorted(
        (x for x in read if x not in made and x not in g.weights), key=lambda x: (x not in g.inputs, x)
    )
    out_names = [x for x in (o for nd in nodes for o in nd.output) if x and (x in later or x in graph_outputs)]
    weight_names = sorted(x for x in read if x in g.weights)

    inputs, in_specs = [], []
    for name in in_names:
        vi = _typed(types, name)
        inputs.append(vi)
        source: int | str = "input" if name in g.inputs else made_in.get(name, -1)
        if source == -1:
            raise ExportError(f"shard {index} reads {name!r}, which no earlier shard outputs; this graph cannot be split here.")
        in_specs.append(tensor_spec(vi, source))
    outputs = [_typed(types, name) for name in out_names]
    file = f"{prefix}_{index:03d}.onnx"
    data = f"{file}.data"
    initializers = []
    weight_bytes = 0
    linked = _link_data(g, weight_names, Path(src_dir), Path(out_dir) / data)
    for name in weight_names:
        t = onnx.TensorProto()
        t.CopyFrom(g.weights[name])
        if linked and _location(t) is not None:  # the bytes are in place already: point at the linked file
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = data
        elif external_data_helper.uses_external_data(t):
            external_data_helper.load_external_data_for_tensor(t, str(src_dir))
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
        weight_bytes += _nbytes(t)
        initializers.append(t)
    sub = helper.make_graph(nodes, f"{model.graph.name or 'graph'}_shard{index}", inputs, outputs, initializers)
    out = helper.make_model(sub, opset_imports=list(model.opset_import), producer_name="slimml")
    out.ir_version = model.ir_version
    out.functions.extend(model.functions)
    path = Path(out_dir) / file
    has_data = linked or any(_nbytes(t) >= _WEIGHT_MIN_BYTES for t in initializers)
    if linked:
        onnx.save_model(out, str(path))
    elif has_data:
        onnx.save_model(out, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=_WEIGHT_MIN_BYTES)
    else:
        onnx.save_model(out, str(path))
    layers = sorted({k for k in g.layer_of[lo:hi] if k}, key=g.layer_of[lo:hi].index)
    return ShardSpec(
        index=index,
        file=file,
        data=data if has_data else None,
        weight_bytes=weight_bytes,
        inputs=in_specs,
        outputs=[tensor_spec(vi) for vi in outputs],
        layers=layers,
    )


def _location(t: onnx.TensorProto) -> str | None:
    """The external data file a weight's bytes are in, or None for a weight stored in the graph."""
    import onnx

    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return next((e.value for e in t.external_data if e.key == "location"), None)


def _link_data(g: _Graph, weight_names: list[str], src_dir: Path, target: Path) -> bool:
    """When a shard's weights are all of one external data file of the source and nothing else is in
    it (the fused exporter writes a file per layer), make that file the shard's data file: a hard
    link, or a copy across file systems; no tensor passes through memory. True when it did."""
    import shutil

    big = [g.weights[n] for n in weight_names if _nbytes(g.weights[n]) >= _WEIGHT_MIN_BYTES]
    locations = {_location(t) for t in big}
    if len(locations) != 1 or None in locations:
        return False
    location = locations.pop()
    source = src_dir / location
    if g.files.get(location) != {t.name for t in big} or Path(location).name != location or not source.is_file():
        return False
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links refused
        shutil.copyfile(source, target)
    return True


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Types and shapes of every tensor, from ONNX shape inference (weights need not be loaded)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:
        inferred = model
    g = inferred.graph
    return {vi.name: vi for vi in [*g.value_info, *g.input, *g.output]}


def _typed(types: dict[str, onnx.ValueInfoProto], name: str) -> onnx.ValueInfoProto:
    import onnx

    vi = types.get(name)
    if vi is None or not vi.type.HasField("tensor_type") or vi.type.tensor_type.elem_type == 0:
        raise ExportError(
            f"ONNX shape inference could not tell the type of {name!r}, a tensor crossing a shard "
            "boundary. Run `onnx.shape_inference.infer_shapes` on the model, or use fewer shards."
        )
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    return out


def tensor_spec(vi: onnx.ValueInfoProto, source: int | str | None = None) -> TensorSpec:
    from onnx import helper

    tt = vi.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    shape: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        else:  # shape inference names axes it cannot relate "unk__N": those are just unknown
            shape.append(None if not d.dim_param or d.dim_param.startswith("unk__") else d.dim_param)
    return TensorSpec(name=vi.name, dtype=dtype, shape=shape, source=source)


def layer_key(node: onnx.NodeProto) -> str | None:
    """The layer a node belongs to, by its name or its outputs' (``encoder/layer.3``), or None."""
    for text in (node.name, *node.output):
        m = LAYER_RE.search(text)
        if m:
            return text[: m.end()].lstrip("/")
    return None


def _nbytes(t: onnx.TensorProto) -> int:
    import onnx
    from onnx import helper

    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return len(t.raw_data)
    count = int(np.prod(t.dims)) if len(t.dims) else 1
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
