"""Request parsing and server options, without a server: exact messages for bad input."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest

from slimml.errors import ConfigError, RequestError

protocol = pytest.importorskip("slimml.serve.protocol")
from slimml.serve.config import ServeConfig  # noqa: E402


def test_config_from_serve_run_arguments():
    c = ServeConfig.from_args({"artifact": "a", "replicas": "2", "batch_wait_ms": "2.5", "max_batch_size": 64})
    assert (c.replicas, c.batch_wait_ms, c.max_batch_size) == (2, 2.5, 64)
    with pytest.raises(ConfigError, match=r"^unknown serve option 'replica' \(did you mean 'replicas'\?\); the options are "):
        ServeConfig.from_args({"artifact": "a", "replica": "2"})
    with pytest.raises(ConfigError, match="give the artifact"):
        ServeConfig.from_args({})
    with pytest.raises(ConfigError, match="replicas must be a whole number >= 1, got 0"):
        ServeConfig("a", replicas=0)
    with pytest.raises(ConfigError, match="name must be a non-empty model name"):
        ServeConfig("a", name=" ")  # a model with an empty id
    with pytest.raises(ConfigError, match="max_batch_size must be a number"):
        ServeConfig.from_args({"artifact": "a", "max_batch_size": "lots"})
    assert ServeConfig("a", max_batch_size=300).max_ongoing_requests == 128  # bounded on its own, not by batch size
    assert ServeConfig.from_args({"artifact": "a", "access_log": "false"}).access_log is False
    assert ServeConfig.from_args({"artifact": "a", "access_log": "True"}).access_log is True
    with pytest.raises(ConfigError, match="access_log must be true or false"):
        ServeConfig.from_args({"artifact": "a", "access_log": "maybe"})
    assert ServeConfig("a").prefix_bytes == 256_000_000 and ServeConfig("a", prefix_cache="0").prefix_bytes == 0
    assert ServeConfig.from_args({"artifact": "a", "prefix_cache": "1.5GiB"}).prefix_bytes == 3 << 29
    with pytest.raises(ConfigError, match=r"^prefix cache \(prefix_cache=, --prefix-cache\) 'lots' is not a size; write it like '4GB'.*, or 0 to turn it off\.$"):
        ServeConfig("a", prefix_cache="lots")
    assert ServeConfig.from_args({"artifact": "a", "pack": "false"}).pack is False  # a streamed model's weights fed
    with pytest.raises(ConfigError, match=r"^cache_dir=3 must be a folder path\.$"):  # LoadConfig's words, before Ray
        ServeConfig("a", cache_dir=3)


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
    with pytest.raises(RequestError, match=r"the .npy file holds Python objects \(dtype object\); send a numeric array"):
        protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(pickled.getvalue()).decode()}}})


def test_an_npy_header_is_read_before_its_array_is_made():
    """A 200-byte body whose header declared (100000, 3, 1000, 1000) float32 made numpy allocate
    1.09 TiB: a plain-text 500 from a MemoryError. A PNG sent as npy got numpy's pickle advice."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 3, 1000, 1000), }"
    header += " " * (118 - len(header)) + "\n"
    huge = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
    with pytest.raises(RequestError, match=r"header says shape \[100000, 3, 1000, 1000\] of float32 "
                                           r"\(1,200,000,000,000 bytes\) but 0 bytes of data follow"):
        protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(huge).decode()}}})
    with pytest.raises(RequestError, match=r'"npy" is not a .npy array file \(the magic string is not correct'):
        protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"x" * 40).decode()}}})
    buf = io.BytesIO()
    np.save(buf, np.arange(6, dtype=np.int64).reshape(2, 3))
    feeds, _, _ = protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(buf.getvalue()).decode()}}})
    np.testing.assert_array_equal(feeds["x"], np.arange(6).reshape(2, 3))
    with pytest.raises(RequestError, match=r"\(48 bytes\) but 40 bytes of data follow"):  # cut short
        protocol.run_inputs({"inputs": {"x": {"npy": base64.b64encode(buf.getvalue()[:-8]).decode()}}})


