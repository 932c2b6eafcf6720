"""GGUF in across llama.cpp's file types: what the report says the source held, and files no reader should trust.

The sweep over real files is ``benchmarks/sweep_gguf_types.py``; these tests write tiny GGUFs with gguf-py.
"""

from __future__ import annotations

import numpy as np
import pytest

from slimml.errors import SourceError

gguf = pytest.importorskip("gguf")


def _gguf(path, tokenizer: str | None = None, tokens: list[str] | None = None, file_type: int | None = None,
          tensors: dict | None = None):
    """A one-layer llama GGUF header (and tensors), the tokenizer fields as given."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    if file_type is not None:
        w.add_file_type(file_type)
    if tokenizer is not None:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(tokens)
    for name, (data, kind) in (tensors or {"token_embd.weight": (np.zeros((8, 32), np.float32), None)}).items():
        if kind is None:
            w.add_tensor(name, data)
        else:  # raw quantized bytes: (rows, bytes per row) uint8 and the GGML type
            w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


BYTE_LEVEL = ["<|endoftext|>", "a", "b", "Ġthe", "Ġcat", "Ġsat", "Ġon", "Ġmat", "the", "cat"]


def test_a_byte_level_vocabulary_labelled_sentencepiece_is_refused(tmp_path):
    """llama.cpp's converter writes such a file from a folder transformers saved from a GGUF: every
    space reads as unknown, source and artifact score the same absurd perplexity, so it is refused."""
    from slimml.convert import convert

    bad = _gguf(tmp_path / "bad.gguf", "llama", BYTE_LEVEL)
    with pytest.raises(SourceError, match=r"labels its tokenizer sentencepiece \('llama'\) but its vocabulary is "
                                          r"byte-level BPE \(5 of 10 tokens start with 'Ġ'\).*convert_hf_to_gguf.py"):
        convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tokenizer, tokens", [
    ("gpt2", BYTE_LEVEL),  # what llama.cpp writes for SmolLM2, Llama 3, Qwen
    ("llama", ["<unk>", "<s>", "</s>", "▁the", "▁cat", "Ġ", "a"]),  # a sentencepiece vocabulary
])
def test_a_consistent_tokenizer_is_read(tmp_path, tokenizer, tokens):
    from slimml.convert.gguf import inspect_gguf

    assert inspect_gguf(_gguf(tmp_path / "ok.gguf", tokenizer, tokens))["architecture"] == "llama"


def test_a_tensor_type_the_installed_gguf_does_not_know_is_named(tmp_path):
    """A type newer than gguf-py (llama.cpp keeps adding them) is not 'truncated or damaged': it says to upgrade."""
    import struct

    from slimml.convert.gguf import inspect_gguf

    data = bytearray(_gguf(tmp_path / "ok.gguf").read_bytes())
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight")
    at += 4 + 8 * struct.unpack_from("<I", data, at)[0]  # n_dims, then the dims: the type follows
    struct.pack_into("<I", data, at, 99)
    (tmp_path / "new.gguf").write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"holds tensors of GGML type 99, which the installed gguf .* does not know "
                                          r".*`pip install -U gguf`"):
        inspect_gguf(tmp_path / "new.gguf")


def test_a_part_of_a_split_gguf_is_refused_with_the_merge_command(tmp_path):
    """transformers reads one file; the other parts' tensors would be missing (and initialised at random)."""
    from slimml.convert import convert

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=1)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.add_tensor("output_norm.weight", np.zeros((32,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match=r"m-00002-of-00002.gguf is part 2 of 2 of a split GGUF.*"
                                          r"`llama-gguf-split --merge m-00001-of-00002.gguf merged.gguf`"):
        convert(tmp_path / "m-00002-of-00002.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
