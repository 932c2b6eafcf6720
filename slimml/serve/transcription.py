"""OpenAI's ``POST /v1/audio/transcriptions`` for a speech artifact (Whisper): the request's form read
and checked, and the answer in OpenAI's shape.

The request is ``multipart/form-data``, as OpenAI's client sends it (``client.audio.transcriptions
.create(model=..., file=open("speech.wav", "rb"))``): a ``file`` (a PCM WAV recording at the
model's rate; a recording longer than the model's window is read in overlapping windows) and optional ``model``, ``language`` (ISO 639-1),
``temperature`` and ``response_format`` (``json`` or ``text``). A field that would change the
answer in a way this server cannot give (a ``prompt`` to continue, timestamps, a stream) is refused,
never ignored. The form is read with the standard library's MIME parser, so no multipart package is
needed.
"""

from __future__ import annotations

import email.policy
from dataclasses import dataclass, field
from email.parser import BytesParser
from typing import Any

from slimml.errors import RequestError
from slimml.runtime.tasks.limits import shown
from slimml.serve.protocol import check_model

FORMATS = ("json", "text")
# OpenAI's fields this server cannot honour, and what to do instead
_REFUSED = {
    "prompt": "this server does not continue from a previous transcript: leave it out",
    "timestamp_granularities[]": "this server transcribes without timestamps: leave it out",
    "timestamp_granularities": "this server transcribes without timestamps: leave it out",
    "include[]": "this server gives no log-probabilities: leave it out",
    "chunking_strategy": "this server cuts a long recording into overlapping windows itself: leave it out",
    "known_speaker_names[]": "this server does not diarize: leave it out",
}


@dataclass
class TranscriptionRequest:
    """A checked transcription request: the WAV file's bytes and name, its answer's format, and
    ``generate``'s options (``temperature``, ``language``)."""

    audio: bytes
    filename: str
    response_format: str = "json"
    options: dict[str, Any] = field(default_factory=dict)


MAX_FIELDS = 32  # OpenAI's transcription form has a dozen fields; parsing 100,000 small ones took 12 s


def form_fields(body: bytes, content_type: str | None) -> dict[str, tuple[bytes, str | None]]:
    """A ``multipart/form-data`` body's fields: ``{name: (bytes, file name or None)}``.

    Raises:
        RequestError: another content type (415), a body that is not a form, more than
            :data:`MAX_FIELDS` fields (413), or a field sent twice.
    """
    if not content_type or content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise RequestError(f"POST /v1/audio/transcriptions takes multipart/form-data (a \"file\" and the \"model\"), as "
                           f"OpenAI's client sends it, not {shown(content_type or 'no content type')}; send the audio "
                           "as a file field.", 415)
    boundary = next((p.split("=", 1)[1].strip().strip('"') for p in content_type.split(";")[1:]
                     if p.strip().lower().startswith("boundary=")), None)
    if boundary and body.count(b"--" + boundary.encode("latin-1", "replace")) > MAX_FIELDS + 1:
        raise RequestError(f"the form has more than {MAX_FIELDS} fields; a transcription request has a file and a few "
                           "options.", 413)
    try:
        head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n"
        msg = BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
        parts = list(msg.iter_parts()) if msg.is_multipart() else []
        fields: dict[str, tuple[bytes, str | None]] = {}
        for part in parts:
            name = part.get_param("name", header="content-disposition")
            if not isinstance(name, str):
                continue
            if name in fields:
                raise RequestError(f"the form sends the field {shown(name, 40)} twice; send each field once.",
                                   param=name[:40])
            fields[name] = (part.get_payload(decode=True) or b"", part.get_filename())
    except (UnicodeError, ValueError, TypeError, LookupError):
        fields = {}
    if not fields:
        raise RequestError("the request body is not a multipart form with fields (check its boundary); send the audio "
                           'as the "file" field of a multipart/form-data request.')
    return fields


def transcription_request(fields: dict[str, tuple[bytes, str | None]], served: str) -> TranscriptionRequest:
    """The transcription request a form holds, each field checked (one line naming the field and the fix)."""
    text = {k: _text(k, v) for k, (v, _) in fields.items() if k != "file"}  # an option sent as a file part is still read
    for key, fix in _REFUSED.items():
        if text.get(key) not in (None, ""):
            raise RequestError(f'"{key.rstrip("[]")}" is not supported by this server; {fix}.', param=key.rstrip("[]"))
    if text.get("stream") not in (None, "", "false", "False"):
        raise RequestError('"stream" is not supported for transcriptions by this server; leave it out (the answer '
                           "comes whole).", param="stream")
    if text.get("model"):
        check_model({"model": text["model"]}, served)
    if "file" not in fields or not fields["file"][0]:
        raise RequestError('a transcription request needs "file": the recording, as a file field of the form.', param="file")
    audio, filename = fields["file"][0], fields["file"][1] or "audio"
    fmt = text.get("response_format") or "json"
    if fmt not in FORMATS:
        raise RequestError(f'"response_format" {shown(fmt)} is not one this server writes; send "json" or "text" '
                           "(this server gives no timestamps, so no srt, vtt or verbose_json).", param="response_format")
    options: dict[str, Any] = {}
    if text.get("temperature") not in (None, ""):
        try:
            temperature = float(text["temperature"])
        except ValueError:
            temperature = float("nan")
        if not 0.0 <= temperature <= 1.0:
            raise RequestError(f'"temperature" must be a number from 0 to 1 (0: the most likely words), got '
                               f"{shown(text['temperature'])}.", param="temperature")
        options["temperature"] = temperature
    if text.get("language") not in (None, ""):
        options["language"] = text["language"]
    return TranscriptionRequest(audio, filename, fmt, options)


def transcription_response(text: str, seconds: float, fmt: str) -> tuple[Any, str]:
    """The answer in OpenAI's shape and its media type: ``{"text", "usage"}`` (the recording's
    duration, as OpenAI bills whisper-1) as JSON, or the text alone."""
    if fmt == "text":
        return text, "text/plain; charset=utf-8"
    return {"text": text, "usage": {"type": "duration", "seconds": round(seconds, 3)}}, "application/json"


def _text(name: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(f'the form field "{name}" is not UTF-8 text; send it as text.', param=name) from None
