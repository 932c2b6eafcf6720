"""The HTTP API's request and response bodies: parsed and checked here, with no web framework.

Every refusal is a :class:`~slimml.errors.RequestError` whose message names the problem and the
fix; the app turns it into a 4xx with ``{"error": {"message", "type", "code"}}`` (OpenAI's shape).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from typing import Any

import numpy as np

from slimml.errors import RequestError
from slimml.runtime.tasks.limits import shown

_DTYPES = {"float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"}


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null")


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON.") from None
    if not text.strip():
        raise RequestError("the request body is empty; send a JSON object.")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: a number of more than 4,300 digits
        why = ("nested too deeply" if isinstance(e, RecursionError) else f"{e.msg} at line {e.lineno} column {e.colno}"
               if isinstance(e, json.JSONDecodeError) else "a number too long to read")
        raise RequestError(f"the request body is not valid JSON ({why}); send a JSON object.") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got a JSON {_json_type(data)}.")
    return data


def check_model(data: dict[str, Any], served: str) -> None:
    """A request that names a model must name the one served here."""
    name = data.get("model")
    if name is not None and not isinstance(name, str):
        raise RequestError(f'"model" must be a string (the served model\'s name, {shown(served)}), got {shown(name)}.',
                           param="model")
    if name is not None and name != served:
        raise RequestError(f"model {shown(name)} is not served here; this server serves {shown(served)} (GET /v1/models).",
                           404, param="model")


# token ids in an embeddings request are most often tiktoken's, which LangChain sends by default: not
# this model's vocabulary, so they are refused rather than embedded as the wrong words
_EMBEDDING_IDS = ("send texts (this server tokenizes them with the model's own tokenizer; LangChain's OpenAIEmbeddings "
                  "sends tiktoken's ids unless made with check_embedding_ctx_length=False)")


def embedding_texts(data: dict[str, Any], max_texts: int, max_chars: int | None = None) -> list[str]:
    """``input`` of an embeddings request: one text or a list of texts, each valid Unicode (checked
    here, per request, so one client's bad text never fails a batch it would share with others),
    cut to ``max_chars``."""
    texts = input_texts(data, "an embeddings", max_texts, max_chars, empty="embeddings need at least one character",
                        on_ids=_EMBEDDING_IDS)
    encoding_format(data)
    return texts


def encoding_format(data: dict[str, Any]) -> str:
    """``encoding_format`` of an embeddings request: "float" (absent or null: the default) or "base64"."""
    fmt = data.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise RequestError(f'"encoding_format" must be "float" or "base64", got {shown(fmt)}.', param="encoding_format")
    return fmt or "float"


def at_most(n: int, most: int, said: str, param: str | None = None) -> None:
    """Refuse (413) a request of more than ``most`` rows (``--max-texts``); ``said`` names what it holds."""
    if n > most:
        raise RequestError(f"{said}, more than this server takes ({most}); send them in smaller requests, or raise the "
                           "limit (slimml serve --max-texts).", 413, param=param)


def input_texts(data: dict[str, Any], request: str, max_texts: int, max_chars: int | None, empty: str | None = None,
                field: str = "input", on_ids: str = "send texts (this server tokenizes them)") -> list[str]:
    """``data[field]``: one text or a list of at most ``max_texts`` texts, each valid Unicode, cut to
    ``max_chars`` (None: kept whole); an empty text refused with ``empty`` where it says why, token
    ids with ``on_ids``."""
    if field not in data:
        raise RequestError(f'{request} request needs "{field}": a text or a list of texts.', param=field)
    texts = data[field]
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list):
        raise RequestError(f'"{field}" must be a text or a list of texts, got a JSON {_json_type(texts)}.', param=field)
    if not texts:
        raise RequestError(f'"{field}" is an empty list; give at least one text.', param=field)
    at_most(len(texts), max_texts, f'"{field}" has {len(texts)} texts', field)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            ids = isinstance(t, list) and bool(t) and all(type(x) is int for x in t)
            what = "token ids" if type(t) is int or ids else f"a JSON {_json_type(t)}"
            raise RequestError(f'"{field}"[{i}] is {what}, not a text; {on_ids}.', param=f"{field}[{i}]")
        if not t and empty is not None:
            raise RequestError(f'"{field}"[{i}] is an empty text; {empty}.', param=f"{field}[{i}]")
    return checked_texts(texts, f'"{field}"', max_chars)


def entities_request(data: dict[str, Any], max_texts: int, max_chars: int | None) -> tuple[list[str], dict[str, Any]]:
    """``(texts, options)`` of an entities request: ``input`` (texts, cut to ``max_chars`` unless
    ``stride`` asks for them whole), ``aggregation``, ``ignore_labels``, ``stride``."""
    if data.get("aggregation_strategy") is not None:  # the Hugging Face pipeline's name for it
        raise RequestError('"aggregation_strategy" is the Hugging Face pipeline\'s name; this route\'s field is '
                           '"aggregation" (the same values): send "aggregation" instead.', param="aggregation_strategy")
    options = {k: data[k] for k in ENTITY_OPTIONS if data.get(k) is not None}
    texts = input_texts(data, "an entities", max_texts, None if "stride" in options else max_chars)
    return texts, options


def classify_request(data: dict[str, Any], max_texts: int, max_chars: int | None) -> tuple[list[Any], int | None]:
    """``(texts, top_k)`` of a classify request: ``input`` (a text or a list, cut to ``max_chars``;
    or a list of text pairs ``[[premise, hypothesis], ...]``, read together as ``model.classify``
    reads pairs) and ``top_k`` (the best classes of each text; absent or null: every class)."""
    refuse_candidate_labels(data)
    items = data.get("input")
    if isinstance(items, list) and items and all(isinstance(p, list) and len(p) == 2 for p in items):
        at_most(len(items), max_texts, f'"input" has {len(items)} pairs', "input")
        for i, pair in enumerate(items):
            if not all(isinstance(t, str) and t for t in pair):
                raise RequestError(f'"input"[{i}] must be two non-empty texts (a pair read together), or give texts '
                                   "alone.", param=f"input[{i}]")
        texts: list[Any] = [tuple(checked_texts(pair, f'"input"[{i}]', max_chars, param=f"input[{i}]"))
                            for i, pair in enumerate(items)]
    else:
        texts = input_texts(data, "a classify", max_texts, max_chars, empty="a text to classify needs at least one character")
    return texts, classify_top_k(data)


def refuse_candidate_labels(data: dict[str, Any]) -> None:
    """Refuse zero-shot's fields (ours, Hugging Face's) sent to a classifier, whose labels are its own."""
    for key in ("labels", "candidate_labels"):
        if data.get(key) is not None:
            raise RequestError(f'"{key}" names candidate labels for zero-shot classification; this classifier scores its '
                               f'own labels: leave "{key}" out.', param=key)


def classify_top_k(data: dict[str, Any]) -> int | None:
    """``top_k`` of a classify request: the best classes of each input (absent or null: every class)."""
    top_k = data.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise RequestError(f'"top_k" must be a whole number >= 1 (or null for every class), got {json.dumps(top_k)[:40]}.',
                           param="top_k")
    return top_k


# the request fields the entities and answer routes pass to the model as they came (model.entities',
# model.answer's options): a refusal from the model that starts with one's name is about that field
ENTITY_OPTIONS = ("aggregation", "ignore_labels", "stride")
ANSWER_OPTIONS = ("top_k", "doc_stride", "max_answer_len", "max_seq_len", "handle_impossible_answer", "align_to_words")

MAX_ANSWERS = 100  # answers a question one request may ask for (each window offers up to its tokens squared)


def answer_request(data: dict[str, Any], max_texts: int) -> tuple[Any, Any, dict[str, Any]]:
    """``(question, context, options)`` of an answer request: a question and a context (or lists of
    them, as many of each, or one of either for each of the other), read whole; the pipeline's options."""
    found = [input_texts(data, "an answer", max_texts, None, empty="ask a question of a text", field=k)
             for k in ("question", "context")]
    for name in ("handle_impossible_answer", "align_to_words"):
        if data.get(name) is not None and not isinstance(data[name], bool):
            raise RequestError(f'"{name}" must be true or false, got a JSON {_json_type(data[name])}.', param=name)
    top_k = data.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > MAX_ANSWERS:
        raise RequestError(f'"top_k" must be at most {MAX_ANSWERS} answers a question, got {top_k}; ask for fewer.',
                           param="top_k")
    options = {k: data[k] for k in ANSWER_OPTIONS if data.get(k) is not None}
    question, context = (texts[0] if isinstance(data[k], str) else texts for texts, k in zip(found, ("question", "context")))
    if isinstance(question, list) and isinstance(context, list) and len(question) != len(context):
        raise RequestError(f"give one context a question: got {len(question)} questions and {len(context)} contexts (or "
                           "one question for all the contexts, or one context for all the questions).", param="context")
    return question, context, options


