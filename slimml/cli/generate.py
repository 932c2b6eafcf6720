"""``slimml generate``: prompts continued by a language model (or an encoder-decoder), printed as they come."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.text import Text

from slimml.cli.common import Artifact, AsJson, app, console, err
from slimml.cli.options import Options, OptionValues, config_options
from slimml.errors import ConfigError, NoChatTemplateError
from slimml.runtime.engine.config import LoadConfig
from slimml.runtime.tasks.limits import a_or_an


@app.command()
@config_options(loading=Options(LoadConfig, only=("device", "resident", "prefetch", "memory_budget", "pin", "pack", "cache_dir")))
def generate(
    artifact: Artifact,
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts, after the artifact (or --prompt).", show_default=False)] = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="A prompt (repeat for a batch).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Tokens to add per prompt at most (default 32; an encoder-decoder: its generation config's max_length).", show_default=False)] = None,
    num_beams: Annotated[Optional[int], typer.Option(help="Beam search over this many hypotheses a prompt (1: none; default: the model's generation config); the text prints whole at the end.", show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature; 0 is greedy (the most likely token each step). Default: the model's generation config's (greedy unless it samples).", show_default=False)] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Sample among the k most likely tokens only (0: off). Default: the model's generation config's, else 50 (transformers').", show_default=False)] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Sample among the most likely tokens whose probabilities add up to p (1: off). Default: the model's generation config's, else off.", show_default=False)] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Sample only among tokens at least this times as likely as the most likely one (0: off), as llama.cpp's --min-p. Default: the model's generation config's, else off.", show_default=False)] = None,
    typical_p: Annotated[Optional[float], typer.Option(help="Sample among the locally typical tokens whose probabilities add up to p (1: off), as transformers' typical_p and llama.cpp's --typical. Default: the model's generation config's, else off.", show_default=False)] = None,
    epsilon_cutoff: Annotated[Optional[float], typer.Option(help="Sample only among tokens at least this likely (0: off), as transformers' epsilon_cutoff. Default: the model's generation config's, else off.", show_default=False)] = None,
    eta_cutoff: Annotated[Optional[float], typer.Option(help="Sample only among tokens at least min(eta, sqrt(eta) x exp(-entropy)) likely (0: off), as transformers' eta_cutoff. Default: the model's generation config's, else off.", show_default=False)] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="Divide the logits of tokens already seen by this (1: off). Default: the model's generation config's, else off.", show_default=False)] = None,
    no_repeat_ngram_size: Annotated[Optional[int], typer.Option(help="Never choose a token that completes an n-gram of this many tokens the prompt or answer already holds (0: off), as transformers' no_repeat_ngram_size. Default: the model's generation config's, else off.", show_default=False)] = None,
    presence_penalty: Annotated[float, typer.Option(help="Subtract this from the logit of every token the answer already holds (OpenAI's; -2 to 2, 0: off).")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="Subtract this from a token's logit for each time the answer already holds it (OpenAI's; -2 to 2, 0: off).")] = 0.0,
    logit_bias: Annotated[Optional[list[str]], typer.Option("--logit-bias", help="ID=BIAS: add BIAS (-100 to 100) to token ID's logit before sampling, as OpenAI's logit_bias; -100 keeps the token out (repeat).", show_default=False)] = None,
    logprobs: Annotated[Optional[int], typer.Option(help="With --json: each new token's log-probability and this many most likely alternatives (0 to 20).", show_default=False)] = None,
    response_format: Annotated[Optional[str], typer.Option(help='Hold the answer to a format: "json" (a JSON object), or OpenAI\'s response_format as JSON, e.g. \'{"type": "json_schema", "json_schema": {"schema": {...}}}\' (also {"type": "regex", "regex": ...} and {"type": "grammar", "grammar": LARK}).', show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, help="Seed for sampling: the same seed gives the same text.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop where this text appears; it is not printed (repeat).")] = None,
    stop_token_id: Annotated[Optional[list[int]], typer.Option("--stop-token-id", help="Stop after this token id, beside the end-of-sequence ones (repeat).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt as a user message in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="With --chat: a system message before each prompt.")] = None,
    tools: Annotated[Optional[str], typer.Option("--tools", help='With --chat: a JSON file of the functions the model may call, OpenAI\'s tools list ([{"type": "function", "function": {"name", "description", "parameters"}}]); each call prints after the text, and under "tool_calls" with --json.', show_default=False)] = None,
    tool_choice: Annotated[str, typer.Option(help='With --tools: "auto" (text or calls), "required" (calls only), "none", or the name of the one function to call.')] = "auto",
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="With --chat: a Jinja chat template file rendered instead of the artifact's (e.g. one that knows tools).", show_default=False)] = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Keep the end of a prompt longer than the model's context instead of refusing it.")] = False,
    prompt_lookup: Annotated[int, typer.Option(min=0, help="Also compute this many guessed positions a pass, copied from where the last tokens appeared before (same text, fewer passes when it quotes its prompt; 0: off).")] = 0,
    loading: OptionValues = None,
    as_json: AsJson = False,
):
    """Continue prompts with a decoder artifact (converted with --task text-generation[-with-past]),
    printing the text as it comes: as the model's generation config says (greedy where it says nothing), sampled
    with --temperature, greedy with --temperature 0."""
    from slimml.runtime import load
    from slimml.runtime.tasks.generation import GenerationConfig

    options = {k: v for k, v in dict(  # the flags given: the rest are the model's (its generation config), as in Python
        max_new_tokens=max_new_tokens, num_beams=num_beams, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        typical_p=typical_p, epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff, repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        presence_penalty=presence_penalty or None, frequency_penalty=frequency_penalty or None, logit_bias=_logit_bias(logit_bias),
        logprobs=logprobs, response_format=_response_format(response_format), seed=seed, stop=tuple(stop or ()) or None,
        stop_token_ids=tuple(stop_token_id or ()) or None, truncate=truncate or None, prompt_lookup=prompt_lookup or None,
    ).items() if v is not None}
    try:  # checked before the model loads
        GenerationConfig.of(None, **options)
    except ConfigError as e:  # said with the flag given ("typical_p must be" -> "--typical-p must be")
        said, name = str(e), next((k for k in options if str(e).startswith(k + " ")), None)
        if name is None:
            raise
        raise ConfigError("--" + name.replace("_", "-") + said[len(name):]) from None
    if logprobs is not None and not as_json:
        raise ConfigError("--logprobs adds each token's log-probabilities to the JSON output; add --json.")
    if system is not None and not chat:
        raise ConfigError("--system is a chat message; add --chat, or put the text in --prompt.")
    for flag, value in (("--tools", tools), ("--chat-template", chat_template)):
        if value is not None and not chat:
            raise ConfigError(f"{flag} is for chats; add --chat.")
    offered = _tool_options(tools, tool_choice)
    prompt = [*(prompts or ()), *(prompt or ())]
    if not prompt:
        raise ConfigError(f'no prompt given; add one after the artifact: slimml generate {artifact} "Once upon a time" '
                          '(or --prompt TEXT, repeated for a batch).')
    head = [{"role": "system", "content": system}] if system is not None else []
    conversations = [[*head, {"role": "user", "content": p}] for p in prompt]
    model = load(artifact, loading.build())
    if not model.supports("generate"):  # the task's own refusal names Python's methods: here, the command
        raise ConfigError(f"{artifact} is {a_or_an(repr(model.manifest.task))} model, which does not generate text; use "
                          f"`slimml run {artifact} TEXT` for its outputs.")
    if chat_template is not None and model.supports("stream"):
        model.use_chat_template(chat_template)
    elif chat and model.supports("stream"):
        from slimml.runtime.tasks.generate import chat_template as template_of

        try:
            template_of(model)
        except NoChatTemplateError:
            raise ConfigError(f"{artifact} has no chat template; give one with --chat-template FILE, or drop --chat to "
                              "continue each prompt as it is.") from None
    if model.plan.streaming and not as_json:
        err.print(model.plan.describe())
    if not model.supports("stream"):  # an encoder-decoder answers: greedy, sampled or by beam search
        if chat or set(options) - {"max_new_tokens", "num_beams", "temperature", "top_k", "top_p", "seed", "no_repeat_ngram_size"}:
            raise ConfigError(f"{artifact} is an encoder-decoder, which generates greedily, by sampling (--temperature, "
                              "--top-k, --top-p, --seed) or by beam search (--num-beams), each with --no-repeat-ngram-size, "
                              "without a chat template; drop --repetition-penalty, --min-p, --typical-p, --epsilon-cutoff, "
                              "--eta-cutoff, --presence-penalty, "
                              "--frequency-penalty, --logit-bias, --logprobs, --response-format, --stop, --stop-token-id, "
                              "--truncate, --prompt-lookup and --chat.")
        result = model.generate(list(prompt), max_new_tokens=max_new_tokens, num_beams=num_beams, temperature=temperature,
                                top_k=top_k, top_p=top_p, seed=seed,  # None: the model's own; 0 and 1.0 turn them off
                                no_repeat_ngram_size=no_repeat_ngram_size)
        if not as_json:
            for p, text in zip(prompt, result.texts):
                console.print(Text(p, style="bold") + Text(f" -> {text}"), soft_wrap=True)
    elif as_json:
        result = model.chat(conversations, **options, **offered) if chat else model.generate(list(prompt), **options)
    else:
        made, seconds = 0, 0.0
        for p, messages in zip(prompt, conversations):  # one at a time, so that each prompt's text prints as it is produced
            pieces = (model.chat(messages, stream="deltas", **options, **offered) if chat  # thoughts print as they come
                      else model.stream(p, **options))  # refuses before printing
            console.print(Text(p, style="bold"), end="\n" if chat else "", highlight=False,  # Text: a prompt's [brackets]
                          soft_wrap=True)  # are not markup; soft_wrap: no line breaks of the console's width in it
            thinking = False
            for piece in pieces:
                if chat:  # a reasoning model's thoughts between <think> tags, whatever its format writes
                    text = ("" if thinking else "<think>\n") + piece.reasoning if piece.reasoning else ""
                    thinking = thinking or bool(piece.reasoning)
                    if piece.content and thinking:
                        text, thinking = text + "\n</think>\n\n", False
                    piece = text + piece.content
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n</think>\n" if thinking else "\n")
            for call in (pieces.result.tool_calls or [[]])[0]:
                sys.stdout.write(f"[tool call {call.id}] {call.name}({json.dumps(call.arguments, ensure_ascii=False)})\n")
            made, seconds = made + len(pieces.result.tokens[0]), seconds + pieces.result.seconds
        err.print(f"{made} tokens in {seconds:.2f} s ({made / seconds if seconds else 0:.1f} tokens/s)")
        return
    if as_json:
        out = {"texts": result.texts, "tokens": result.tokens, "finish_reasons": result.finish_reasons,
               "seconds": round(result.seconds, 3), "tokens_per_s": round(result.tokens_per_s, 2)}
        if getattr(result, "reasoning", None) is not None:
            out["reasoning"] = result.reasoning
        if getattr(result, "tool_calls", None) is not None:
            out["tool_calls"] = [[{"id": c.id, "name": c.name, "arguments": c.arguments} for c in row] for row in result.tool_calls]
        if result.logprobs is not None:
            out["logprobs"] = [[{"id": e.id, "logprob": e.logprob, "top": [list(t) for t in e.top]} for e in row]
                               for row in result.logprobs]
        print(json.dumps(out))
        return
    err.print(f"{sum(map(len, result.tokens))} tokens in {result.seconds:.2f} s ({result.tokens_per_s:.1f} tokens/s)")


def _logit_bias(values: list[str] | None) -> dict[str, float] | None:
    """``--logit-bias ID=BIAS`` (repeated) as ``{ID: BIAS}`` (checked by GenerationConfig)."""
    out: dict[str, float] = {}
    for v in values or ():
        token, _, bias = v.partition("=")
        try:
            if not (token.strip().isascii() and token.strip().isdigit()):
                raise ValueError
            out[token.strip()] = float(bias)
        except ValueError:
            raise ConfigError(f"--logit-bias {v!r} is not ID=BIAS (a token id and a number); write e.g. --logit-bias "
                              "50256=-100.") from None
    return out or None


def _tool_options(path: str | None, choice: str) -> dict:
    """``--tools FILE`` and ``--tool-choice`` as ``chat``'s ``tools`` and ``tool_choice`` (checked there)."""
    if path is None:
        if choice not in ("auto", "none"):
            raise ConfigError("--tool-choice chooses among --tools; add --tools FILE, or leave --tool-choice out.")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as e:
        raise ConfigError(f"--tools {path} cannot be read ({e.strerror}); give a JSON file of OpenAI's tools list.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--tools {path} is not JSON ({getattr(e, 'msg', e)}); write OpenAI's tools list, "
                          '[{"type": "function", "function": {"name": ..., "parameters": {...}}}].') from None
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"tools": tools, "tool_choice": choice}


def _response_format(value: str | None) -> dict | None:
    """``--response-format``: "json", or OpenAI's response_format written as JSON."""
    if value is None:
        return None
    if value.strip() == "json":
        return {"type": "json_object"}
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError) as e:  # ValueError: a number of more than 4,300 digits
        why = f"{e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else "nested too deeply or a number too long"
        raise ConfigError(f"--response-format is not JSON ({why}); pass \"json\", or e.g. "
                          '\'{"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}\'.') from None
    return parsed
