"""Vision (ViT) and vision-language (CLIP) models the whole way: convert from a Hugging Face
folder, check against torch, run resident and streamed, quantize, and use from the CLI.

Tiny random-weight models built here; no downloads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import TOWER, run_without_torch, save_tiny_clip, save_tiny_vit

from slimml.errors import ConfigError, FeedError, SlimmlError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

def slimml(*args):
    """The command line as a user runs it: a real subprocess."""
    return subprocess.run([sys.executable, "-m", "slimml", *map(str, args)], capture_output=True, text=True, timeout=300)


def _images(n: int, seed: int = 0) -> list:
    """Random RGB images of assorted sizes and aspect ratios (and one grey, one with alpha)."""
    rng = np.random.default_rng(seed)
    shapes = [(40, 50, 3), (123, 41, 3), (20, 20), (64, 64, 4), (300, 200, 3), (33, 77, 3)]
    modes = {3: "RGB", 2: "L", 4: "RGBA"}
    out = []
    for i in range(n):
        shape = shapes[i % len(shapes)]
        out.append(Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), modes[len(shape) if len(shape) == 2 else shape[2]]))
    return out


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    from slimml.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("vit")
    labels = ["cat", "dog", "bird", "fish"]
    model, processor = save_tiny_vit(root / "src", labels)
    report = convert(root / "src", root / "art", ConvertConfig(measure_latency=False))
    return {"root": root, "torch": model, "processor": processor, "labels": labels, "report": report}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    from slimml.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("clip")
    model, tokenizer, processor = save_tiny_clip(root / "src")
    report = convert(root / "src", root / "art", ConvertConfig(measure_latency=False))
    return {"root": root, "torch": model, "tokenizer": tokenizer, "processor": processor, "report": report}


# -- pre-processing ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["vit-224", "vit-32", "clip-224", "clip-crop-larger-than-resize", "clip-int-size",
                                  "convnext-224", "convnext-crop-pct", "convnext-384"])
def test_image_preprocessing_matches_the_hugging_face_processor(kind):
    """ConvNeXt's processor (ResNet's too) was read as a plain resize: its crop_pct and its square
    from 384 up were missed, and the pixels differed."""
    from transformers import CLIPImageProcessor, ConvNextImageProcessor, ViTImageProcessor

    from slimml.runtime.tasks.inputs.image import ImageProcessor

    hf = {
        "vit-224": lambda: ViTImageProcessor(),
        "vit-32": lambda: ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.1, 0.2, 0.3], image_std=[0.9, 0.8, 0.7]),
        "clip-224": lambda: CLIPImageProcessor(),
        "clip-crop-larger-than-resize": lambda: CLIPImageProcessor(size={"shortest_edge": 48}, crop_size={"height": 64, "width": 64}),
        "clip-int-size": lambda: CLIPImageProcessor(size=40, crop_size=36),
        "convnext-224": lambda: ConvNextImageProcessor(size={"shortest_edge": 224}),
        "convnext-crop-pct": lambda: ConvNextImageProcessor(size={"shortest_edge": 40}, crop_pct=0.8),
        "convnext-384": lambda: ConvNextImageProcessor(),
    }[kind]()
    ours = ImageProcessor(json.loads(hf.to_json_string()))
    for image in _images(6):
        want = hf(images=image.convert("RGB"), return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(ours([image]), want, atol=1e-5, rtol=0)


def test_a_resnet_config_of_the_hub_s_older_shape_is_read_as_convnext_s():
    """microsoft/resnet-50's config names ConvNextFeatureExtractor and an int size (the shortest edge)."""
    from transformers import ConvNextImageProcessor

    from slimml.runtime.tasks.inputs.image import ImageProcessor

    old = {"crop_pct": 0.875, "do_normalize": True, "do_resize": True, "feature_extractor_type": "ConvNextFeatureExtractor",
           "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 224}
    hf = ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875, resample=3, image_mean=old["image_mean"],
                                image_std=old["image_std"])
    for image in _images(3):
        want = hf(images=image.convert("RGB"), return_tensors="np")["pixel_values"]
        np.testing.assert_allclose(ImageProcessor(old)([image]), want, atol=1e-5, rtol=0)