def spans_response(found: list[list[dict[str, Any]]], key: str, name: str) -> dict[str, Any]:
    """Each input's spans (``key``: ``entities``, ``answers``, or a classifier's ``labels``), in request order."""
    return {"object": "list", "model": name, "data": [{"index": i, key: spans} for i, spans in enumerate(found)]}


def prompt_name(data: dict[str, Any]) -> str | None:
    """``prompt_name`` of an embeddings request (as Hugging Face's text-embeddings-inference takes
    it): one of the model's sentence-transformers prompts, put before each text."""
    name = data.get("prompt_name")
    if name is not None and not isinstance(name, str):
        raise RequestError(f'"prompt_name" must be the name of one of the model\'s prompts, got a JSON {_json_type(name)}.',
                           param="prompt_name")
    return name


def dimensions(data: dict[str, Any], size: int | None = None) -> int | None:
    """``dimensions`` of an embeddings request (OpenAI's field), checked before any work against
    the model's embedding ``size`` where it is known."""
    n = data.get("dimensions")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise RequestError(f'"dimensions" must be a whole number from 1 to the model\'s size, got {shown(n)}; leave it out '
                           "for all of them.", param="dimensions")
    if n is not None and size is not None and n > size:
        raise RequestError(f'"dimensions" is {n}, more than this model\'s {size}; ask for at most {size}, or leave it out.',
                           param="dimensions")
    return n