def test_generate_requests():
    assert protocol.generate_request({"prompt": "hi", "max_new_tokens": 4}, 16, 8) == (["hi"], 4, {})
    assert protocol.generate_request({"prompt": [[1, 2], [3]]}, 16, 8) == ([[1, 2], [3]], 16, {})
    # a search the route cannot give is refused, never ignored (T5's num_beams, a decoder's temperature were)
    with pytest.raises(RequestError, match='^"temperature" is not an option of POST /v1/generate here; POST /v1/generate '
                                           "decodes greedily: send sampling.* to POST /v1/completions") as e:
        protocol.generate_request({"prompt": "hi", "temperature": 0.7}, 16, 8)
    assert e.value.param == "temperature"
    for field in ("typical_p", "epsilon_cutoff", "eta_cutoff", "early_stopping"):  # were accepted and ignored
        with pytest.raises(RequestError, match=f'^"{field}" is not an option of POST /v1/generate here'):
            protocol.generate_request({"prompt": "hi", field: 0.5}, 16, 8)
    # beams: pointed to what runs them (it sent them to POST /v1/completions, which ignored them)
    with pytest.raises(RequestError, match='^"num_beams" is not an option of POST /v1/generate here; POST /v1/generate '
                                           "decodes greedily, and no route of this server runs a beam search: beam "
                                           r"search runs in process \(model.generate"):
        protocol.generate_request({"prompt": "hi", "num_beams": 2}, 16, 8)
    seq2seq = protocol.SEQ2SEQ_OPTIONS
    assert protocol.generate_request({"prompt": "hi", "num_beams": 4, "seed": None}, 16, 8, options=seq2seq) == (
        ["hi"], 16, {"num_beams": 4})
    with pytest.raises(RequestError, match='^"stop" is not an option of POST /v1/generate here; this encoder-decoder\'s '
                                           "options are num_beams, length_penalty"):
        protocol.generate_request({"prompt": "hi", "stop": ["."]}, 16, 8, options=seq2seq)
    with pytest.raises(RequestError, match="from 1 to 16, got 17"):
        protocol.generate_request({"prompt": "hi", "max_new_tokens": 17}, 16, 8)
    for prompt, said in (
            (["hi", [1]], '"prompt" mixes texts and token id lists; send one kind in a request.'),
            ([1, 2, 3], '"prompt" is one list of token ids; send it as [[1, 2, 3]] (a list of id lists is a batch).'),
            (["hi", ""], '"prompt"[1] is empty; give each prompt some text or token ids.'),
            ([[]], '"prompt"[0] is empty; give each prompt some text or token ids.'),
            ([[1, 1.5]], '"prompt"[0] holds 1.5; token ids are whole numbers >= 0.'),
            (["hi", None], '"prompt"[1] is a JSON null; send texts, or lists of token ids.'),
            ([[-1]], '"prompt"[0] holds the token id -1, outside this model\'s vocabulary [0, 512); send ids from 0 to 511.')):
        with pytest.raises(RequestError) as e:
            protocol.generate_request({"prompt": prompt}, 16, 8, vocab_size=512)
        assert str(e.value) == said and e.value.param == "prompt"


def test_openai_fields_that_would_change_the_answer_are_used_or_refused():
    """``logit_bias`` is read (ids as JSON keys); ``echo``, ``best_of`` and ``suffix`` are refused
    rather than ignored; their "off" values pass."""
    openai = pytest.importorskip("slimml.serve.openai")
    req = openai.completion_request({"prompt": "hi", "logit_bias": {"12": -100, " 7": 2.5}, "echo": False, "best_of": 1,
                                     "suffix": ""}, False, 16)
    assert req.logit_bias == {12: -100.0, 7: 2.5}
    assert openai.completion_request({"prompt": "hi", "logit_bias": {}}, False, 16).logit_bias is None
    assert openai.completion_request({"prompt": "hi", "min_p": 0.05}, False, 16).min_p == 0.05  # vLLM's and llama.cpp's extra
    with pytest.raises(RequestError, match='^"min_p" must be a number from 0 to 1 \\(0: off\\), got 2.$'):
        openai.completion_request({"prompt": "hi", "min_p": 2}, False, 16)
    assert openai.completion_request({"prompt": "hi", "n": None}, False, 512).max_tokens == 16  # null n: one; OpenAI's 16
    assert openai.completion_request({"messages": [{"role": "user", "content": "hi"}], "n": 1}, True, 512).max_tokens is None
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