def test_a_strip_is_not_resized_past_what_any_model_reads():
    """A 1x1000 strip at CLIP's shortest edge of 224 became 224x224,000 pixels (434 MB more memory)."""
    from transformers import CLIPImageProcessor

    from slimml.runtime.tasks.inputs.image import ImageProcessor

    ours = ImageProcessor(json.loads(CLIPImageProcessor().to_json_string()))
    with pytest.raises(FeedError, match=r"an image of 1x1000 pixels \(width x height\) would be resized to 224x224000 .*crop it nearer to square"):
        ours([np.zeros((1000, 1, 3), dtype=np.uint8)])


def test_bad_images_get_one_clear_error(vit, tmp_path):
    from slimml.runtime import load

    model = load(vit["root"] / "art")
    (tmp_path / "text.png").write_text("not an image")
    good = tmp_path / "good.png"
    _images(1)[0].save(good)
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[:100])
    cases = [
        (tmp_path / "text.png", "is not an image Pillow can read"),
        (tmp_path / "cut.png", "is not an image Pillow can read"),
        (tmp_path / "missing.jpg", "does not exist"),
        (np.zeros((4, 4, 3), dtype=np.float32), r"give HxWx3 \(or HxW\) uint8"),
        (42, "give a file path, a PIL image"),
        (np.zeros((0, 0, 3), dtype=np.uint8), r"image 0 is 0x0 pixels; give an image with pixels"),  # was classified
        (tmp_path, "is a folder; give an image file in it"),  # was "does not exist"
        ("", r"image 0 is an empty text; give an image file's path"),  # was "`.` is a folder"
    ]
    for image, message in cases:
        with pytest.raises(FeedError, match=message):
            model.classify([image])
    with pytest.raises(SlimmlError, match=r"it is an 'image-classification' model"):  # was "a 'image-classification'"
        model.encode(["a cat"])
    with pytest.raises(SlimmlError, match="has no tokenizer, so it cannot take text"):
        model.tokenize(["a cat"])
    with pytest.raises(FeedError, match="top_k"):
        model.classify([good], top_k=0)
    with pytest.raises(FeedError, match=r"labels= names the classes of an image-text \(CLIP\) artifact"):
        model.classify([good], labels=["a cat", "a dog"])  # a raw TypeError before


# -- ViT -----------------------------------------------------------------------------------------

def test_a_vit_classifier_classifies_images_as_torch_does(vit):
    from slimml.runtime import load

    assert vit["report"].checks["max_abs_diff_vs_torch"] <= 1e-4
    model = load(vit["root"] / "art")
    assert model.manifest.labels == vit["labels"] and model.manifest.format_version == 1  # one graph: still format 1
    images = _images(5)
    with torch.no_grad():
        want = torch.softmax(vit["torch"](**vit["processor"]([im.convert("RGB") for im in images], return_tensors="pt")).logits, -1).numpy()
    got = model.classify(images, top_k=None, batch_size=2)
    for row, classes in zip(want, got):
        assert [c["label"] for c in classes] == [vit["labels"][i] for i in np.argsort(-row, kind="stable")]
        np.testing.assert_allclose([c["score"] for c in classes], np.sort(row)[::-1], atol=1e-5)
    assert len(model.classify([images[0]], top_k=2)[0]) == 2


def test_a_vit_streams_with_two_shards_resident_and_gives_the_same_scores(vit):
    from slimml.runtime import load

    images = _images(3)
    whole = load(vit["root"] / "art").classify(images, top_k=None)
    streamed = load(vit["root"] / "art", resident=2)
    assert streamed.plan.streaming
    assert streamed.classify(images, top_k=None) == whole


def test_a_vit_quantizes_to_int8_within_tolerance(vit):
    from slimml.quantize import Int8Config, quantize
    from slimml.runtime import load

    report = quantize(vit["root"] / "art", vit["root"] / "int8", Int8Config("cpu"))
    assert report.quantized_shards and report.size_mb < report.float_size_mb
    step = load(vit["root"] / "int8").manifest.steps[-1]
    assert "fused" not in step and step["fuse"] is False and "not a BERT-family encoder" in step["fuse_skipped"]
    images = _images(4)
    fp32 = load(vit["root"] / "art").run(load(vit["root"] / "art").preprocess(images))["logits"]
    int8 = load(vit["root"] / "int8")
    assert int8.manifest.labels == vit["labels"] and int8.manifest.preprocessor  # carried over
    got = int8.run(int8.preprocess(images))["logits"]
    assert np.abs(got - fp32).max() <= 0.05  # dynamic int8 on a random tiny ViT: logits within 0.05


