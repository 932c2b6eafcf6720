"""Images over HTTP: a tiny random ViT classifier and CLIP served on 127.0.0.1, images sent inline
as data URLs to ``/v1/classify`` (labels, or CLIP against candidate labels) and ``/v1/embeddings``
(CLIP's image tower), answered as in-process ``classify`` and ``embed_images`` answer; an address,
a path, or an image too large for its bytes refused in one line before anything is decoded."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

from conftest import save_tiny_clip, save_tiny_vit, serving

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

LABELS = ["cat", "dog", "bird", "fish"]


def _pictures(n: int) -> list:
    rng = np.random.default_rng(0)
    shapes = [(40, 50, 3), (123, 41, 3), (64, 64, 3)]
    return [Image.fromarray(rng.integers(0, 256, shapes[i % 3], dtype=np.uint8)) for i in range(n)]


def data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _huge_png(width: int, height: int) -> str:
    """A PNG header claiming ``width`` x ``height`` pixels, with no pixels after it (a few dozen bytes)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    from slimml.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("vision")
    save_tiny_vit(root / "vit-src", LABELS)
    save_tiny_clip(root / "clip-src")
    for name in ("vit", "clip"):
        convert(root / f"{name}-src", root / name, ConvertConfig(measure_latency=False))
    return root


@pytest.fixture(scope="class")
def vit_port(ray_env, artifacts):
    from slimml.serve import ServeConfig

    with serving(ServeConfig(str(artifacts / "vit"), name="vit")) as port:
        yield port


@pytest.fixture(scope="class")
def clip_port(ray_env, artifacts):  # a class of its own: one server (one Ray) at a time in this process
    from slimml.serve import ServeConfig

    with serving(ServeConfig(str(artifacts / "clip"), name="clip")) as port:
        yield port


def post(port: int, path: str, body: dict):
    r = requests.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=60)
    return r.status_code, r.json()


