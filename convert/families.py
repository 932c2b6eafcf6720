"""The model families ``convert`` knows, in one place: how each is sharded, written and checked.

- ``plain``: one graph, one chain of shards (encoders, classifiers, small decoders).
- ``towers``: a two-tower model (CLIP): a text and a vision component, scored zero-shot.
- ``seq2seq``: an encoder-decoder (T5, BART, Whisper): encoder, decoder and decoder with past,
  the two decoders storing their shared weights once.
- ``layerwise``: a decoder too big to trace whole, written layer by layer from a small template.

Each component records the assets (tokenizer, preprocessor) its inputs are made with, so the
runtime infers nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimml.convert.check import SAMPLE_TEXTS, verify, verify_layerwise
from slimml.convert.export import Exported
from slimml.convert.folder_facts import GENERATION_CONFIG_FILE
from slimml.convert.layerwise import write_layerwise
from slimml.convert.shard import ShardConfig, shard, tensor_spec
from slimml.convert.sources import Source
from slimml.convert.towers import split_towers
from slimml.errors import ExportError
from slimml.runtime.artifact.manifest import Manifest, ShardSpec, TensorSpec
from slimml.runtime.artifact.records import Pooling, Preprocessor, Tokenizer
from slimml.runtime.artifact.writer import ArtifactWriter

FAMILIES = ("plain", "towers", "seq2seq", "layerwise")
# an encoder-decoder's graphs: (folder, shard file prefix); both decoders in one folder, so the
# one with past can read the other's data files
_SEQ2SEQ_PLACES = {"encoder": ("encoder", "shard"), "decoder": ("decoder", "shard"), "decoder_with_past": ("decoder", "past")}


def write_chains(w: ArtifactWriter, src: Source, exported: Exported, config: ShardConfig) -> tuple[str, dict | None]:
    """Shard the exported model into ``w`` as its family needs; add its assets. Returns the family
    and, for a two-tower model, its zero-shot scoring (text and image component, scale)."""
    assets = _add_assets(w, exported)
    generation = src.path / GENERATION_CONFIG_FILE if src.kind == "huggingface" and src.path.is_dir() else None
    if exported.tokenizer is None and exported.task.startswith("text-generation") and generation and generation.is_file():
        w.add_file(generation, GENERATION_CONFIG_FILE, listed=True)  # its sampling and end ids, without a tokenizer too
    parts, zero_shot = split_towers(exported.onnx_path, src.path if src.kind == "huggingface" else None)
    if exported.layerwise:
        lw = exported.layerwise
        specs = write_layerwise(exported.onnx_path, lw["template"], lw["folder"], lw["depth"], w.work, w.folder)
        w.add_chain(specs, *_io(exported.onnx_path, specs), pooling=exported.pooling)
        return "layerwise", None
    if exported.graphs:
        encoder_takes = Preprocessor.KEY if preprocessor_kind(exported) == "audio" else Tokenizer.KEY
        for name, path in exported.graphs.items():
            specs = _shard_into(path, w.folder, *_SEQ2SEQ_PLACES[name], config)
            uses = [encoder_takes] if name == "encoder" else [Tokenizer.KEY]
            w.add_chain(specs, *_io(path, specs), name=name, assets=[a for a in uses if a in assets])
        w.share_weights("decoder", "decoder_with_past")
        return "seq2seq", None
    if parts:  # each tower a component, sharded into a folder of its own
        for c in parts:
            text = c.name == zero_shot["text"]
            # the text tower's embeddings come pooled and normalised by the model
            pooling = Pooling(mode="none", output="text_embeds", normalize=True) if text else None
            uses = [Tokenizer.KEY] if text else [Preprocessor.KEY]
            specs = _shard_into(c.onnx_path, w.folder, c.name, "shard", config)
            w.add_chain(specs, *_io(c.onnx_path, specs), name=c.name, pooling=pooling, assets=[a for a in uses if a in assets])
        return "towers", zero_shot
    specs = shard(exported.onnx_path, w.folder, config)
    w.add_chain(specs, *_io(exported.onnx_path, specs), pooling=exported.pooling)
    return "plain", None


def check(family: str, folder: Path, manifest: Manifest, src: Source, exported: Exported) -> dict[str, Any]:
    """The family's check of the written artifact against the source (see :mod:`slimml.convert.check`)."""
    if family == "seq2seq":
        from slimml.convert.check_seq2seq import check_seq2seq

        return check_seq2seq(folder, manifest, src, exported, SAMPLE_TEXTS)
    if family == "layerwise":
        return verify_layerwise(folder, manifest, exported)
    if exported.info.get("exporter") == "fused":  # GroupQueryAttention: checked from an empty cache
        from slimml.convert.check_decoder import verify_decoder

        return verify_decoder(folder, manifest, src, exported)
    return verify(folder, manifest, src, exported)