def shortened(emb: np.ndarray, n: int | None, normalized: bool) -> np.ndarray:
    """``emb`` cut to ``n`` dimensions (the first values of each vector, as a Matryoshka-trained
    model is read), made unit-length again where the model's embeddings are; None, or every
    dimension: as they are (as the model gives them, a saved cut's included)."""
    if n is None or n == emb.shape[1]:
        return emb
    if n > emb.shape[1]:
        raise RequestError(f'"dimensions" is {n}, more than this model\'s {emb.shape[1]}; ask for at most '
                           f"{emb.shape[1]}, or leave it out.", param="dimensions")
    cut = emb[:, :n]
    return cut / np.clip(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12, None) if normalized else cut


def checked_texts(texts: list[str], field: str, max_chars: int | None, param: str | None = None,
                  single: bool = False) -> list[str]:
    """``texts`` cut to ``max_chars`` each, refusing one that is not valid Unicode (a lone
    surrogate such as ``"\\ud800"`` is valid JSON but no text a tokenizer takes); ``single``: the
    field is one text, named without an index."""
    out = []
    for i, t in enumerate(texts):
        if max_chars is not None and len(t) > max_chars:
            t = t[:max_chars]
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            where = field if single else f"{field}[{i}]"
            name = param or field.strip('"')
            raise RequestError(f"{where} is not valid Unicode ({e.reason} at position {e.start}); send "
                               "UTF-8 text (decode your input with errors='replace' or clean it first).",
                               param=name if single else f"{name}[{i}]") from None
        out.append(t)
    return out