class TestViT:
    def test_an_image_classifier_classifies_data_urls_as_in_process(self, vit_port, artifacts):
        from slimml.runtime import load

        pictures = _pictures(5)
        want = load(artifacts / "vit").classify(pictures, top_k=2)
        status, body = post(vit_port, "/v1/classify", {"input": [data_url(p) for p in pictures], "top_k": 2, "model": "vit"})
        assert status == 200 and [d["index"] for d in body["data"]] == list(range(5))
        for got, expected in zip(body["data"], want):
            assert [x["label"] for x in got["labels"]] == [x["label"] for x in expected]
            np.testing.assert_allclose([x["score"] for x in got["labels"]], [x["score"] for x in expected], atol=1e-6)
        status, body = post(vit_port, "/v1/classify", {"input": data_url(pictures[0], "JPEG")})  # one image, a JPEG
        assert status == 200 and len(body["data"]) == 1 and len(body["data"][0]["labels"]) == 4


    @pytest.mark.parametrize("what, body, status, words, param", [
        ("a web address", {"input": ["https://example.com/cat.png"]}, 400, "a web address: this server fetches nothing",
         "input[0]"),
        ("a server path", {"input": ["/etc/hostname"]}, 400, "not an image data URL", "input[0]"),
        ("bad base64", {"input": ["data:image/png;base64,@@@"]}, 400, "not valid base64", "input[0]"),
        ("not an image", {"input": ["data:image/png;base64," + base64.b64encode(b"hello").decode()]}, 400,
         "not an image slimml reads (not one of these formats)", "input[0]"),
    ("an EPS file (Ghostscript would read it)", {"input": ["data:image/png;base64," + base64.b64encode(
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n").decode()]}, 400,
     "not an image slimml reads (not one of these formats); send a JPEG, PNG, BMP, GIF or WebP file", "input[0]"),
        ("a header of 10 gigapixels", {"input": [_huge_png(100_000, 100_000)]}, 413, "10,000,000,000 pixels, more than",
     "input[0]"),
    ("a header of 40 megapixels", {"input": [_huge_png(8_000, 5_000)]}, 413, "8000x5000 pixels, more than the 33,554,432",
     "input[0]"),
        ("labels for a classifier of its own", {"input": ["data:image/png;base64,AA=="], "labels": ["a", "b"]}, 400,
         "this classifier scores its own labels", "labels"),
        ("no input", {"top_k": 1}, 400, 'needs "input"', "input"),
    ])
    def test_images_the_route_cannot_take_are_one_line(self, vit_port, what, body, status, words, param):
        got, answer = post(vit_port, "/v1/classify", body)
        error = answer["error"]
        assert got == status and words in error["message"] and error["param"] == param, (what, error)
        assert "\n" not in error["message"] and "/etc" not in error["message"]


class TestClip:
    def test_clip_classifies_images_against_labels_and_embeds_them(self, clip_port, artifacts):
        from slimml.runtime import load

        model, pictures = load(artifacts / "clip"), _pictures(4)
        labels = ["a photo of a cat", "a photo of a dog", "a diagram"]
        want = model.classify(pictures, labels=labels)
        status, body = post(clip_port, "/v1/classify", {"input": [data_url(p) for p in pictures], "labels": labels})
        assert status == 200
        for got, expected in zip(body["data"], want):
            assert [x["label"] for x in got["labels"]] == [x["label"] for x in expected]
            np.testing.assert_allclose([x["score"] for x in got["labels"]], [x["score"] for x in expected], atol=1e-6)
        status, body = post(clip_port, "/v1/embeddings", {"input": [data_url(p) for p in pictures]})
        assert status == 200 and body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
        np.testing.assert_allclose([d["embedding"] for d in body["data"]], model.embed_images(pictures), atol=1e-6)
        status, body = post(clip_port, "/v1/embeddings", {"input": ["a photo of a cat"]})  # texts: the text tower, as before
        np.testing.assert_allclose(body["data"][0]["embedding"], model.embed_texts(["a photo of a cat"])[0], atol=1e-6)
        about = "data:image/png names a PNG file in a data URL"  # a text about data URLs is a text
        status, body = post(clip_port, "/v1/embeddings", {"input": [about]})
        assert status == 200
        np.testing.assert_allclose(body["data"][0]["embedding"], model.embed_texts([about])[0], atol=1e-6)
        status, body = post(clip_port, "/v1/embeddings", {"input": ["data:image/png,AAAA"]})  # a data URL, not base64
        assert status == 400 and "send the image inline" in body["error"]["message"], body
        for sent, words, param in (({"input": [data_url(pictures[0])]}, 'needs "labels"', "labels"),
                                   ({"input": [data_url(pictures[0])], "labels": ["a", "b", "a"]}, 'names "a" twice', "labels")):
            status, body = post(clip_port, "/v1/classify", sent)
            assert status == 400 and words in body["error"]["message"] and body["error"]["param"] == param
        status, body = post(clip_port, "/v1/embeddings", {"input": [data_url(pictures[0]), "a text"]})
        assert status == 400 and "send texts and images in requests of their own" in body["error"]["message"]
        for sent, words, param in (
                ({"labels": "a cat"}, '"labels" must be a non-empty list of texts, got "a cat"', "labels"),
                ({"labels": ["a cat", " "]}, '"labels"[1] is " "; each label is a text with words in it', "labels[1]"),
                ({"labels": ["a"], "candidate_labels": ["b"]}, 'send the candidate texts as "labels"', "candidate_labels")):
            status, body = post(clip_port, "/v1/classify", {"input": [data_url(pictures[0])], **sent})
            assert status == 400 and words in body["error"]["message"] and body["error"]["param"] == param, body
        status, body = post(clip_port, "/v1/embeddings", {"input": [data_url(pictures[0])], "prompt_name": "query"})
        assert status == 400 and body["error"]["param"] == "prompt_name"