def test_a_vit_with_int8_weights_runs_as_one_session(vit):
    """int8 and int4 weights move the shards quantized to opset 21 and leave the others (a float
    embedding, the head) at 18: every such encoder and vision artifact ran one session a shard,
    with a warning at each load. The older shards are now moved up at merge."""
    from slimml.quantize import quantize
    from slimml.quantize.config import scheme_config
    from slimml.runtime import load

    quantize(vit["root"] / "art", vit["root"] / "w8", scheme_config("int8-weights"))
    opsets = {s.file: next(o.version for o in onnx.load(str(vit["root"] / "w8" / s.file), load_external_data=False).opset_import
                           if o.domain in ("", "ai.onnx")) for s in load(vit["root"] / "w8").manifest.shards}
    assert len(set(opsets.values())) > 1, opsets  # the case: shards at two opsets
    model = load(vit["root"] / "w8")
    assert model.plan.sessions == 1
    images = _images(3)
    separate = load(vit["root"] / "w8", resident=1, pack=False)  # a session a shard, weights fed
    np.testing.assert_allclose(model.run(model.preprocess(images))["logits"],
                               separate.run(separate.preprocess(images))["logits"], atol=1e-5, rtol=0)


def test_a_vit_model_embeds_images_as_its_cls_token(tmp_path):
    """optimum exports ViTModel's last_hidden_state only: the embedding is its CLS row, normalised."""
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    torch.manual_seed(1)
    model = ViTModel(ViTConfig(**TOWER, image_size=32, patch_size=8)).eval()
    model.save_pretrained(tmp_path / "src")
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    images = _images(3)
    with torch.no_grad():
        pooled = model(**processor([im.convert("RGB") for im in images], return_tensors="pt")).last_hidden_state[:, 0].numpy()
    want = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(load(tmp_path / "art").embed_images(images), want, atol=1e-5)
    with pytest.raises(SlimmlError, match="not a classifier"):
        load(tmp_path / "art").classify(images)