def embeddings_response(emb: np.ndarray, name: str, tokens: int, fmt: str = "float") -> dict[str, Any]:
    """The response body; float embeddings stay numpy rows, for :func:`dumps` to write fast."""
    def encoded(row: np.ndarray):
        if fmt == "base64":
            return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        return row

    return {"object": "list", "model": name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(row)} for i, row in enumerate(emb)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_request(data: dict[str, Any], max_texts: int, max_chars: int | None = None
                   ) -> tuple[str, list[str], int | None, list[str] | None]:
    """``(query, documents, top_n, returned)`` of a rerank request: documents as texts or
    ``{"text": ...}`` objects, each valid Unicode and cut to ``max_chars`` for the model;
    ``returned``: the documents as sent, for the answer (None where ``return_documents`` is false)."""
    query = data.get("query")
    if not isinstance(query, str) or not query:
        raise RequestError('a rerank request needs "query": a non-empty text.', param="query")
    docs = data.get("documents")
    if not isinstance(docs, list) or not docs:
        raise RequestError('a rerank request needs "documents": a non-empty list of texts.', param="documents")
    at_most(len(docs), max_texts, f'"documents" has {len(docs)} texts', "documents")
    sent = []
    for i, d in enumerate(docs):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str) or not text:
            got = "an empty text" if text == "" else f"a JSON {_json_type(d)}"
            raise RequestError(f'"documents"[{i}] must be a non-empty text (or {{"text": "..."}}), got {got}.',
                               param=f"documents[{i}]")
        sent.append(text)
    (query,) = checked_texts([query], '"query"', max_chars, param="query", single=True)
    texts = checked_texts(sent, '"documents"', max_chars, param="documents")
    top_n = data.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise RequestError(f'"top_n" must be a whole number >= 1, got {shown(top_n)}; leave it out for every document.',
                           param="top_n")
    keep = data.get("return_documents")
    keep = True if keep is None else keep  # as vLLM's and Jina's: the documents come back unless asked not to
    if not isinstance(keep, bool):
        raise RequestError(f'"return_documents" must be true or false, got a JSON {_json_type(keep)}.', param="return_documents")
    return query, texts, top_n, sent if keep else None  # the documents come back as sent, not as cut for the model


def rerank_response(ranked: list[dict[str, Any]], documents: list[str] | None, name: str, tokens: int) -> dict[str, Any]:
    """Jina's and Cohere's (and vLLM's) rerank body: results best first, each its ``index`` in the
    request, ``relevance_score`` and, where asked, the ``document``."""
    results = [{"index": r["index"], "relevance_score": r["score"],
                **({"document": {"text": documents[r["index"]]}} if documents is not None else {})} for r in ranked]
    return {"object": "list", "model": name, "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def run_inputs(data: dict[str, Any]) -> tuple[dict[str, np.ndarray], list[str] | None, str]:
    """``inputs`` of a run request: name -> ``{"dtype", "data"}`` (nested lists) or ``{"npy": base64}``."""
    inputs = data.get("inputs")
    if not isinstance(inputs, dict) or not inputs:
        raise RequestError('a run request needs "inputs": an object of name -> {"dtype": ..., "data": nested lists} '
                           'or {"npy": base64 of a .npy file}.', param="inputs")
    feeds = {}
    for name, spec in inputs.items():
        try:
            feeds[name] = _array(name, spec)
        except RequestError as e:
            e.param = e.param or f"inputs.{name}"[:80]
            raise
    outputs = data.get("outputs")
    if outputs is not None and (not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs)):
        raise RequestError('"outputs" must be a list of output names (at least one; leave it out for every output).',
                           param="outputs")
    encoding = data.get("encoding", "json")
    if encoding not in ("json", "npy"):
        raise RequestError(f'"encoding" must be "json" or "npy", got {shown(encoding)}.', param="encoding")
    return feeds, outputs, encoding


def _array(name: str, spec: Any) -> np.ndarray:
    if not isinstance(spec, dict):
        raise RequestError(f'input {shown(name)} must be an object {{"dtype": ..., "data": ...}} or {{"npy": ...}}.')
    if "npy" in spec:
        try:
            raw = base64.b64decode(spec["npy"], validate=True)
        except (binascii.Error, TypeError):
            raise RequestError(f'input {shown(name)}: "npy" is not valid base64; send the .npy file\'s bytes in standard '
                               "base64 (base64.b64encode), no line breaks.") from None
        return _npy(name, raw)
    dtype = spec.get("dtype")
    if dtype not in _DTYPES:
        raise RequestError(f"input {shown(name)}: dtype {shown(dtype)} is not one of {sorted(_DTYPES)}; give one of them.")
    if "data" not in spec:
        raise RequestError(f'input {shown(name)} needs "data": nested lists of numbers.')
    try:
        arr = np.asarray(spec["data"], dtype=dtype)
        if arr.dtype.kind in "iu":  # numpy casts 1.5 to 1 and true to 1: whole numbers only, as sent
            sent = np.asarray(spec["data"])
            fraction = sent.dtype.kind == "f" and not np.array_equal(sent, arr)
            if fraction or _holds_bool(spec["data"]):
                what = "numbers with a fraction" if fraction else "true/false"
                raise RequestError(f"input {shown(name)}: {dtype} data holds {what}; send whole numbers.")
    except (ValueError, TypeError, OverflowError) as e:
        why = "a number out of its range" if isinstance(e, OverflowError) or "out of bounds" in str(e) else (
            "rows of different lengths" if "inhomogeneous" in str(e) or "sequence" in str(e) else "values that are not numbers")
        raise RequestError(f"input {shown(name)}: data is not a rectangular array of {dtype} numbers (it holds {why}); "
                           "send nested lists of equal lengths, numbers only.") from None
    return arr


