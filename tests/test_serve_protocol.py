"""Request parsing and server options, without a server: exact messages for bad input."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from slimml.errors import ConfigError, RequestError

protocol = pytest.importorskip("slimml.serve.protocol")
from slimml.serve.config import ServeConfig  # noqa: E402


def test_config_from_serve_run_arguments():
    c = ServeConfig.from_args({"artifact": "a", "replicas": "2", "batch_wait_ms": "2.5", "max_batch_size": 64})
    assert (c.replicas, c.batch_wait_ms, c.max_batch_size) == (2, 2.5, 64)
    with pytest.raises(ConfigError, match=r"unknown serve option\(s\) \['replica'\]"):
        ServeConfig.from_args({"artifact": "a", "replica": "2"})
    with pytest.raises(ConfigError, match="give the artifact"):
        ServeConfig.from_args({})
    with pytest.raises(ConfigError, match="replicas must be a whole number >= 1, got 0"):
        ServeConfig("a", replicas=0)
    with pytest.raises(ConfigError, match="max_batch_size must be a number"):
        ServeConfig.from_args({"artifact": "a", "max_batch_size": "lots"})
    assert ServeConfig("a", max_batch_size=300).max_ongoing_requests == 128  # bounded on its own, not by batch size
    assert ServeConfig.from_args({"artifact": "a", "access_log": "false"}).access_log is False
    assert ServeConfig.from_args({"artifact": "a", "access_log": "True"}).access_log is True
    with pytest.raises(ConfigError, match="access_log must be true or false"):
        ServeConfig.from_args({"artifact": "a", "access_log": "maybe"})
    assert ServeConfig("a").prefix_bytes == 256_000_000 and ServeConfig("a", prefix_cache="0").prefix_bytes == 0
    assert ServeConfig.from_args({"artifact": "a", "prefix_cache": "1.5GiB"}).prefix_bytes == 3 << 29
    with pytest.raises(ConfigError, match=r"prefix_cache: memory budget 'lots' is not a size; write it like '4GB'.* 0 turns it off"):
        ServeConfig("a", prefix_cache="lots")


def test_embedding_inputs():
    assert protocol.embedding_texts({"input": "one"}, 10) == ["one"]
    with pytest.raises(RequestError, match="got a JSON object") as e:
        protocol.embedding_texts({"input": {"a": 1}}, 10)
    assert e.value.status == 400
    with pytest.raises(RequestError, match="11 texts, more than this server takes") as e:
        protocol.embedding_texts({"input": ["a"] * 11}, 10)
    assert e.value.status == 413


def test_json_bodies():
    assert protocol.parse_json(b'{"a": 1}') == {"a": 1}
    with pytest.raises(RequestError, match="not valid UTF-8"):
        protocol.parse_json(b'{"a": "\xff"}')
    with pytest.raises(RequestError, match="nested too deeply"):
        protocol.parse_json(b"[" * 100_000 + b"]" * 100_000)


def test_run_arrays_round_trip_as_npy():
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    buf = io.BytesIO()
    np.save(buf, a)
    feeds, outputs, enc = protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(buf.getvalue()).decode()},
                                                          "y": {"dtype": "float32", "data": [[1, 2]]}}})
    np.testing.assert_array_equal(feeds["x"], a)
    assert feeds["y"].dtype == np.float32 and outputs is None and enc == "json"
    body = json.loads(protocol.dumps(protocol.run_response({"x": a}, "json")))
    assert body["outputs"]["x"] == {"dtype": "int64", "shape": [2, 3], "data": a.tolist()}
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(RequestError, match="not a .npy array file"):
        protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(pickled.getvalue()).decode()}}})


def test_generate_requests():
    assert protocol.generate_request({"prompt": "hi", "max_new_tokens": 4}, 16, 8) == (["hi"], 4)
    assert protocol.generate_request({"prompt": [[1, 2], [3]]}, 16, 8) == ([[1, 2], [3]], 16)
    with pytest.raises(RequestError, match="from 1 to 16, got 17"):
        protocol.generate_request({"prompt": "hi", "max_new_tokens": 17}, 16, 8)
    with pytest.raises(RequestError, match="not a mix"):
        protocol.generate_request({"prompt": ["hi", [1]]}, 16, 8)


def test_openai_fields_that_would_change_the_answer_are_used_or_refused():
    """``logit_bias`` is read (ids as JSON keys); ``echo``, ``best_of`` and ``suffix`` are refused
    rather than ignored; their "off" values pass."""
    openai = pytest.importorskip("slimml.serve.openai")
    req = openai.completion_request({"prompt": "hi", "logit_bias": {"12": -100, " 7": 2.5}, "echo": False, "best_of": 1,
                                     "suffix": ""}, False, 16)
    assert req.logit_bias == {12: -100.0, 7: 2.5}
    assert openai.completion_request({"prompt": "hi", "logit_bias": {}}, False, 16).logit_bias is None
    chat = openai.completion_request({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high",
                                      "chat_template_kwargs": {"enable_thinking": False}}, True, 16)
    assert chat.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}  # the template reads them
    assert openai.completion_request({"prompt": "hi", "reasoning_effort": "high"}, False, 16).template_kwargs == {}
    for taken in ("messages", "model", "add_generation_prompt"):  # the server's own: refused, not a 500
        with pytest.raises(RequestError, match="which the server sets itself"):
            openai.completion_request({"messages": [{"role": "user", "content": "hi"}],
                                       "chat_template_kwargs": {taken: 1}}, True, 16)
    with pytest.raises(RequestError, match='"reasoning_effort" must be a word'):
        openai.completion_request({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "very high!"}, True, 16)
    for field, value in (("echo", True), ("best_of", 2), ("suffix", "}\n"),
                         ("chat_template_kwargs", {"enable_thinking": False}), ("logit_bias", [1]), ("logit_bias", {"x": 1}),
                         ("logit_bias", {"1": -101}), ("logit_bias", {str(i): 1 for i in range(1025)})):
        with pytest.raises(RequestError) as e:
            openai.completion_request({"prompt": "hi", field: value}, False, 16)
        assert e.value.param == field, (field, str(e.value))


def test_the_documented_serve_yaml_is_valid_and_builds(default_artifact):
    """docs/serve.yaml passes Ray Serve's own schema, and its import_path builds the application."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from slimml.serve.app import build

    text = (Path(__file__).resolve().parents[1] / "docs" / "serve.yaml").read_text()
    schema = ServeDeploySchema.model_validate(yaml.safe_load(text))
    app = schema.applications[0]
    assert app.import_path == "slimml.serve.app:build"
    application = build({**app.args, "artifact": str(default_artifact)})
    assert type(application).__name__ == "Application"