def test_slimml_run_classifies_an_image_file(vit, tmp_path):
    path = tmp_path / "photo.jpg"
    _images(1)[0].save(path)
    result = slimml("run", vit["root"] / "art", "--image", path, "--top-k", "2", "--json")
    assert result.returncode == 0, result.stderr
    classes = json.loads(result.stdout)[0]["classes"]
    assert len(classes) == 2 and {c["label"] for c in classes} <= set(vit["labels"])
    text = slimml("run", vit["root"] / "art", "a cat")
    assert text.returncode == 1 and "cannot take text; it takes images: give --image FILE" in text.stderr
    bad = slimml("run", vit["root"] / "art", "--image", tmp_path / "nope.jpg")
    assert bad.returncode == 1 and "does not exist" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_an_artifact_without_a_preprocessor_config_says_how_to_give_one(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    ViTForImageClassification(ViTConfig(**TOWER, image_size=32, patch_size=8, num_labels=2)).eval().save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    model = load(tmp_path / "art")
    with pytest.raises(SlimmlError, match="has no image preprocessor"):
        model.classify(_images(1))
    assert model.run({"pixel_values": np.zeros((1, 3, 32, 32), np.float32)})["logits"].shape == (1, 2)


def test_an_image_processor_slimml_does_not_reproduce_is_not_shipped(tmp_path):
    """An image processor of another kind (MobileViT's flips the channels) was shipped and read as
    a plain one: the model got other pixels than it was trained on, silently."""
    from transformers import MobileViTImageProcessor, ViTConfig, ViTForImageClassification

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    ViTForImageClassification(ViTConfig(**TOWER, image_size=32, patch_size=8, num_labels=2)).eval().save_pretrained(tmp_path / "src")
    MobileViTImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32}).save_pretrained(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["preprocessing_note"].startswith("slimml's pixels differ from MobileViTImageProcessor")  # Pil's under transformers 5
    assert report.checks["preprocessing_note"].endswith("its config is not shipped: make the pixels with transformers' "
                                                        "processor and call run(pixel_values=...)")
    model = load(tmp_path / "art")
    with pytest.raises(SlimmlError, match="has no image preprocessor"):
        model.classify(_images(1))


# -- CLIP ----------------------------------------------------------------------------------------

def test_clip_converts_into_a_text_and_a_vision_component(clip):
    from slimml.runtime import load, read_manifest

    checks = clip["report"].checks
    assert checks["max_abs_diff"] <= 1e-5 and checks["max_abs_diff_vs_torch"] <= 1e-4
    manifest = read_manifest(clip["root"] / "art")
    assert manifest.format_version == 2 and list(manifest.components) == ["text", "vision"]
    assert {t.name for t in manifest.components["text"].inputs} == {"input_ids", "attention_mask"}
    assert [t.name for t in manifest.components["vision"].inputs] == ["pixel_values"]
    assert all(s.file.startswith("vision/") for s in manifest.components["vision"].shards)
    model = load(clip["root"] / "art")
    assert model.max_sequence_length == 40  # the text tower's positions, not the vision tower's patches
    assert manifest.zero_shot["scale"] == pytest.approx(np.exp(4.0), rel=1e-6)


def test_clip_embeddings_and_zero_shot_scores_match_torch(clip):
    from slimml.runtime import load

    model = load(clip["root"] / "art")
    labels = ["a photo of a cat", "a dog", "a bird sitting on a branch in the morning sun"]
    images = _images(4)
    with torch.no_grad():
        text = clip["tokenizer"](labels, padding=True, return_tensors="pt")
        text.pop("token_type_ids", None)
        out = clip["torch"](**text, **clip["processor"]([im.convert("RGB") for im in images], return_tensors="pt"))
    np.testing.assert_allclose(model.embed_texts(labels), out.text_embeds.numpy(), atol=1e-5)
    np.testing.assert_allclose(model.embed_images(images), out.image_embeds.numpy(), atol=1e-5)
    want = out.logits_per_image.softmax(-1).numpy()
    got = model.classify(images, labels=labels)
    for row, classes in zip(want, got):
        scores = {c["label"]: c["score"] for c in classes}
        np.testing.assert_allclose([scores[x] for x in labels], row, atol=1e-5)
    with pytest.raises(FeedError, match="needs labels"):
        model.classify(images)


@pytest.mark.parametrize("exporter", ["optimum", "torch"])
def test_siglip_scores_each_label_by_sigmoid_with_its_bias_as_transformers_pipeline_does(tmp_path, exporter):
    """SigLIP's text tower takes the ids alone (no attention mask): every text call failed with
    KeyError 'attention_mask'; its scores were CLIP's softmax, without its logit bias; and its texts
    were padded to the longest where transformers pads them to 64 tokens (as SigLIP was trained). The
    torch exporter writes it too (under transformers 5, where optimum-onnx does not load)."""
    from transformers import AutoTokenizer, SiglipConfig, SiglipImageProcessor, SiglipModel, pipeline

    from slimml.convert import ConvertConfig, ExportConfig, convert
    from slimml.convert.export import _optimum_loads

    if exporter == "optimum" and _optimum_loads() is not None:
        pytest.skip("needs optimum-onnx (transformers 4.57)")
    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load, read_manifest

    torch.manual_seed(0)
    model = SiglipModel(SiglipConfig(text_config=dict(TOWER, vocab_size=30522, max_position_embeddings=64),
                                     vision_config=dict(TOWER, image_size=32, patch_size=8))).eval()
    with torch.no_grad():  # learned values, distinct (a random init has both 0, which the exporter merges)
        model.logit_scale.fill_(np.log(10.0))
        model.logit_bias.fill_(-2.5)
    model.save_pretrained(tmp_path / "src")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.save_pretrained(tmp_path / "src")
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False, export=ExportConfig(exporter=exporter)))
    manifest = read_manifest(tmp_path / "art")
    assert manifest.zero_shot.to_json() == {"text": "text", "image": "vision", "scale": pytest.approx(10.0), "bias": -2.5,
                                            "activation": "sigmoid", "text_length": 64}
    assert manifest.format_version == 4 and set(manifest.requires) == {"zero_shot.bias", "zero_shot.activation",
                                                                      "zero_shot.text_length"}
    art = load(tmp_path / "art")
    labels = ["a photo of a cat", "a dog", "a bird sitting on a branch in the morning sun"]
    images = [im.convert("RGB") for im in _images(3)]
    with torch.no_grad():
        ids = tokenizer(labels, padding="max_length", max_length=64, return_tensors="pt")["input_ids"]
        got = model.get_text_features(input_ids=ids)
        got = getattr(got, "pooler_output", got)  # transformers 5 returns the output object
        want = torch.nn.functional.normalize(got, dim=-1).numpy()
    np.testing.assert_allclose(art.embed_texts(labels), want, atol=1e-5)
    tokenizer.model_input_names = ["input_ids"]  # as SigLIP's own tokenizer: no mask for the model to take
    classifier = pipeline("zero-shot-image-classification", model=model, tokenizer=tokenizer, image_processor=processor)
    for image, got in zip(images, art.classify(images, labels=labels)):
        expected = {c["label"]: c["score"] for c in classifier(image, candidate_labels=labels, hypothesis_template="{}")}
        assert {c["label"]: c["score"] for c in got} == pytest.approx(expected, abs=1e-5)
        assert abs(sum(c["score"] for c in got) - 1) > 1e-3  # each label alone, not a softmax


