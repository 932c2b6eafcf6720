"""The model's chat template, rendered with Jinja2 exactly as transformers' ``apply_chat_template``
renders it (``transformers/utils/chat_template_utils.py``): a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a pass-through
``{% generation %}`` tag; ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps
non-ASCII text; the special tokens (``bos_token``, ``eos_token``, ...) as variables.

Where the template comes from, first found wins: the manifest's tokenizer entry
(``"chat_template": "<file in the artifact>"``, written by ``slimml convert``), then
``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{name, template}`` of which ``default`` is used) in the artifact folder.
"""

from __future__ import annotations

import json
import re
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from slimml.errors import ArtifactError, ConfigError, FeedError, NoChatTemplateError, SlimmlError
from slimml.runtime.artifact.files import read_listed, safe_path
from slimml.runtime.tasks.generation import template_budget
from slimml.runtime.tasks.limits import surrogate_at

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                  "additional_special_tokens")  # transformers' SPECIAL_TOKENS_ATTRIBUTES


TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt"})  # render() passes these itself


class ChatTemplate:
    """A compiled chat template and the special tokens it may use.

    Args:
        source: the Jinja2 template text.
        special: special token names -> their text (``{"bos_token": "<s>", ...}``).
        where: the file it came from, for messages.
        given: the caller's own template (``use_chat_template``, ``--chat-template``), not the artifact's.
    """

    def __init__(self, source: str, special: dict[str, Any] | None = None, where: str = "the chat template",
                 given: bool = False):
        import jinja2
        from jinja2.ext import Extension, loopcontrols

        class Generation(Extension):  # {% generation %}...{% endgeneration %}: marks assistant text; renders it
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = template_budget.sandbox_class()(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[Generation, loopcontrols, template_budget.budget_extension()])
        env.filters["tojson"] = _tojson
        env.filters.update({k: template_budget.budgeted_filter(f) for k, f in env.filters.items()})
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.where = where
        self.source = source
        # DeepSeek-R1's writes an assistant's calls only where its content is none; the rest join
        # content to text, where None would fail or print "None": they get ""
        self.tests_none = _TESTS_NONE.search(source) is not None
        self._writes_results: dict[bool, bool] = {}  # with tools given, or not -> writes_tool_results
        self.knows_developer = "'developer'" in source or '"developer"' in source  # gpt-oss's harmony has the role
        self.given = given
        self.special = {k: v for k, v in (special or {}).items() if v}  # as transformers' special_tokens_map: set ones only
        fix = "fix the template" if given else "fix the template or re-convert the model from a folder whose template works"
        error = ConfigError if given else ArtifactError
        try:
            self.template = template_budget.meter_template(env, source)
        except jinja2.TemplateSyntaxError as e:
            raise error(f"{where} does not parse (line {e.lineno}: {_line(e.message)}); {fix}.") from None
        except (ValueError, OverflowError, MemoryError, RecursionError) as e:  # Jinja folds constants as it compiles
            raise error(f"{where} does not compile ({type(e).__name__}: {_line(str(e))}); {fix}.") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **variables: Any) -> str:
        """The prompt text for ``messages`` (``[{"role": "user", "content": "Hi"}, ...]``), ending
        with the assistant's turn opened when ``add_generation_prompt``, or inside the last message
        when ``continue_final_message`` (as transformers cuts it). ``variables`` reach the template
        too (e.g. ``tools``, ``documents``, ``enable_thinking``)."""
        check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise ConfigError("continue_final_message continues the last message and add_generation_prompt opens a new "
                              "turn; pass add_generation_prompt=False with continue_final_message=True.")
        messages = self.known_roles(messages)
        if continue_final_message:
            messages, final = _tagged(messages)
        context = {"tools": None, "documents": None, **self.special, **variables}
        if any(m.get("role") == "tool" for m in messages) and not self.writes_tool_results(bool(variables.get("tools"))):
            messages = _tool_results_as_user(messages)
        blank = [{**m, "content": ""} if isinstance(m, dict) and m.get("tool_calls") and m.get("content") is None else m
                 for m in messages]
        kept = messages if self.tests_none and blank != messages else None  # a call turn's content None: only for a
        try:                                                                # template that looks for it, "" for the rest
            text = self._render(kept or blank, add_generation_prompt, context, fallback=blank if kept else None)
        except template_budget.OverBudget as e:
            raise SlimmlError(f"{self.where} went past its budget rendering these messages ({e}); fix the template "
                              "(a loop that does not end?) or give fewer, shorter messages.") from None
        except Exception as e:  # raise_exception in the template, an undefined name, a type error in it
            parts = next((i for i, m in enumerate(messages) if isinstance(m.get("content"), (list, tuple))), None)
            hint = (f"; message {parts}'s content is a list of parts, and this template may take text only: give the "
                    "content as a string (the text parts joined)" if parts is not None else "")
            raise SlimmlError(f"{self.where} failed to render these messages ({type(e).__name__}: {_line(str(e))}); "
                              f"fix the messages (roles, their order) or the template{hint}.") from None
        if not text.strip() and not any(isinstance(m.get("content"), str) and m["content"].strip() for m in messages):
            raise FeedError("the messages hold no text, so the prompt is empty; give a message with some content.")
        if not text.strip():
            error = ConfigError if self.given else ArtifactError
            raise error(f"{self.where} rendered these messages as empty text; fix the template (it must write the "
                        "messages) or give another one.")
        return _cut_at_tag(text, final, self.where) if continue_final_message else text

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, context: dict[str, Any],
                fallback: list[dict[str, Any]] | None = None) -> str:
        """The template rendered over ``messages``; where that fails (not over budget), over
        ``fallback`` (a template that tests content against none, and also joins it to text)."""
        try:
            return template_budget.render(self.template, messages=messages, add_generation_prompt=add_generation_prompt,
                                          **context)
        except template_budget.OverBudget:
            raise
        except Exception:
            if fallback is None:
                raise
        return template_budget.render(self.template, messages=fallback, add_generation_prompt=add_generation_prompt,
                                      **context)

    def known_roles(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` in the roles this template knows: OpenAI's ``developer`` messages as the
        system message where it has no developer role (gpt-oss's has), as llama.cpp's server maps
        them. :meth:`render` applies it; a tool format that joins its listing to the system message
        wants it first."""
        if self.knows_developer or not any(isinstance(m, dict) and m.get("role") == "developer" for m in messages):
            return messages
        return _developer_as_system(messages)

    def writes_tool_results(self, tools: bool) -> bool:
        """Whether the template writes a ``tool`` message (the result of a call) into the prompt,
        with or without ``tools`` given, found as llama.cpp's template engine finds it: a
        conversation with a call and its result is rendered and the result looked for (once for
        each). Gemma's refuses the role ("roles must alternate"), Phi-4's drops it."""
        if tools not in self._writes_results:
            self._writes_results[tools] = self._probe_tool_results(tools)
        return self._writes_results[tools]

    def _probe_tool_results(self, tools: bool) -> bool:
        call = {"id": "call00001", "type": "function",  # Mistral's templates take 9-letter ids
                "function": {"name": "probe", "arguments": Arguments({}, "{}")}}
        listed = [{"type": "function", "function": {"name": "probe", "description": "a probe",
                                                    "parameters": {"type": "object", "properties": {}}}}]
        result = {"role": "tool", "tool_call_id": "call00001", "name": "probe", "content": _PROBE}
        for reply in ({"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "assistant", "content": "a"}):
            try:
                text = template_budget.render(self.template, messages=[{"role": "user", "content": "u"}, reply, result],
                                              add_generation_prompt=False, tools=listed if tools else None,
                                              documents=None, **self.special)
            except Exception:  # this probe's shape refused (a call, the role): the next, or none
                continue
            if _PROBE in text:
                return True
        return False

    @classmethod
    def of_artifact(cls, folder: Path, spec: dict[str, Any] | None, override: str | None = None,
                    manifest: Any = None) -> ChatTemplate:
        """The chat template of the artifact in ``folder`` whose manifest tokenizer entry is ``spec``;
        ``override``: a template file's path or a template's text to use instead (the artifact's
        special tokens still fill it). With the artifact's ``manifest``, only the files it lists are
        read, each checked against its sha256 as it is read (a model folder: any file there)."""
        spec = spec or {}
        folder = Path(folder)
        config = folder_json(folder, "tokenizer_config.json", manifest)
        special = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS if k in config}
        special.update({k: spec[k] for k in SPECIAL_TOKENS if isinstance(spec.get(k), str)})
        if override is not None:
            if isinstance(override, Path) or (isinstance(override, str) and os.path.isfile(override)):
                path = Path(override)
                if not path.is_file():
                    raise ConfigError(f"chat template {override} is not a file; give the path of a Jinja template "
                                      "(e.g. chat_template.jinja) or the template's text.")
                return cls(_read(path), special, str(path), given=True)
            if not isinstance(override, str) or "{" not in override:  # no Jinja in it: a path that is not there
                raise ConfigError(f"chat template {str(override)[:80]!r} is not a file; give the path of a Jinja "
                                  "template (e.g. chat_template.jinja) or the template's text.")
            return cls(override, special, "the given chat template", given=True)
        if isinstance(spec.get("chat_template"), str):
            path = safe_path(folder, spec["chat_template"])
            text = _read(path, manifest, folder)
            if text is None:
                raise ArtifactError(f"the manifest names the chat template {spec['chat_template']} but does not list the "
                                    "file with its hash; slimml will not read it: re-convert the model.")
            return cls(text, special, str(path))
        jinja = folder / "chat_template.jinja"
        text = _read(jinja, manifest, folder) if manifest is not None or jinja.is_file() else None
        if text is not None:
            return cls(text, special, str(jinja))
        found = config.get("chat_template")
        where = str(folder / "tokenizer_config.json")
        if isinstance(found, list):
            named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
            if not isinstance(named.get("default"), str):
                raise ArtifactError(f"{where} has chat templates {', '.join(map(str, named))} but none named 'default'; "
                                    "name the one to use 'default'.")
            found = named["default"]
        if isinstance(found, str):
            return cls(found, special, where)
        raise NoChatTemplateError(f"the artifact {folder} has no chat template (chat_template.jinja or "
                                  "tokenizer_config.json's chat_template); give one with model.use_chat_template(PATH), "
                                  "re-convert it from a model folder that has one, or format the prompt yourself and "
                                  "call generate().")


def check_messages(messages: Any, where: str = "") -> None:
    """Refuse anything but a non-empty list of ``{"role": str, "content": ...}`` dicts whose
    content is text or a list of parts (None only beside ``tool_calls``); ``where`` begins each
    message (``"conversation 2, "`` in a batch)."""
    fix = 'pass a list of {"role": ..., "content": ...} dicts, e.g. [{"role": "user", "content": "Hi"}].'
    if not isinstance(messages, (list, tuple)) or not messages:
        raise FeedError(f"{where}messages must be a non-empty list, got {type(messages).__name__}; {fix}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FeedError(f"{where}message {i} is a {type(m).__name__}, not a dict; {fix}")
        if not isinstance(m.get("role"), str):
            raise FeedError(f"{where}message {i} has no string 'role'; {fix}")
        calls = m.get("tool_calls") or m.get("function_call")  # an assistant's calls, new or legacy
        if "content" not in m and not calls:
            raise FeedError(f"{where}message {i} has no 'content'; {fix}")
        content = m.get("content")
        if m["role"] == "tool" and content is not None and not isinstance(content, str):
            continue  # a tool's result: any JSON value (templates write it with tojson)
        if not isinstance(content, (str, list, tuple)) and not (content is None and calls):
            raise FeedError(f"{where}message {i}'s content is {type(content).__name__}, not text; give a string (or a list "
                            'of parts, e.g. [{"type": "text", "text": "Hi"}]).')
        at = surrogate_at(content) if isinstance(content, str) else None
        if at is not None:
            raise FeedError(f"{where}message {i}'s content is not valid Unicode (a lone surrogate at position {at}); "
                            "replace it (decode the text with errors='replace') or remove it.")


def joined_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each content that is a list of text parts only (OpenAI's
    ``[{"type": "text", "text": ...}]``) joined into one string, as ``slimml serve`` joins them: most
    text models' templates add content to strings. Other lists (an image part) stay as they are."""
    def text_only(c: Any) -> bool:
        return isinstance(c, (list, tuple)) and bool(c) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c)

    return [{**m, "content": "".join(p["text"] for p in m["content"])} if m.get("role") != "tool" and
            text_only(m.get("content")) else m for m in messages]


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker at the end of the message to continue


def _tagged(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``messages`` with the marker after the last message's text (its last text block); and that text."""
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, (list, tuple)):
        blocks = [dict(b) if isinstance(b, dict) else b for b in content]
        block = next((b for b in reversed(blocks) if isinstance(b, dict) and isinstance(b.get("text"), str)), None)
        if block is None:
            raise FeedError("continue_final_message needs text in the last message, which has none; add a text block "
                            "or pass continue_final_message=False.")
        final, block["text"] = block["text"], block["text"] + CONTINUE_TAG
        last["content"] = blocks
    elif isinstance(content, str):
        final, last["content"] = content, content + CONTINUE_TAG
    else:
        raise FeedError("continue_final_message needs the last message's content as text; give it a string "
                        "or pass continue_final_message=False.")
    return [*messages[:-1], last], final


def _cut_at_tag(text: str, final: str, where: str) -> str:
    """The rendered ``text`` cut right after the final message's text, as transformers cuts it."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise SlimmlError(f"{where} dropped part of the final message, so it cannot be continued; pass "
                          "continue_final_message=False or fix the template.")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def folder_json(folder: Path, name: str, manifest: Any = None) -> dict[str, Any]:
    """The JSON object in ``folder/name`` (``tokenizer_config.json``, ``generation_config.json``), or {}
    where there is none. With the artifact's ``manifest``: only a file it lists, hash-checked as read."""
    path = Path(folder) / name
    try:
        if manifest is not None:
            data = read_listed(folder, manifest, name)
            if data is None:
                return {}
            config = json.loads(data.decode("utf-8"))
        elif not path.is_file():
            return {}
        else:
            config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ArtifactError(f"could not read {path} ({_line(str(e))}); fix or remove it.") from None
    return config if isinstance(config, dict) else {}


def _read(path: Path, manifest: Any = None, folder: Path | None = None) -> str | None:
    """A chat template file's text; with the artifact's ``manifest``, only a file it lists (None where
    it does not), hash-checked as read."""
    try:
        if manifest is not None:
            data = read_listed(folder, manifest, path.relative_to(folder).as_posix())
            return None if data is None else data.decode("utf-8")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if manifest is None:  # the caller's own file (--chat-template), not the artifact's
            raise ConfigError(f"could not read the chat template {path} ({_line(str(e))}); give a UTF-8 Jinja template "
                              "file.") from None
        raise ArtifactError(f"could not read the chat template {path} ({_line(str(e))}); re-convert the model.") from None


def _token_text(v: Any) -> Any:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    if isinstance(v, list):
        return [_token_text(x) for x in v]
    return v


def _line(text: str) -> str:
    return " ".join(text.split())


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


class Arguments(dict):
    """A tool call's arguments as chat templates read them: an object (``arguments | tojson``,
    ``arguments.items()``: Llama 3.1, Qwen2.5, Mistral) that is also its JSON text where a template
    joins it to text (DeepSeek-R1: ``'```json\n' + arguments``; ``~`` and ``{{ arguments }}``), as
    OpenAI sends it. Given as text, the text is kept as sent."""

    def __init__(self, value: dict, text: str | None = None):
        super().__init__(value)
        self.text = json.dumps(value, ensure_ascii=False, default=str) if text is None else text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other):
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + self.text if isinstance(other, str) else NotImplemented


_PROBE = "slimml-probe-7f3a"  # a tool result's text, looked for in a probe's rendering


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` messages (its newer name for the instructions) as ``system`` ones, for
    a template without a developer role, as llama.cpp's server maps them: one that follows the
    leading system message (Responses' ``instructions``) joins it, for templates that take one
    system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "developer":
            m = {**m, "role": "system"}
        leading = out and all(o.get("role") == "system" for o in out)
        if m["role"] == "system" and leading and isinstance(m.get("content"), str) and isinstance(out[-1].get("content"), str):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def _tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool`` messages as ``user`` ones, for a template that does not write them: each result as
    ``{"tool_response": {"tool", "tool_call_id", "content"}}`` (llama.cpp's polyfill), joined to a user
    turn beside it (templates that want roles to alternate: a reply's results, and the user's next
    words, make one turn)."""
    out, made = [], set()  # made: the indices in out of user turns that hold results
    for m in messages:
        if m.get("role") == "tool":
            result = {k: m[v] for k, v in (("tool", "name"), ("tool_call_id", "tool_call_id")) if isinstance(m.get(v), str)}
            m = {"role": "user", "content": json.dumps({"tool_response": {**result, "content": m.get("content")}},
                                                       ensure_ascii=False, indent=2, default=str)}
            made.add(len(out))
        last = out[-1] if out else None
        if (last is not None and last.get("role") == m.get("role") == "user" and (len(out) - 1 in made or len(out) in made)
                and isinstance(last.get("content"), str) and isinstance(m.get("content"), str)):
            out[-1] = {**last, "content": last["content"] + "\n" + m["content"]}
            made.discard(len(out))
            made.add(len(out) - 1)
        else:
            out.append(m)
    return out


_TESTS_NONE = re.compile(r"(?<![\w])content['\"]?\]?\s*(?:is\s+(?:not\s+)?none\b|[!=]=\s*none\b)",  # not
                         re.IGNORECASE)  # reasoning_content (Qwen3's)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: Jinja's tojson escapes HTML characters, which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)