def test_other_apis_fields_are_refused_with_this_ones_and_min_tokens_is_read():
    """Fields of transformers' generate, OpenAI's deprecated function calling and hosted tools were ignored (a
    request for greedy, beams or a function call answered with a sampled text); their "off" values pass."""
    openai = pytest.importorskip("slimml.serve.openai")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for field, value, said in (
            ("max_new_tokens", 8, 'send "max_tokens"'), ("min_new_tokens", 3, 'send "min_tokens"'),
            ("do_sample", False, '"temperature": 0 for greedy'), ("num_return_sequences", 2, "one request per answer"),
            ("num_beams", 4, "slimml generate --num-beams"), ("use_beam_search", True, "token by token"),
            ("use_beam_search", 1, "beam search runs in process"),
            ("functions", [{"name": "f", "parameters": {"type": "object"}}], 'send "tools"'),
            ("function_call", "auto", 'send "tool_choice"'), ("web_search_options", {}, "no web search")):
        with pytest.raises(RequestError) as e:
            openai.completion_request({**chat, field: value}, True, 16)
        assert e.value.param == field and said in str(e.value), str(e.value)
    assert openai.completion_request({**chat, "do_sample": True, "num_beams": 1, "functions": [], "min_new_tokens": 0,
                                      "function_call": "none", "length_penalty": 0.5}, True, 16).temperature == 1.0
    # greedy said both ways, and beams' length penalty without beams (it changes nothing there): taken
    assert openai.completion_request({**chat, "do_sample": False, "temperature": 0}, True, 16).temperature == 0
    assert openai.completion_request({**chat, "min_tokens": 5, "max_tokens": 9}, True, 16).min_tokens == 5  # vLLM's
    with pytest.raises(RequestError, match=r'^"min_tokens" \(10\) must not be above "max_tokens" \(9\); lower it, or '
                                           r'send a larger "max_tokens".$'):
        openai.completion_request({**chat, "min_tokens": 10, "max_tokens": 9}, True, 16)
    with pytest.raises(RequestError, match=r'\(16, the default\)'):  # completions' default, which it did not send
        openai.completion_request({"prompt": "hi", "min_tokens": 20}, False, 64)
    responses = pytest.importorskip("slimml.serve.responses")
    with pytest.raises(RequestError, match='send "max_output_tokens"') as e:  # in the Responses API's own terms
        responses.responses_request({"input": "hi", "max_new_tokens": 8}, 16)
    assert e.value.param == "max_new_tokens"
    with pytest.raises(RequestError, match=r'send "tools": \[\{"type": "function", "name", "description"'):  # its flat shape
        responses.responses_request({"input": "hi", "functions": [{"name": "f"}]}, 16)


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


def test_a_serve_config_s_relative_artifact_is_made_absolute_and_pinned_where_it_is_built(default_artifact, monkeypatch):
    """docs/serve.yaml's relative path reached the replicas as it was, and each resolved it from Ray's
    folder ("is not an artifact folder: it does not exist"); nor was its manifest pinned, so a replica
    that replaced one after a new convert served another model beside the old one."""
    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.serve.app import build

    monkeypatch.chdir(default_artifact.parent)
    application = build({"artifact": default_artifact.name})
    args = application._bound_deployment._replica_config.init_args[0]  # what each replica is made with
    assert args["artifact"] == str(default_artifact.resolve())
    assert args["manifest_sha256"] == read_manifest(default_artifact).sha256
    with pytest.raises(ConfigError, match=r"the artifact 'artifacts/nope' is a relative path, and .* has no such folder; "
                                          r"give its absolute path"):
        build({"artifact": "artifacts/nope"})