def test_the_logit_scale_and_bias_are_read_through_identity_and_cast_or_by_name(tmp_path):
    """An Identity at the logits output or a Cast after the Exp lost SigLIP's bias (scored as 0: every label
    near 1) and fell back from the graph's scale to the config's initial one."""
    from onnx import helper, numpy_helper

    from slimml.convert.towers import _similarity

    inits = [numpy_helper.from_array(np.array([np.log(10.0)], np.float32), "ls"),
             numpy_helper.from_array(np.array([-16.0], np.float32), "lb")]
    nodes = [helper.make_node("MatMul", ["t", "i"], ["cos"]), helper.make_node("Exp", ["ls"], ["e"]),
             helper.make_node("Cast", ["e"], ["ec"], to=1), helper.make_node("Mul", ["cos", "ec"], ["m"]),
             helper.make_node("Add", ["m", "lb"], ["a"]), helper.make_node("Identity", ["a"], ["logits_per_text"])]
    io = [helper.make_tensor_value_info(n, 1, None) for n in ("t", "i")]
    graph = helper.make_graph(nodes, "g", io, [helper.make_tensor_value_info("logits_per_text", 1, None)], inits)
    assert _similarity(helper.make_model(graph), tmp_path) == (pytest.approx(10.0), -16.0)
    named = [numpy_helper.from_array(np.array([np.log(5.0)], np.float32), "logit_scale"),
             numpy_helper.from_array(np.array([-3.0], np.float32), "logit_bias")]
    bare = helper.make_graph([helper.make_node("MatMul", ["t", "i"], ["x"])], "g", io,
                             [helper.make_tensor_value_info("x", 1, None)], named)
    assert _similarity(helper.make_model(bare), tmp_path) == (pytest.approx(5.0), -3.0)  # no logits output: by name


def test_a_vision_folder_without_its_preprocessor_config_is_said_at_convert(vit, tmp_path):
    """Convert wrote an artifact that cannot take images without a word; the first image was refused later."""
    import shutil

    from slimml.convert import ConvertConfig, convert

    shutil.copytree(vit["root"] / "src", tmp_path / "src")
    (tmp_path / "src" / "preprocessor_config.json").unlink()
    report = convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    assert report.checks["preprocessing_note"] == (
        "the source has no preprocessor_config.json, so the artifact's pixel_values input takes arrays only "
        "(run(pixel_values=...)), not images; put the model's preprocessor_config.json in the folder and convert again")
    assert "preprocessing_note" not in vit["report"].checks


