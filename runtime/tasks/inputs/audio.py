"""Audio in, log-mel features out: WAV reading and Whisper's feature extractor in numpy.

``log_mel`` follows transformers' ``WhisperFeatureExtractor`` (its numpy path): pad or cut to
``n_samples`` (30 s), a centred STFT with a periodic Hann window, the power spectrum through a
Slaney mel filter bank, ``log10``, a floor 8 below the maximum, then ``(x + 4) / 4``. Settings come
from the ``preprocessor_config.json`` shipped in the artifact; the result matches transformers'
to 1e-4 with neither torch nor transformers installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from slimml.errors import ArtifactError, FeedError
from slimml.runtime.artifact.files import read_config


class LogMel:
    """Whisper-style log-mel features: (n_mels, frames) float32 per 16 kHz mono waveform."""

    def __init__(self, config: dict[str, Any], where: str = "preprocessor_config.json"):
        try:
            self.n_mels = int(config.get("feature_size", 80))
            self.sampling_rate = int(config.get("sampling_rate", 16000))
            self.hop_length = int(config.get("hop_length", 160))
            self.n_fft = int(config.get("n_fft", 400))
            self.n_samples = int(config.get("n_samples", 480000))
            self.padding_value = float(config.get("padding_value", 0.0))
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{where}: {e}; re-convert the model.") from None
        if min(self.n_mels, self.sampling_rate, self.hop_length, self.n_fft, self.n_samples) <= 0:
            raise ArtifactError(f"{where}: feature sizes must be positive; re-convert the model.")
        self.filters = mel_filters(1 + self.n_fft // 2, self.n_mels, self.sampling_rate)
        self.window = np.hanning(self.n_fft + 1)[:-1]  # periodic Hann

    @classmethod
    def from_file(cls, path: Path) -> LogMel:
        return cls(read_config(path, "feature extractor config"), path.name)

    def __call__(self, waveform: np.ndarray) -> np.ndarray:
        audio = np.full(self.n_samples, self.padding_value, dtype=np.float64)
        clip = np.asarray(waveform, dtype=np.float32)[: self.n_samples]
        audio[: clip.size] = clip
        half = self.n_fft // 2
        padded = np.pad(audio, (half, half), mode="reflect")
        frames = 1 + (padded.size - self.n_fft) // self.hop_length
        index = np.arange(self.n_fft)[None, :] + self.hop_length * np.arange(frames)[:, None]
        spectrum = np.fft.rfft(padded[index] * self.window, axis=1).astype(np.complex64)  # as transformers keeps it
        power = np.abs(spectrum, dtype=np.float64) ** 2
        mel = np.log10(np.maximum(1e-10, self.filters.T @ power.T))[:, :-1]  # the last frame is dropped
        mel = np.maximum(mel, mel.max() - 8.0)
        return ((mel + 4.0) / 4.0).astype(np.float32)


def mel_filters(bins: int, n_mels: int, sampling_rate: int, fmin: float = 0.0, fmax: float = 8000.0) -> np.ndarray:
    """(bins, n_mels) triangular filters on the Slaney mel scale, Slaney-normalised."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fft_freqs = np.linspace(0, sampling_rate // 2, bins)
    slopes = edges[None, :] - fft_freqs[:, None]
    diff = np.diff(edges)
    filters = np.maximum(0.0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))
    return filters * (2.0 / (edges[2:n_mels + 2] - edges[:n_mels]))[None, :]


def _hz_to_mel(freq):
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    return np.where(freq >= 1000.0, 15.0 + np.log(np.maximum(freq, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mels)


def _mel_to_hz(mels):
    mels = np.asarray(mels, dtype=np.float64)
    freq = 200.0 * mels / 3.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels - 15.0)), freq)


def read_wav(path: str | os.PathLike, rate: int = 16000) -> np.ndarray:
    """A WAV file (8-, 16-, 24- or 32-bit PCM, or 32- or 64-bit float; plain or WAVE_FORMAT_EXTENSIBLE
    headers, as ffmpeg writes for 24-bit and multichannel audio) as float32 mono samples in [-1, 1],
    at ``rate`` Hz (else refused with the fix)."""
    path = Path(path)
    if not path.is_file():
        raise FeedError(f"audio file {path} does not exist; check the path.")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FeedError(f"could not read the audio file {path} ({e.strerror or e}); check its permissions.") from None
    return _decode_wav(data, str(path), path.name, rate)


def wav_from_bytes(data: bytes, name: str, rate: int = 16000) -> np.ndarray:
    """:func:`read_wav` of a WAV file's bytes (an upload; ``name``, its file name, names it in a refusal)."""
    name = name if len(name) <= 60 and name.isprintable() else "the upload"  # a client's text, quoted back
    return _decode_wav(data, name, name, rate)


_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE  # WAVE format tags