def _npy(name: str, raw: bytes) -> np.ndarray:
    """A .npy file's array, its header read first: a shape larger than the bytes sent (numpy would
    allocate it before finding the data short) or an object dtype is refused before anything is made."""
    f = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f".npy version {version[0]}.{version[1]}; numpy.save writes 1.0")
        shape, _, dtype = read(f)
        if any(d < 0 for d in shape):
            raise ValueError(f"a negative dimension in shape {list(shape)}")
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise RequestError(f'input {shown(name)}: "npy" is not a .npy array file ({why}); write it with numpy.save.') from None
    if dtype.hasobject:
        raise RequestError(f"input {shown(name)}: the .npy file holds Python objects (dtype {dtype}); send a numeric array.")
    size = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if size != len(raw) - f.tell():
        raise RequestError(f"input {shown(name)}: the .npy header says shape {list(shape)} of {dtype} ({size:,} bytes) but "
                           f"{len(raw) - f.tell():,} bytes of data follow; write the array with numpy.save.")
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise RequestError(f'input {shown(name)}: "npy" is not a .npy array file ({e}); write it with numpy.save.') from None


def _holds_bool(data: Any) -> bool:
    """Whether JSON ``data`` (nested lists) holds a true or false anywhere (numpy reads a mix of
    booleans and numbers as numbers)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if type(item) is bool:
            return True
        if isinstance(item, list):
            stack.extend(item)
    return False


def run_response(out: dict[str, np.ndarray], encoding: str) -> dict[str, Any]:
    if encoding == "npy":
        def npy(a: np.ndarray) -> str:
            buf = io.BytesIO()
            np.save(buf, a, allow_pickle=False)
            return base64.b64encode(buf.getvalue()).decode("ascii")

        return {"outputs": {k: {"npy": npy(v)} for k, v in out.items()}}
    return {"outputs": {k: {"dtype": str(v.dtype), "shape": list(v.shape), "data": _jsonable(v)} for k, v in out.items()}}


def _jsonable(a: np.ndarray):
    """An array :func:`dumps` writes natively (C-ordered; float16 widened), else nested lists."""
    if a.dtype == np.float16:
        a = a.astype(np.float32)
    if a.dtype.kind in "fiub" and a.ndim:
        return np.ascontiguousarray(a)
    return a.tolist()


# an encoder-decoder's generate options, which POST /v1/generate passes on as sent (checked by the model)
SEQ2SEQ_OPTIONS = ("num_beams", "length_penalty", "no_repeat_ngram_size", "temperature", "top_k", "top_p", "seed",
                   "do_sample")
# a language model's beam search, which the server's routes do not run (they decode token by token, as vLLM's)
BEAM_FIELDS = ("num_beams", "length_penalty", "early_stopping", "use_beam_search")
BEAM_SEARCH_HERE = ("beam search runs in process (model.generate(prompts, num_beams=4)) and on the command line "
                    "(slimml generate --num-beams 4)")
# how clients ask for a search other than greedy: refused where the route cannot give it, never ignored
_SEARCH_FIELDS = SEQ2SEQ_OPTIONS + ("stop", "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty",
                                    "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "early_stopping", "logit_bias", "n",
                                    "best_of", "stream", "logprobs", "response_format")


def generate_request(data: dict[str, Any], max_new_tokens: int, max_texts: int, max_chars: int | None = None,
                     vocab_size: int | None = None, options: tuple[str, ...] = (), staged: bool = False
                     ) -> tuple[list, int, dict[str, Any]]:
    """``prompt`` (a text, texts, or token id lists), ``max_new_tokens`` and the model's ``options``
    of a generate request: texts valid Unicode and cut to ``max_chars``, ids inside ``[0,
    vocab_size)``; a search field the model does not take refused. The model's positions and the
    token budget are checked by ``generate`` itself, before any pass. ``staged``: the model runs in
    pipeline stages, which serve nothing else to point to."""
    asked = next((k for k in _SEARCH_FIELDS if data.get(k) is not None and k not in options), None)
    if asked is not None:
        own = "POST /v1/generate decodes greedily"
        beams = asked in BEAM_FIELDS and not staged
        fix = (f"this encoder-decoder's options are {', '.join(options)}" if options else
               f"{own}, and no route of this server runs a beam search: {BEAM_SEARCH_HERE}" if beams else
               f"{own}; this server runs the model in pipeline stages, which serve nothing else: serve it without "
               "--stages for sampling, stop strings and penalties (POST /v1/completions)" if staged else
               f"{own}: send sampling, stop strings and penalties to POST /v1/completions or POST /v1/chat/completions")
        raise RequestError(f'"{asked}" is not an option of POST /v1/generate here; {fix}.', param=asked)
    prompt = data.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts:
        raise RequestError('a generate request needs "prompt": a text, a list of texts, or a list of token id lists.')
    at_most(len(prompts), max_texts, f"{len(prompts)} prompts")
    texts = all(isinstance(p, str) and p for p in prompts)
    ids = all(isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) for i in p) for p in prompts)
    if not texts and not ids:
        raise RequestError(_prompt_fault(prompts), param="prompt")
    n = data.get("max_new_tokens", 16)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_new_tokens:
        shown = repr(n) if len(repr(n)) <= 40 else repr(n)[:40] + "..."
        raise RequestError(f'"max_new_tokens" must be a whole number from 1 to {max_new_tokens}, got {shown} '
                           "(slimml serve --max-new-tokens raises the limit).")
    chosen = {k: data[k] for k in options if data.get(k) is not None}
    if texts:
        return checked_texts(prompts, '"prompt"', max_chars), n, chosen
    top = vocab_size or 1 << 63
    for i, p in enumerate(prompts):
        bad = next((t for t in p if not 0 <= t < top), None)
        if bad is not None:
            shown = str(bad) if len(str(bad)) <= 24 else str(bad)[:24] + "..."
            raise RequestError(f'"prompt"[{i}] holds the token id {shown}, outside this model\'s vocabulary '
                               f"[0, {top}); send ids from 0 to {top - 1}.", param="prompt")
    return prompts, n, chosen


def _prompt_fault(prompts: list) -> str:
    """What is wrong with a generate request's ``prompt`` list that is neither all texts nor all id lists."""
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return '"prompt" is one list of token ids; send it as [[1, 2, 3]] (a list of id lists is a batch).'
    for i, p in enumerate(prompts):
        if p == "" or p == []:
            return f'"prompt"[{i}] is empty; give each prompt some text or token ids.'
        if isinstance(p, list):
            bad = next((t for t in p if not isinstance(t, int) or isinstance(t, bool)), None)
            if bad is not None:
                return f'"prompt"[{i}] holds {shown(bad, 24)}; token ids are whole numbers >= 0.'
        elif not isinstance(p, str):
            return f'"prompt"[{i}] is a JSON {_json_type(p)}; send texts, or lists of token ids.'
    return '"prompt" mixes texts and token id lists; send one kind in a request.'