@pytest.mark.parametrize("exporter", ["auto", "torch"])
def test_a_resnet_whose_config_has_no_image_size_converts_checks_and_benches_at_its_processor_s_size(tmp_path, exporter):
    """ResNet's config names no image_size: the check's and bench's sample pixels took the sequence
    length for the channels ("Input channels C is not equal to kernel channels * group. C: 16"), so
    the default convert failed; and bench said "x seq 128" of a model that takes no tokens."""
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load, read_manifest

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)).eval()
    model.save_pretrained(tmp_path / "src")
    processor = ConvNextImageProcessor(size={"shortest_edge": 32})
    processor.save_pretrained(tmp_path / "src")
    from slimml.convert import ExportConfig

    report = convert(tmp_path / "src", tmp_path / "art", ConvertConfig(export=ExportConfig(exporter=exporter)))
    assert report.checks["max_abs_diff_vs_torch"] < 1e-4 and report.checks["latency_ms_b1"] > 0
    assert read_manifest(tmp_path / "art").source["image_size"] == [32, 32]
    image = _images(1)[0].convert("RGB")
    with torch.no_grad():
        want = model(**processor(image, return_tensors="pt")).logits.softmax(-1)[0].numpy()
    got = {c["label"]: c["score"] for c in load(tmp_path / "art").classify([image])[0]}
    np.testing.assert_allclose([got[model.config.id2label[i]] for i in range(3)], want, atol=1e-5)
    result = slimml("bench", tmp_path / "art", "--runs", "3")
    assert result.returncode == 0 and "batch 1 on cpu: p50" in result.stdout, result.stdout + result.stderr
    if exporter == "auto":  # no scheme quantizes Conv: said so (it said "pick a scheme that quantizes its ops")
        from slimml.quantize import Int8Config, quantize

        with pytest.raises(ConfigError, match=r"its weights are in Conv layers \(a CNN\), which slimml's schemes do not "
                                              r"quantize.*--quantize fp16 --target cuda"):
            quantize(tmp_path / "art", tmp_path / "int8", Int8Config("cpu"))


@pytest.mark.parametrize("module", ["Transformer", "CLIPModel", "0_CLIPModel"])
def test_clip_saved_by_sentence_transformers_converts_as_its_two_towers(clip, tmp_path, module):
    """sentence-transformers 5.4+ saves CLIP as a multimodal ``Transformer`` (earlier: a ``CLIPModel``
    module); such a folder converted as a text pipeline and failed its check. Now it is CLIP's two
    towers, and its text and image embeddings are the library's ``encode``'s, normalised."""
    import shutil

    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer

    from slimml.convert import ConvertConfig, convert
    from slimml.runtime import load

    folder = tmp_path / "st"
    SentenceTransformer(modules=[Transformer(str(clip["root"] / "src"))], device="cpu").save(str(folder))
    shutil.copy(clip["root"] / "src" / "preprocessor_config.json", folder)
    if module != "Transformer":  # as sentence-transformers before 5.4 saved it (clip-ViT-B-32: in 0_CLIPModel/)
        (folder / "sentence_bert_config.json").unlink()
        inner = folder / module if module.startswith("0_") else folder
        if inner != folder:
            inner.mkdir()
            for f in list(folder.iterdir()):
                if f.name not in ("modules.json", "config_sentence_transformers.json", inner.name):
                    f.rename(inner / f.name)
        (folder / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "" if inner == folder else inner.name,
                                                          "type": "sentence_transformers.models.CLIPModel"}]))
    convert(folder, tmp_path / "art", ConvertConfig(measure_latency=False))
    model, library = load(tmp_path / "art"), SentenceTransformer(str(folder), device="cpu")
    texts, images = ["a photo of a cat", "a dog"], _images(3)

    def unit(x):
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    np.testing.assert_allclose(model.embed_texts(texts), unit(library.encode(texts)), atol=1e-5)
    np.testing.assert_allclose(model.embed_images(images), unit(library.encode([im.convert("RGB") for im in images])), atol=1e-5)


def test_clip_exported_by_torch_equals_optimum_s(clip, tmp_path):
    """The torch exporter writes CLIP as optimum does (both towers in one graph, then split), so CLIP
    converts with transformers 5, where optimum-onnx does not load: the same embeddings."""
    from slimml.convert import ConvertConfig, convert
    from slimml.convert.config import ExportConfig
    from slimml.runtime import load

    report = convert(clip["root"] / "src", tmp_path / "art", ConvertConfig(measure_latency=False, export=ExportConfig(exporter="torch")))
    assert report.steps[0]["exporter"] == "torch.onnx" and report.checks["cosine_vs_torch"] > 0.9999
    ours, theirs = load(tmp_path / "art"), load(clip["root"] / "art")
    assert sorted(ours.manifest.components) == ["text", "vision"]
    texts, images = ["a photo of a cat", "a dog sitting in the long grass by the river", "x"], _images(3)
    np.testing.assert_allclose(ours.embed_texts(texts), theirs.embed_texts(texts), atol=1e-6)
    np.testing.assert_allclose(ours.embed_images(images), theirs.embed_images(images), atol=1e-6)