def _chunks(data: bytes) -> dict[bytes, tuple[int, int]]:
    """The RIFF WAVE file's chunks: id -> (offset, size) of the first of each id; a data chunk whose
    size runs past the file keeps its size (the truncation is said where the frames are counted)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("no RIFF WAVE header" if data[:4] != b"RIFF" else "not a WAVE file")
    found: dict[bytes, tuple[int, int]] = {}
    at = 12
    while at + 8 <= len(data):
        cid, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        found.setdefault(cid, (at + 8, size))
        if cid == b"data":
            break  # what follows the samples is not read
        nxt = at + 8 + size
        # chunks are padded to an even size; some writers leave an odd one unpadded (the next id starts at once)
        at = nxt if size & 1 and not _chunk_id(data[nxt + 1:nxt + 5]) and _chunk_id(data[nxt:nxt + 4]) else nxt + (size & 1)
    if b"fmt " not in found:
        raise ValueError("no fmt chunk")
    if b"data" not in found:
        raise ValueError("it ends before its audio data: truncated" if at > len(data) else "no data chunk")
    return found


def _chunk_id(four: bytes) -> bool:
    """Whether ``four`` bytes read as a RIFF chunk id (printable ASCII)."""
    return len(four) == 4 and all(32 <= b < 127 for b in four)


def _decode_wav(data: bytes, said: str, name: str, rate: int) -> np.ndarray:
    fix = f"convert it with `ffmpeg -i {name} -ar {rate} -ac 1 -c:a pcm_s16le out.wav`"
    try:
        chunks = _chunks(data)
        at, size = chunks[b"fmt "]
        fmt = data[at:at + size]
        if len(fmt) < 16:
            raise ValueError("its fmt chunk is cut short")
        tag, channels, file_rate = int.from_bytes(fmt[0:2], "little"), int.from_bytes(fmt[2:4], "little"), \
            int.from_bytes(fmt[4:8], "little")
        align, bits = int.from_bytes(fmt[12:14], "little"), int.from_bytes(fmt[14:16], "little")
        if tag == _EXTENSIBLE:  # the real format is the sub-format GUID's first two bytes
            if len(fmt) < 40:
                raise ValueError("its extensible fmt chunk is cut short")
            tag = int.from_bytes(fmt[24:26], "little")
        if tag not in (_PCM, _FLOAT):
            raise ValueError(f"format {tag} is neither PCM nor float")
        if channels < 1:
            raise ValueError("its header says 0 channels")
    except ValueError as e:
        raise FeedError(f"{said} is not a PCM WAV file slimml can read ({e}); {fix}.") from None
    width = (bits + 7) // 8
    if (tag == _PCM and width not in (1, 2, 3, 4)) or (tag == _FLOAT and width not in (4, 8)):
        kind = "PCM" if tag == _PCM else "float"
        raise FeedError(f"{said} has {bits}-bit {kind} samples, which slimml does not read (8, 16, 24 or 32-bit PCM, "
                        f"or 32 or 64-bit float); {fix}.")
    frame = channels * width
    if align != frame:  # the samples' layout is not what the header's sizes say: read as it says, noise
        raise FeedError(f"{said}'s header says frames of {align} bytes, but {channels} channel(s) of {bits}-bit samples "
                        f"make {frame}; the header is damaged: re-export it ({fix}).")
    at, size = chunks[b"data"]
    if size in (0, 0xFFFFFFFF) and len(data) > at:  # written by a stream that could not go back to fill it in
        size = len(data) - at
    raw = data[at:at + size]
    if raw and len(raw) < frame:
        raise FeedError(f"{said}'s header says {channels} channels of {width} bytes, more than its data holds; the "
                        "header is damaged: re-export it.")
    if len(raw) < size:
        raise FeedError(f"{said} is truncated: its header promises {size // frame} frames but the file holds fewer; "
                        "re-export it.")
    if file_rate != rate:
        raise FeedError(
            f"{said} is sampled at {file_rate} Hz but the model takes {rate} Hz; resample it first, e.g. "
            f"`ffmpeg -i {name} -ar {rate} -ac 1 out.wav`."
        )
    raw = raw[: len(raw) - len(raw) % frame]
    if tag == _FLOAT:
        samples = np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8").astype(np.float32)
        if not np.isfinite(samples).all():
            raise FeedError(f"{said} holds NaN or infinite samples; re-export it.")
    elif width == 1:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = (np.where(value >= 1 << 23, value - (1 << 24), value)).astype(np.float32) / float(1 << 23)
    else:
        samples = np.frombuffer(raw, dtype="<i4").astype(np.float32) / float(1 << 31)
    if samples.size == 0:
        raise FeedError(f"{said} holds no audio; give a recording of at least a few samples.")
    return samples.reshape(-1, channels).mean(axis=1) if channels > 1 else samples


def read_audio(extractor: LogMel, audio: Any) -> list[np.ndarray]:
    """WAV paths or float waveforms at the extractor's rate (one, or a list) as 1-D float waveforms."""
    if isinstance(audio, (str, os.PathLike, np.ndarray)):
        audio = [audio]
    if not isinstance(audio, (list, tuple)) or not audio:
        raise FeedError("give audio as a list of WAV paths or 16 kHz float waveforms (at least one).")
    waves = []
    for i, a in enumerate(audio):
        if isinstance(a, (str, os.PathLike)):
            waves.append(read_wav(a, extractor.sampling_rate))
        elif isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind == "f" and a.size:
            waves.append(a)
        else:
            raise FeedError(f"audio {i} is a {type(a).__name__}; give a WAV path or a 1-D float waveform at "
                            f"{extractor.sampling_rate} Hz.")
    return waves


def features_for(extractor: LogMel, input_name: str, audio: Any) -> dict[str, np.ndarray]:
    """``{input_name: (B, n_mels, frames)}`` for WAV paths or 16 kHz float waveforms, each within one
    window (``generate`` cuts a longer recording itself: ``runtime/tasks/long_form.py``)."""
    waves = read_audio(extractor, audio)
    for i, w in enumerate(waves):
        if w.size > extractor.n_samples:  # the window would cut it: the rest never transcribed
            rate = extractor.sampling_rate
            raise FeedError(f"audio {i} is {w.size / rate:.3f} s, longer than the {extractor.n_samples / rate:g} s "
                            "this model reads in one window (the rest would be lost); split it into parts of at most "
                            f"{extractor.n_samples / rate:g} s, or transcribe it with generate(), which does.")
    return {input_name: np.stack([extractor(w) for w in waves])}