def times_batches(family: str) -> bool:
    """Whether ``convert`` times the artifact on a batch: an encoder-decoder's speed is per token
    (``slimml bench`` times ``generate``)."""
    return family != "seq2seq"


def preprocessor_kind(exported: Exported) -> str:
    """What the source's preprocessor config prepares: ``audio`` features or ``image`` pixels."""
    return "audio" if exported.info.get("hf_task", "").startswith("automatic-speech-recognition") else "image"


def _add_assets(w: ArtifactWriter, exported: Exported) -> list[str]:
    """Ship the tokenizer, preprocessor config and pooling projections the export found; returns
    which of the assets (tokenizer, preprocessor) it shipped."""
    found = []
    if exported.tokenizer is not None:
        record = dict(exported.tokenizer)
        template = record.pop("chat_template", None)  # a file beside the tokenizer: shipped and hashed with it
        generation = record.pop("generation_config", None)  # the source's generation_config.json: listed and hashed
        w.add_tokenizer(exported.tokenizer_dir / record["file"], record)
        if generation:
            w.add_file(exported.tokenizer_dir / generation, generation, listed=True)
        if template:
            w.add_chat_template(exported.tokenizer_dir / template, template)
        found.append(Tokenizer.KEY)
    if exported.preprocessor is not None:
        w.add_preprocessor(exported.preprocessor, preprocessor_kind(exported))
        found.append(Preprocessor.KEY)
    for rel in Pooling.coerce(exported.pooling).files if exported.pooling else []:  # hashed with the chain that pools
        w.add_file(exported.pooling_dir / rel, rel)
    return found


def _shard_into(onnx_path: Path, folder: Path, name: str, prefix: str, config: ShardConfig) -> list[ShardSpec]:
    """Shard one component into ``folder/name/`` as ``prefix_NNN.onnx``; its specs name files relative to ``folder``."""
    (folder / name).mkdir(exist_ok=True)
    specs = shard(onnx_path, folder / name, config, prefix=prefix)
    for s in specs:
        s.file = f"{name}/{s.file}"
        s.data = f"{name}/{s.data}" if s.data else None
    return specs


def _io(onnx_path: Path, specs: list[ShardSpec]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """A chain's model inputs and outputs: the graph's, as the shards name them."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    by_name = {t.name: t for s in specs for t in [*s.inputs, *s.outputs]}

    def strip(t: TensorSpec) -> TensorSpec:
        return TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape)

    outputs = {o.name for o in graph.output}
    declared = {i.name: i for i in graph.input if i.name not in weights}

    def spec(name: str) -> TensorSpec:
        if name in by_name:
            return strip(by_name[name])
        if name in declared:  # an input no node reads, passed through as an output too: the runtime hands it back
            return strip(tensor_spec(declared[name]))
        raise ExportError(f"the graph's output {name!r} is made by no node and is neither an input nor a weight, so "
                          "slimml cannot carry it into the artifact; remove it from the graph's outputs, or make it with "
                          "a node (an Identity).")

    inputs = [spec(name) for name in declared if name in by_name or name in outputs]
    return inputs, [spec(o.name) for o in graph.output]