def check_run_budget(feeds: dict[str, np.ndarray], specs, max_seq: int | None, max_rows: int,
                     max_batch_tokens: int, outputs=(), wanted: list[str] | None = None,
                     max_values: int | None = None) -> None:
    """Refuse a run request too big for one pass, before the model sees it: more rows than
    ``max_rows``, a sequence longer than the model's positions, rows x tokens over
    ``max_batch_tokens`` (attention grows with the square of the sequence, activations with both),
    or outputs (``wanted`` of the ``outputs`` specs, all by default) of more than ``max_values``
    values (a decoder's logits are rows x tokens x vocabulary, and JSON writes each in ~10 bytes).

    ``specs``: the model's input specs; an axis named like a sequence length counts tokens.
    """
    from slimml.runtime.engine.feeds import counts_tokens

    by_name = {s.name: s for s in specs}
    rows, tokens = 0, 0
    for name, arr in feeds.items():
        if arr.ndim:
            rows = max(rows, arr.shape[0])
        spec = by_name.get(name)
        if spec is None or len(spec.shape) != arr.ndim:
            continue  # the model's own check names it
        for d, axis in enumerate(spec.shape):
            if isinstance(axis, str) and counts_tokens(axis):
                tokens = max(tokens, arr.shape[d])
    at_most(rows, max_rows, f"the inputs hold {rows} rows")
    if max_seq is not None and tokens > max_seq:
        raise RequestError(f"the inputs hold sequences of {tokens} tokens, but this model takes at most {max_seq}; "
                           f"truncate them to {max_seq}.")
    if rows * tokens > max_batch_tokens:
        raise RequestError(f"the inputs hold {rows} rows x {tokens} tokens = {rows * tokens}, more than this server "
                           f"takes in one request ({max_batch_tokens}); send fewer rows a request, or raise the limit "
                           "(slimml serve --max-batch-tokens).", 413)
    if max_values is None:
        return
    values = 0
    for spec in outputs:
        if wanted is not None and spec.name not in wanted:
            continue
        n = 1
        for d, axis in enumerate(spec.shape):
            n *= axis if isinstance(axis, int) else tokens if counts_tokens(axis) else rows if d == 0 else 1
        values += n
    if values > max_values:
        raise RequestError(f"the outputs of these inputs would hold about {values} values, more than this server "
                           f"returns in one response ({max_values}); send fewer rows or tokens a request, name only the "
                           'outputs you need in "outputs", or raise the limit (slimml serve --max-response-values).', 413)