def test_clip_components_run_alone_and_together(clip):
    from slimml.runtime import load

    model = load(clip["root"] / "art")
    pixels = model.preprocess(_images(2))
    tokens = model.tokenize(["a cat", "a dog"])
    both = model.run({**tokens, **pixels})
    assert set(both) == {"text_embeds", "image_embeds"}
    np.testing.assert_array_equal(model.run(pixels)["image_embeds"], both["image_embeds"])
    np.testing.assert_array_equal(model.run(tokens, component="text")["text_embeds"], both["text_embeds"])
    with pytest.raises(FeedError, match="not the inputs of this artifact's components"):
        model.run({**pixels, "bogus": np.zeros(1)})
    with pytest.raises(SlimmlError, match="no component 'audio'"):
        model.run(pixels, component="audio")


def test_clip_streams_each_tower_with_two_shards_resident(clip):
    from slimml.runtime import load

    labels, images = ["a cat", "a dog"], _images(3)
    whole = load(clip["root"] / "art")
    streamed = load(clip["root"] / "art", resident=2)
    assert all(p.plan.streaming for p in streamed.parts.values())  # the budget applies to each component
    np.testing.assert_array_equal(streamed.embed_texts(labels), whole.embed_texts(labels))
    np.testing.assert_array_equal(streamed.embed_images(images), whole.embed_images(images))


def test_clip_quantizes_each_tower_with_its_own_guard(clip):
    from slimml.quantize import Int8Config, quantize
    from slimml.runtime import load, read_manifest

    report = quantize(clip["root"] / "art", clip["root"] / "int8", Int8Config("cpu"))
    assert set(report.components) == {"text", "vision"}
    assert report.checks["text_agreement_cosine"] >= 0.99 and report.checks["vision_agreement_cosine"] >= 0.99
    # each component's report named the writer's temporary folder (gone once written) and 0.0 s
    assert all(r.out == report.out and 0 < r.seconds <= report.seconds for r in report.components.values())
    manifest = read_manifest(clip["root"] / "int8")
    assert list(manifest.components) == ["text", "vision"] and manifest.zero_shot and manifest.preprocessor
    fp32, int8 = load(clip["root"] / "art"), load(clip["root"] / "int8")
    labels, images = ["a cat", "a dog"], _images(3)
    # cosine of int8 to fp32 embeddings of a random tiny model: a floor, not a claim about real CLIP
    assert (int8.embed_texts(labels) * fp32.embed_texts(labels)).sum(1).min() >= 0.99
    assert (int8.embed_images(images) * fp32.embed_images(images)).sum(1).min() >= 0.99