def test_responses_input_items_read_into_a_chat_and_bad_ones_refused_in_its_terms():
    """``POST /v1/responses``' ``input``: a call joins the assistant message before it, thoughts
    go to the assistant message right after them, a tool's output is a ``tool`` message, the
    instructions a system message first; refusals name the Responses field."""
    from slimml.serve.responses import responses_request

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    req, echo = responses_request({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"role": "assistant", "content": "Let me look."}, call,
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "again"}]}, {**call, "call_id": "c2"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "max_output_tokens": 9}, 64)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert req.messages[2]["reasoning_content"] == "think" and [c["id"] for c in req.messages[2]["tool_calls"]] == ["c1"]
    assert req.messages[4]["reasoning_content"] == "again" and req.messages[3] == {"role": "tool", "tool_call_id": "c1",
                                                                                   "content": "42"}
    assert req.max_tokens == 9 and [f["function"]["name"] for f in req.tools.functions] == ["f"] and echo["tool_choice"] == "auto"
    for body, param in (({"input": "q", "previous_response_id": "r"}, "previous_response_id"),
                        ({"input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": "x"}]}, "input[1].summary"),
                        ({"input": [{"call_id": "c", "output": "x"}]}, "input[0]"),
                        ({"input": [{"role": "system", "content": "x"}]}, "input"),
                        ({"input": "q", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "q", "reasoning": {"effort": 3}}, "reasoning.effort"),
                        ({"input": "q", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
                        ({"input": "q", "top_logprobs": 2}, "top_logprobs"), ({"input": "q", "text": "json"}, "text"),
                        ({"input": [{"role": "user", "content": "q"}, {**call, "arguments": "[1]"}]}, "input[1].arguments")):
        with pytest.raises(RequestError) as e:
            responses_request(body, 64)
        assert e.value.param == param and "max_tokens" not in str(e.value) and e.value.status == 400, str(e.value)


def test_responses_stream_events_are_put_together_by_the_openai_client_into_the_whole_response():
    """The events of a streamed reply (thoughts, text, a call whose arguments come in pieces, one
    of them beside the next text) read by the ``openai`` client's own ``responses.stream``
    accumulator give the response its ``response.completed`` event carries, and the same items as
    the whole response to the same reply; a reply cut at ``max_output_tokens`` is incomplete."""
    openai = pytest.importorskip("openai")
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from slimml.runtime.tasks.generation.reply import Reply, ReplyDelta
    from slimml.runtime.tasks.generation.tools import CallDelta, ToolCall
    from slimml.serve.responses import ResponseAnswer, responses_request

    _, echo = responses_request({"input": "q"}, 64)
    pieces = [ReplyDelta(reasoning="Th"), ReplyDelta(reasoning="ink."), ReplyDelta(content="Sure."),
              ReplyDelta(calls=(CallDelta(0, '{"a": ', "call_1", "f"),)), ReplyDelta(content="!", calls=(CallDelta(0, "1}"),))]
    for reason in ("stop", "length"):
        answer = ResponseAnswer(echo, "m")
        events = answer.opening() + [e for d in pieces for e in answer.events(d)] + answer.ending(reason, (5, 7, 0))
        state = ResponseStreamState(input_tools=openai.NOT_GIVEN, text_format=openai.NOT_GIVEN)
        parsed = []
        for raw in events:
            kind, data = raw.decode().split("\n", 1)
            assert kind == "event: " + json.loads(data[len("data: "):])["type"]
            parsed.append(construct_type(type_=ResponseStreamEvent, value=json.loads(data[len("data: "):])))
            state.handle_event(parsed[-1])
        assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
        final = parsed[-1].response
        assert [o.type for o in final.output] == ["reasoning", "message", "function_call", "message"]
        assert final.output[0].content[0].text == "Think." and final.output[2].arguments == '{"a": 1}'
        assert final.output_text == "Sure.!" and final.usage.total_tokens == 12
        if reason == "stop":
            assert parsed[-1].type == "response.completed" and state._completed_response.output_text == "Sure.!"
        else:
            assert parsed[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
            assert final.output[-1].status == "incomplete" and final.output[0].status == "completed"
    whole = ResponseAnswer(echo, "m").reply(Reply("Sure.", "Think.", (ToolCall("f", {"a": 1}, "call_1"),)), "stop", (5, 7, 0))
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message", "function_call"]
    assert ResponseAnswer(echo, "m").reply(Reply(""), "stop", (1, 1, 0))["output"][0]["type"] == "message"


def test_a_rerank_text_that_is_not_unicode_is_named_by_its_own_field_and_index():
    """documents[2] was called '"query", "documents"[3]' (the query counted among the documents), param null."""
    with pytest.raises(RequestError) as e:
        protocol.rerank_request({"query": "q", "documents": ["ok", "ok2", "b\ud800"]}, 100)
    assert str(e.value).startswith('"documents"[2] is not valid Unicode') and e.value.param == "documents[2]"
    with pytest.raises(RequestError) as e:
        protocol.rerank_request({"query": "q\ud800", "documents": ["ok"]}, 100)
    assert str(e.value).startswith('"query" is not valid Unicode') and e.value.param == "query"


def test_review_of_the_text_routes_fields():
    """A reviewer's findings: a lone surrogate's param was null (now "input[1]"); true was "token ids";
    null encoding_format a 400 (null dimensions was the default); text pairs to classify were "token
    ids"; rerank gave back documents cut to the server's text length, not as sent."""
    with pytest.raises(RequestError) as e:
        protocol.embedding_texts({"input": ["ok", "b\ud800"]}, 10)
    assert e.value.param == "input[1]"
    with pytest.raises(RequestError, match=r'"input"\[0\] is a JSON boolean, not a text'):
        protocol.embedding_texts({"input": [True]}, 10)
    assert protocol.embedding_texts({"input": "hi", "encoding_format": None}, 10) == ["hi"]
    # LangChain's default: tiktoken's ids, not this model's vocabulary; the refusal says how to send texts
    with pytest.raises(RequestError, match=r'"input"\[0\] is token ids.*check_embedding_ctx_length=False'):
        protocol.embedding_texts({"input": [[9906, 1917]]}, 10)
    with pytest.raises(RequestError, match=r"is token ids, not a text; send texts \(this server tokenizes them\)\.$"):
        protocol.entities_request({"input": [[1, 2]]}, 10, None)
    assert protocol.classify_request({"input": [["a", "b"], ["c", "d"]]}, 10, None) == ([("a", "b"), ("c", "d")], None)
    assert protocol.classify_request({"input": ["a", "b"]}, 10, None) == (["a", "b"], None)
    with pytest.raises(RequestError, match='"labels" names candidate labels for zero-shot') as e:  # ignored before
        protocol.classify_request({"input": ["a"], "labels": ["x", "y"]}, 10, None)
    assert e.value.param == "labels"
    with pytest.raises(RequestError, match=r'^"input"\[2\]\[1\] is not valid Unicode') as e:
        protocol.classify_request({"input": [["a", "b"], ["c", "d"], ["e", "f\ud800"]]}, 10, None)
    assert e.value.param == "input[2][1]"
    _, cut, _, sent = protocol.rerank_request({"query": "q", "documents": ["x" * 50, {"text": "y"}]}, 10, max_chars=20)
    assert cut == ["x" * 20, "y"] and sent == ["x" * 50, "y"]
    assert protocol.rerank_request({"query": "q", "documents": ["d"], "return_documents": False}, 10)[3] is None
    with pytest.raises(RequestError, match='"candidate_labels" names candidate labels for zero-shot') as e:  # ignored before
        protocol.classify_request({"input": ["a"], "candidate_labels": ["x", "y"]}, 10, None)
    with pytest.raises(RequestError, match='"aggregation_strategy" is the Hugging Face pipeline\'s name; .* send '
                                           '"aggregation" instead') as e:
        protocol.entities_request({"input": ["a"], "aggregation_strategy": "simple"}, 10, None)
    assert e.value.param == "aggregation_strategy"
    with pytest.raises(RequestError, match="got 1 questions and 2 contexts") as e:  # the route's pieces need pairs
        protocol.answer_request({"question": ["q"], "context": ["a", "b"]}, 10)
    assert e.value.param == "context"


def test_the_route_list_keeps_its_templated_route():
    message = "there is no GET /v1/nope here; this server answers GET /v1/models, GET /v1/models/{model}."
    assert protocol.public(message) == message  # "GET {model}" before: the path scrubber took it for a path


def test_server_paths_leave_answers_and_a_client_s_own_text_stays():
    """A client's stop string "/end" or role "/admin" came back as "end", "admin": every text that
    looked like a path was cut to its last part, server's or not."""
    assert protocol.public("the artifact /tmp/models/smol/model.onnx is damaged") == "the artifact model.onnx is damaged"
    assert protocol.public("~/models/x has no tokenizer; give one") == "x has no tokenizer; give one"
    for own in ("unknown role '/admin'; use system, user", "stop string '/end/here' is too long", "a b /nonexistent-top/x"):
        assert protocol.public(own) == own


def test_request_values_at_the_far_edges_get_their_400_in_their_own_terms():
    """A stop string of megabytes is refused before the tokenizer sees it; a null include_usage is
    the default; a logit_bias key of thousands of digits, a model that is not a string, a tool's
    description that is not Unicode and an assistant's call arguments nested thousands deep each get
    a 400 naming their own field (were: seconds of a held replica, a vague 400, a 404, message 0, a 500)."""
    openai = pytest.importorskip("slimml.serve.openai")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RequestError, match=r'"stop" string 0 has 3,000,000 characters, more than 4,096') as e:
        openai.completion_request({"prompt": "hi", "stop": ["ab " * 1_000_000]}, False, 16)
    assert e.value.param == "stop"
    req = openai.completion_request({**chat, "stream": True, "stream_options": {"include_usage": None}}, True, 16)
    assert req.include_usage is False
    with pytest.raises(RequestError, match="which is not a token id") as e:
        openai.completion_request({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, False, 16)
    assert e.value.param == "logit_bias"
    with pytest.raises(RequestError, match=r'"model" must be a string .* got \{"a": 1\}') as e:
        protocol.check_model({"model": {"a": 1}}, "smol")
    assert e.value.status == 400
    with pytest.raises(RequestError, match=r'model "x{36}\.\.\. is not served here; this server serves "smol"'):
        protocol.check_model({"model": "x" * 2_000_000}, "smol")
    with pytest.raises(RequestError, match=r"tools\[0\]\.function\.description is not valid Unicode") as e:
        openai.completion_request({**chat, "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
                                  True, 16)
    assert e.value.param == "tools"

    from slimml.errors import FeedError
    from slimml.runtime.tasks.generation.tools import template_messages

    deep = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]
    with pytest.raises(FeedError, match=r"message 0's tool call 0 \(f\) has arguments that are not JSON"):
        template_messages(deep)


def test_transcription_forms_are_read_and_checked_without_a_multipart_package():
    """OpenAI's client sends a multipart form (the WAV "file", "model", options); the standard
    library's MIME parser reads it, binary bytes intact; each field OpenAI has and this server cannot
    honour is refused with its param."""
    requests = pytest.importorskip("requests")
    transcription = pytest.importorskip("slimml.serve.transcription")

    def form(data, files):
        sent = requests.Request("POST", "http://x/", data=data, files=files).prepare()
        return transcription.form_fields(sent.body, sent.headers["Content-Type"])

    audio = bytes(range(256)) * 40 + b"\r\n--\r\n\r"
    fields = form({"model": "w", "language": "de", "temperature": "0.2"}, {"file": ("a.wav", audio, "audio/wav")})
    req = transcription.transcription_request(fields, "w")
    assert (req.audio, req.filename, req.response_format, req.options) == (audio, "a.wav", "json",
                                                                           {"temperature": 0.2, "language": "de"})
    assert transcription.transcription_response("hi", 2.0, "text") == ("hi", "text/plain; charset=utf-8")
    for data, words, param in (({"prompt": "x"}, "does not continue from a previous transcript", "prompt"),
                               ({"timestamp_granularities[]": "word"}, "without timestamps", "timestamp_granularities"),
                               ({"response_format": "vtt"}, 'send "json" or "text"', "response_format"),
                               ({"temperature": "hot"}, 'a number from 0 to 1 (0: the most likely words), got "hot"',
                                "temperature"),
                               ({"stream": "true"}, '"stream" is not supported for transcriptions', "stream")):
        with pytest.raises(RequestError, match=re.escape(words)) as e:
            transcription.transcription_request(form(data, {"file": ("a.wav", audio)}), "w")
        assert e.value.param == param
    with pytest.raises(RequestError, match="takes multipart/form-data") as e:
        transcription.form_fields(b'{"file": "/etc/passwd"}', "application/json")
    assert e.value.status == 415
    with pytest.raises(RequestError, match="not a multipart form with fields"):
        transcription.form_fields(b"garbage", "multipart/form-data; boundary=zzz")


def test_run_s_whole_number_inputs_are_not_cast_from_fractions_or_booleans():
    """numpy cast 1.5 to 1 and true to 1 for an int64 input, silently."""
    for data, words in (([[1.5, 2]], "numbers with a fraction"), ([[True, False]], "true/false")):
        with pytest.raises(RequestError, match=rf'^input "input_ids": int64 data holds {words}; send whole numbers\.$'):
            protocol.run_inputs({"inputs": {"input_ids": {"dtype": "int64", "data": data}}})
    feeds, _, _ = protocol.run_inputs({"inputs": {"input_ids": {"dtype": "int64", "data": [[1.0, 2]]}}})
    assert feeds["input_ids"].tolist() == [[1, 2]]


def test_run_refusals_name_their_field():
    """Every /v1/run refusal had param null; "outputs": [] ran the model to answer {}."""
    with pytest.raises(RequestError) as e:
        protocol.run_inputs({"inputs": {"pixel_values": {"dtype": "float32", "data": [[1], [2, 3]]}}})
    assert e.value.param == "inputs.pixel_values"
    with pytest.raises(RequestError, match="at least one; leave it out for every output") as e:
        protocol.run_inputs({"inputs": {"x": {"dtype": "float32", "data": [1.0]}}, "outputs": []})
    assert e.value.param == "outputs"


def test_each_replica_gets_cpus_it_can_have_on_one_node():
    """One replica on two 1-CPU nodes asked Ray for 2 CPUs (the cluster's CPUs / replicas), which no
    node has: the deploy waited for good."""
    from slimml.serve.run import replica_cpus

    assert replica_cpus([1, 1], 1) == 1.0 and replica_cpus([4, 4], 3) == 2.0 and replica_cpus([2], 4) == 0.5
    assert replica_cpus([16, 2], 2) == 8.0 and replica_cpus([8], 1) == 8.0


def test_a_replica_decodes_a_bounded_number_of_pixels_at_once():
    """Six concurrent requests of one 64-megapixel PNG each (186 KB a body) took a replica to 2.96 GB:
    the budget was a request's alone."""
    images = pytest.importorskip("slimml.serve.images")
    budget = images._Budget(100)
    with budget.hold(60):
        with pytest.raises(RequestError, match=r"decoding other requests' images \(60 pixels of its 100\); retry") as e:
            with budget.hold(50):
                pass
        assert e.value.status == 503
        with budget.hold(40):
            assert budget.used == 100
    assert budget.used == 0
    with budget.hold(150):  # one request larger than the budget, alone: its own limit is the request's
        pass


def test_transcription_forms_refuse_repeated_fields_and_options_sent_as_files():
    """Two "response_format" values: the first won, silently; a "prompt" sent as a file part was
    ignored; 120,000 small fields held the replica's event loop (and /health) for 13 s."""
    requests = pytest.importorskip("requests")
    transcription = pytest.importorskip("slimml.serve.transcription")

    def form(data, files):
        sent = requests.Request("POST", "http://x/", data=data, files=files).prepare()
        return sent.body, sent.headers["Content-Type"]

    with pytest.raises(RequestError, match='sends the field "response_format" twice') as e:
        transcription.form_fields(*form([("response_format", "text"), ("response_format", "srt")], {"file": ("a.wav", b"x")}))
    assert e.value.param == "response_format"
    fields = transcription.form_fields(*form({}, {"file": ("a.wav", b"x"), "prompt": ("p.txt", b"Earlier")}))
    with pytest.raises(RequestError, match='"prompt" is not supported by this server'):
        transcription.transcription_request(fields, "w")
    with pytest.raises(RequestError, match="the form has more than 32 fields") as e:
        transcription.form_fields(*form([(f"f{i}", "x") for i in range(40)], {"file": ("a.wav", b"x")}))
    assert e.value.status == 413


def test_a_tool_message_s_id_is_a_string():
    """A tool message's ``tool_call_id`` of 5 was dropped in silence; now a 400 naming the field."""
    from slimml.serve.openai import _messages

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert _messages({"messages": [*history, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})[-1]["tool_call_id"] == "c1"
    with pytest.raises(RequestError, match=r'"messages"\[2\].tool_call_id must be a string: the id of the call') as e:
        _messages({"messages": [*history, {"role": "tool", "tool_call_id": 5, "content": "ok"}]})
    assert e.value.param == "messages[2].tool_call_id"