def generate_response(gen, name: str) -> dict[str, Any]:
    choices = []
    for i, toks in enumerate(gen.tokens):  # each as generate ended it (an end id on the last token allowed: a stop)
        choices.append({"index": i, "text": gen.texts[i] if gen.texts else None, "token_ids": toks,
                        "finish_reason": gen.finish_reasons[i]})
    new = sum(len(t) for t in gen.tokens)
    return {"object": "text_completion", "model": name, "choices": choices,
            "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": new,
                      "total_tokens": gen.prompt_tokens + new}}


def dumps(body: dict[str, Any]) -> bytes:
    """JSON bytes of a response, numpy arrays included (orjson: float32 in shortest form)."""
    import orjson

    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


_ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error"}  # as llama.cpp's server types them


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (``message``, ``type``, ``param``: the field at fault or null,
    ``code``: the HTTP status), the message with server paths and node addresses taken out (the
    server logs them; a client has no use for them, an attacker some)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": public(message), "type": kind, "param": param, "code": status}}


# an absolute path (or one under ~), and an IPv4 address with or without a port
_PATH = re.compile(r"(?<![\w.:/])(?:~|/(?=[^\s/]))[^\s'\"(),;:]*")
_ROUTE = re.compile(r"/(?:v1/[\w/.{}-]*[\w}-]|health)\.?$")  # this API's own endpoints, which messages name on purpose
_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b")


def public(message: str) -> str:
    """``message`` without server paths (each becomes its last part) or node addresses. A server
    path starts at ``~`` or at a folder this machine has (``/tmp``, ``/home``...); a client's own
    text that only looks like a path (a stop string ``/end``, a role ``/admin``) stays as sent."""
    message = _PATH.sub(lambda m: m.group(0) if _ROUTE.match(m.group(0)) or not _on_this_machine(m.group(0)) else
                        m.group(0).rstrip("/.").rsplit("/", 1)[-1] or "<path>", message)
    return _ADDRESS.sub("<address>", message)


def _on_this_machine(path: str) -> bool:
    """``path`` is under the home folder, or under a top-level folder that exists here."""
    top = path.lstrip("/").split("/", 1)[0]
    return path.startswith("~") or not top or os.path.isdir("/" + top)
