"""The artifact package: records declared once, the one writer, and component assets."""

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from slimml.errors import ArtifactError, SlimmlError
from slimml.runtime.artifact.manifest import MANIFEST_NAME, read_manifest
from slimml.runtime.artifact.records import Pooling, Seq2Seq, Tokenizer, derived_assets
from slimml.runtime.artifact.writer import ArtifactWriter


def _graph(path: Path, input_name: str, dtype: int, output: str) -> Path:
    """One node: ``input_name`` (B, T) -> Cast to float -> ``output``."""
    node = helper.make_node("Cast", [input_name], [output], to=TensorProto.FLOAT)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(input_name, dtype, ["B", "T"])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["B", "T"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _two_components(w: ArtifactWriter, tmp_path: Path) -> None:
    """A text component (token ids) and an image-less second one (floats), each one shard."""
    from slimml.convert.shard import shard

    (tmp_path / "tok.json").write_text("{}")
    w.add_tokenizer(tmp_path / "tok.json", {"file": "tokenizer.json", "max_length": 8, "pad_id": 0, "chat": "x"})
    for name, inp, dtype in (("text", "input_ids", TensorProto.INT64), ("other", "values", TensorProto.FLOAT)):
        (w.folder / name).mkdir()
        specs = shard(_graph(tmp_path / f"{name}.onnx", inp, dtype, f"{name}_out"), w.folder / name)
        for s in specs:
            s.file = f"{name}/{s.file}"
        w.add_chain(specs, [t for t in specs[0].inputs], specs[-1].outputs, name=name,
                    assets=["tokenizer"] if name == "text" else [])


def test_the_writer_writes_the_manifest_last_and_components_record_their_assets(tmp_path):
    out = tmp_path / "art"
    with ArtifactWriter(out) as w:
        _two_components(w, tmp_path)
        assert not (w.folder / MANIFEST_NAME).exists()
        m = w.commit(name="two", task="generic", source={}, steps=[])
        assert (w.folder / MANIFEST_NAME).is_file() and not out.exists()  # swapped in only at the end
    raw = json.loads((out / MANIFEST_NAME).read_text())
    assert raw["format_version"] == 2
    assert raw["components"]["text"]["assets"] == ["tokenizer"] and raw["components"]["other"]["assets"] == []
    assert raw["tokenizer"]["chat"] == "x"  # a key this slimml does not know is kept
    m = read_manifest(out)
    assert m.components["text"].tokenizer.file == "tokenizer.json" and m.components["other"].tokenizer is None
    assert m.components["text"].tokenizer["max_length"] == 8  # records read as mappings too
    assert {f.path for f in m.files} == {"tokenizer.json", "text/shard_000.onnx", "other/shard_000.onnx"}


def test_an_artifact_without_recorded_assets_derives_them_as_before(tmp_path):
    out = tmp_path / "art"
    with ArtifactWriter(out) as w:
        _two_components(w, tmp_path)
        w.commit(name="two", task="generic", source={}, steps=[])
    raw = json.loads((out / MANIFEST_NAME).read_text())
    for c in raw["components"].values():
        del c["assets"]  # as a version 2 artifact from an older slimml
    (out / MANIFEST_NAME).write_text(json.dumps(raw))
    m = read_manifest(out)
    assert m.components["text"].tokenizer is not None and m.components["other"].tokenizer is None
    assert derived_assets({"pixel_values"}, [4]) == ["preprocessor"]
    assert derived_assets({"input_features"}, [3]) == ["preprocessor"]


def test_a_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with ArtifactWriter(out) as w:
            _two_components(w, tmp_path)
            raise RuntimeError("killed")
    assert not out.exists() and not list(tmp_path.glob(".art.slimml-*"))
    with pytest.raises(SlimmlError, match="at least one chain"):
        with ArtifactWriter(out) as w:
            w.commit(name="x", task="generic", source={}, steps=[])
    with pytest.raises(ArtifactError, match="either one chain of shards or named components"):
        with ArtifactWriter(out) as w:
            w.add_chain([], [], [], name="a")
            w.add_chain([], [], [])


def test_records_round_trip_and_check_themselves():
    tok = Tokenizer.from_json({"file": "t.json", "max_length": 4, "pad_token": "[PAD]", "pad_id": 0, "new": 1})
    assert tok.to_json() == {"file": "t.json", "max_length": 4, "pad_token": "[PAD]", "pad_id": 0, "new": 1}
    assert tok == tok.to_json() and tok.get("new") == 1 and dict(tok)["pad_id"] == 0
    s2s = Seq2Seq(decoder_start_token_id=0, forced_ids=[[1, 5]])
    assert "suppress_ids" not in s2s.to_json() and s2s["forced_ids"] == [[1, 5]]
    assert Pooling.problems({"mode": "sum", "output": 3}) == [
        "pooling.mode must be one of mean, cls, max, lasttoken, mean_sqrt_len_tokens, weightedmean, none",
        "pooling.output must name a model output"]
    assert Pooling.problems({"mode": "cls", "output": "h", "prompts": {"q": 1}, "default_prompt": "q"}) == [
        "pooling.prompts must map prompt names to texts"]
    assert Pooling.problems({"mode": "cls", "output": "h", "prompts": {"q": "query: "}, "default_prompt": "d"}) == [
        "pooling.default_prompt must name one of the prompts or be null"]
    assert "prompts" not in Pooling(mode="cls", output="h").to_json()  # an artifact without prompts reads as before
    assert Seq2Seq.problems({"decoder_start_token_id": -1}, components=["encoder"]) == [
        "seq2seq needs the components encoder, decoder and decoder_with_past",
        "seq2seq.decoder_start_token_id must be a token id"]


def test_a_rewrite_keeps_every_asset_even_ones_this_slimml_does_not_know(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    (tmp_path / "notes.txt").write_text("a file a newer slimml ships")
    with ArtifactWriter(first) as w:
        _two_components(w, tmp_path)
        w.add_chat_template(tmp_path / "chat.jinja")
        w.add_file(tmp_path / "notes.txt", "notes.txt", listed=True)
        w.commit(name="two", task="generic", source={}, steps=[])
    m = read_manifest(first)
    with ArtifactWriter(second) as w:  # as quantize rewrites: the same chains, assets copied over
        w.copy_assets(first, m)
        for name, part in m.components.items():
            for s in part.shards:
                w.add_file(first / s.file, s.file)
            w.add_chain(part.shards, part.inputs, part.outputs, name=name, assets=part.assets)
        w.commit(**{**m.header(), "steps": [{"step": "rewrite"}]})
    m2 = read_manifest(second)
    assert {f.path: f.sha256 for f in m2.files} == {f.path: f.sha256 for f in m.files}
    assert m2.components["text"].assets == ["tokenizer"] and m2.steps == [{"step": "rewrite"}]
    assert m2.tokenizer.chat_template == "chat_template.jinja" and m2.tokenizer["chat_template"] == "chat_template.jinja"
    assert "chat_template.jinja" in {f.path for f in m2.components["text"].files}  # the text component owns it
    assert (second / "notes.txt").read_text() == "a file a newer slimml ships"
