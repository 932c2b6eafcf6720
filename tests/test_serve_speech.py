"""Speech over HTTP: a tiny random Whisper served on 127.0.0.1, transcribed through OpenAI's own
client (``client.audio.transcriptions.create``) as in-process ``generate`` transcribes it; what the
route cannot take refused in one line; a text sent to ``/v1/generate`` never read as a path."""

from __future__ import annotations

import json

import pytest

from conftest import save_tiny_whisper, serving, speech, write_wav

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from slimml.convert import ConvertConfig, convert

    root = tmp_path_factory.mktemp("speech")
    save_tiny_whisper(root / "src")
    convert(root / "src", root / "art", ConvertConfig(measure_latency=False))
    write_wav(root / "speech.wav", speech(2.0))
    write_wav(root / "slow.wav", speech(2.0)[::2], rate=8000)
    write_wav(root / "long.wav", speech(45.0))
    return root


@pytest.fixture(scope="module")
def port(ray_env, whisper):
    from slimml.serve import ServeConfig

    with serving(ServeConfig(str(whisper / "art"), name="whisper")) as port:
        yield port


def _form(port: int, files=None, data=None, path="/v1/audio/transcriptions", **kw):
    return requests.post(f"http://127.0.0.1:{port}{path}", files=files, data=data, timeout=60, **kw)


def test_openai_s_client_transcribes_as_in_process_generate(port, whisper):
    from slimml.runtime import load

    want = load(whisper / "art").generate([str(whisper / "speech.wav")]).texts[0]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    with open(whisper / "speech.wav", "rb") as f:
        got = client.audio.transcriptions.create(model="whisper", file=f)
    assert got.text == want and want
    assert got.usage.type == "duration" and got.usage.seconds == pytest.approx(2.0, abs=1e-3)
    with open(whisper / "speech.wav", "rb") as f:
        assert client.audio.transcriptions.create(model="whisper", file=f, response_format="text").strip() == want
    with open(whisper / "speech.wav", "rb") as f:  # sampled, seeded by nothing: a transcript all the same
        assert isinstance(client.audio.transcriptions.create(model="whisper", file=f, temperature=0.5).text, str)
    with open(whisper / "long.wav", "rb") as f:  # past the 30 s window: transcribed in overlapping windows
        got = client.audio.transcriptions.create(model="whisper", file=f)
    assert got.text == load(whisper / "art").generate([str(whisper / "long.wav")]).texts[0]
    assert got.usage.seconds == pytest.approx(45.0, abs=1e-3)


@pytest.mark.parametrize("what, files, data, status, words, param", [
    ("8 kHz audio", "slow.wav", {}, 400, "sampled at 8000 Hz but the model takes 16000 Hz", "file"),
    ("not a WAV", b"ID3\x03mp3 bytes", {}, 400, "is not a PCM WAV file slimml can read", "file"),
    ("a prompt to continue", "speech.wav", {"prompt": "Earlier:"}, 400, "does not continue from a previous transcript",
     "prompt"),
    ("subtitles", "speech.wav", {"response_format": "srt"}, 400, 'send "json" or "text"', "response_format"),
    ("a hot temperature", "speech.wav", {"temperature": "3"}, 400, "a number from 0 to 1", "temperature"),
    ("a language to a model without any", "speech.wav", {"language": "de"}, 400, "language is not chosen at run time",
     "language"),
    ("another model", "speech.wav", {"model": "gpt-4o-transcribe"}, 404, "not served here", "model"),
    ("no file", None, {"model": "whisper"}, 400, 'needs "file"', "file"),
])
def test_what_the_route_cannot_take_is_one_line(port, whisper, what, files, data, status, words, param):
    if isinstance(files, str):
        files = {"file": (files, (whisper / files).read_bytes(), "audio/wav")}
    elif isinstance(files, bytes):
        files = {"file": ("talk.mp3", files, "audio/mpeg")}
    elif files is None:  # a form without the file
        files = {"other": ("x.txt", b"x", "text/plain")}
    r = _form(port, files, data)
    error = r.json()["error"]
    assert r.status_code == status and words in error["message"] and "\n" not in error["message"], what
    assert error.get("param") == param, what


def test_audio_never_comes_from_a_path_a_client_names(port, whisper):
    """``/v1/generate`` on Whisper read a WAV file at the path the prompt named, on the server, and
    told which files existed ("README.md is not a PCM WAV file", "does not exist")."""
    for prompt in (str(whisper / "speech.wav"), "/nonexistent/secret.wav"):
        r = requests.post(f"http://127.0.0.1:{port}/v1/generate", json={"prompt": prompt}, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "send the audio file to POST /v1/audio/transcriptions" in message
        assert "exist" not in message
    r = _form(port, data=None, json={"file": str(whisper / "speech.wav")})  # JSON instead of a form
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    r = requests.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and "use POST /v1/audio/transcriptions, or POST /v1/run" in r.json()["error"]["message"]
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    assert json.loads(requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).text)["data"][0]["id"] == "whisper"