def test_image_models_calibrate_and_guard_on_a_folder_of_images(vit, clip, tiny_bert_artifact, tmp_path):
    """--calibration took text files only ("give a text file (one sentence per line)"): an image model was
    calibrated (int8-static) and guarded on generated noise whatever the user had. A folder of images now
    calibrates it, every fifth image held out for the guard; CLIP's text tower keeps the built-in texts."""
    from slimml.errors import DataError
    from slimml.quantize import Int8StaticConfig, quantize
    from slimml.runtime import read_manifest

    for i, im in enumerate(_images(12)):  # in class folders, as ImageNet's are kept
        (tmp_path / "images" / f"class{i % 2}").mkdir(parents=True, exist_ok=True)
        im.convert("RGB").save(tmp_path / "images" / f"class{i % 2}" / f"{i:02d}.png")
    (tmp_path / "images" / "notes.txt").write_text("not an image: skipped")
    (tmp_path / "images" / "._00.png").write_bytes(b"macOS metadata, not an image: skipped")
    report = quantize(vit["root"] / "art", tmp_path / "vit8", Int8StaticConfig(calibration=tmp_path / "images"))
    assert report.checks["agreement_top1"] >= 0.5
    step = read_manifest(tmp_path / "vit8").steps[-1]
    assert step["calibration"] == f"{tmp_path / 'images'} (12 images)" and "calibration_unused" not in step
    quantize(clip["root"] / "art", tmp_path / "clip8", Int8StaticConfig(calibration=tmp_path / "images"))
    step = read_manifest(tmp_path / "clip8").steps[-1]
    assert step["calibration"].startswith("built-in corpus")  # the text tower's texts; its images for the vision tower
    assert step["components"]["vision"]["calibration"] == f"{tmp_path / 'images'} (12 images)"
    with pytest.raises(ConfigError, match=r"is a folder of images, and .* takes no images"):
        quantize(tiny_bert_artifact, tmp_path / "x", Int8StaticConfig(calibration=tmp_path / "images"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="calibration folder .* holds no images"):
        quantize(vit["root"] / "art", tmp_path / "y", Int8StaticConfig(calibration=tmp_path / "empty"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_clip_weights_compressed_by_nncf(clip, tmp_path):
    """NNCF's int8 of the vision tower's patch Conv (no bias) wrote a DequantizeLinear whose 4-d scale
    ONNX Runtime refused ("scale must be 1D tensor"), and quantize ended in its traceback: that Conv
    stays float."""
    from slimml.quantize import quantize
    from slimml.quantize.config import WeightOnlyConfig
    from slimml.runtime import load

    images = _images(2)
    want = load(clip["root"] / "art").embed_images(images)
    for bits in (8, 4):
        quantize(clip["root"] / "art", tmp_path / f"w{bits}", WeightOnlyConfig(bits=bits, backend="nncf"))
        assert (load(tmp_path / f"w{bits}").embed_images(images) * want).sum(1).min() >= 0.98, bits


def test_clip_tampered_component_file_is_refused(clip, tmp_path):
    import shutil

    from slimml.errors import IntegrityError
    from slimml.runtime import load

    art = tmp_path / "art"
    shutil.copytree(clip["root"] / "art", art)
    data = art / "vision" / "shard_001.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="vision/shard_001.onnx.data does not match its sha256"):
        load(art)


def test_slimml_run_scores_an_image_against_texts_and_info_lists_components(clip, tmp_path):
    path = tmp_path / "x.png"
    _images(1)[0].save(path)
    art = clip["root"] / "art"
    result = slimml("run", art, "--image", path, "--text", "a cat", "--text", "a dog", "--json")
    assert result.returncode == 0, result.stderr
    classes = json.loads(result.stdout)[0]["classes"]
    assert sorted(c["label"] for c in classes) == ["a cat", "a dog"]
    assert sum(c["score"] for c in classes) == pytest.approx(1.0)
    info = slimml("info", art)
    assert info.returncode == 0 and "components: text (" in info.stdout and "component vision" in info.stdout


def test_pipeline_stages_refuse_an_artifact_of_components(clip):
    from slimml.runtime import load
    from slimml.scale import pipeline

    with pytest.raises(ConfigError, match="has components text, vision"):
        pipeline(clip["root"] / "art", stages=2)
    with pytest.raises(SlimmlError, match="has components text, vision"):
        load(clip["root"] / "art", shards=(0, 1))


def test_a_text_classifier_classifies_texts_with_its_labels(tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from slimml.convert import ConvertConfig, convert
    from slimml.convert.sources import default_model_dir
    from slimml.runtime import load

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    model = BertForSequenceClassification(BertConfig(**TOWER, vocab_size=tokenizer.vocab_size, num_labels=2,
                                                     id2label={0: "negative", 1: "positive"},
                                                     label2id={"negative": 0, "positive": 1})).eval()
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "art", ConvertConfig(measure_latency=False))
    texts = ["a fine film", "the worst day of my life, truly"]
    with torch.no_grad():
        want = torch.softmax(model(**tokenizer(texts, padding=True, return_tensors="pt")).logits, -1).numpy()
    got = load(tmp_path / "art").classify(texts, top_k=None)
    for row, classes in zip(want, got):
        scores = {c["label"]: c["score"] for c in classes}
        np.testing.assert_allclose([scores["negative"], scores["positive"]], row, atol=1e-5)
    result = slimml("run", tmp_path / "art", "a fine film", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)[0]["classes"][0]["label"] in ("negative", "positive")


def test_vision_artifacts_run_without_torch_or_transformers(vit, clip, tmp_path):
    """Images in, labels out, with torch and transformers made unimportable."""
    path = tmp_path / "x.png"
    _images(1)[0].save(path)
    label, count = run_without_torch([
        f"print(load({str(vit['root'] / 'art')!r}).classify([{str(path)!r}], top_k=1)[0][0]['label'])",
        f"print(len(load({str(clip['root'] / 'art')!r}).classify([{str(path)!r}], labels=['a cat', 'a dog'])[0]))",
    ])
    assert label in vit["labels"] and count == "2"
