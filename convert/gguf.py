"""GGUF in: a llama.cpp model file as a source.

The file is checked first (magic, version, every tensor inside the file, an architecture
transformers reads), so a bad file fails in one line before anything is written. Converting it
goes through transformers' own GGUF reader (it dequantizes the weights, and builds a fast
tokenizer and the chat template from the file's metadata) into a Hugging Face folder inside the
convert's work folder; from there it is exported like any model folder. The report records the
source's quantization (GGUF file type and tensor types).
"""

from __future__ import annotations

import contextlib
import re
import struct
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from slimml.convert.gguf_rope import rope_config
from slimml.errors import SourceError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what gguf-py's reader (and transformers through it) reads
GPT_OSS = "gpt-oss"  # llama.cpp's name; read here, not through transformers (gguf_gpt_oss)
_RECURRENT = {"mamba": "a state-space model", "lfm2": "short convolutions beside attention"}
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}  # llama.cpp -> transformers

def gguf_decoders(readable) -> list[str]:
    """The GGUF architectures slimml converts, by llama.cpp's names: those transformers reads
    (``readable``), less the recurrent models and encoder-decoders slimml refuses, and gpt-oss, which
    slimml reads itself."""
    back = {hf: cpp for cpp, hf in _RENAMED.items()}
    names = {back.get(a, a) for a in readable if a not in ("general", "tokenizer") and "t5" not in a} - set(_RECURRENT)
    return sorted(names | {GPT_OSS})


# llama.cpp's general.file_type values (LLAMA_FTYPE_*), for the report
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
}


def find_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` in a folder without ``config.json``.

    Raises:
        SourceError: a folder holding several ``.gguf`` files (name the one to convert).
    """
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise SourceError(
            f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); "
            "give the one to convert: `slimml convert FOLDER/NAME.gguf`."
        )
    return found[0] if found else None


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """Check a GGUF file and describe it: architecture, version, file type, tensor types.

    Raises:
        SourceError: not a GGUF file, a version gguf-py does not read, a truncated or damaged
            file, or an architecture transformers cannot read (each one line with the fix).
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == GGUF_MAGIC and len(head) < 8:
        raise SourceError(f"{path} is truncated: it ends after {len(head)} bytes, inside its GGUF header; download or copy "
                          "it again.")
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise SourceError(f"{path} is not a GGUF file (it does not start with 'GGUF'); give a llama.cpp .gguf model file.")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in GGUF_VERSIONS:
        raise SourceError(
            f"{path} is GGUF version {version}, which slimml reads only as versions "
            f"{', '.join(map(str, GGUF_VERSIONS))}; re-save it with a current llama.cpp (convert_hf_to_gguf.py)."
        )
    try:
        reader = read_gguf(path)
        size = path.stat().st_size
        short = [t.name for t in reader.tensors if int(t.data_offset) + int(t.n_bytes) > size]
    except ImportError:  # gguf-py itself not installed (the base install): named by the caller, not "damaged"
        raise
    except Exception as e:  # gguf-py's own errors on a cut file ("cannot reshape array ...")
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))
        if unknown:  # a type newer than the installed gguf-py (llama.cpp adds them: MXFP4, NVFP4, Q1_0, ...)
            from importlib.metadata import version

            raise SourceError(
                f"{path} holds tensors of GGML type {unknown.group(1)}, which the installed gguf {version('gguf')} "
                "does not know (a newer llama.cpp quantization); `pip install -U gguf`, or convert a file of a common "
                "type (F16, Q8_0, Q4_K_M)."
            ) from None
        raise SourceError(
            f"{path} is truncated or damaged (gguf could not read it: {type(e).__name__}); download or copy it again."
        ) from None
    if short:
        raise SourceError(f"{path} is truncated: tensor {short[0]!r} ends past the end of the file; download or copy it again.")
    parts = _field(reader, "split.count")
    if parts and int(parts) > 1:  # transformers reads one file: the other parts' tensors would be missing
        first = re.sub(r"-\d{5}-of-(\d{5})\.gguf$", r"-00001-of-\1.gguf", path.name)
        raise SourceError(
            f"{path} is part {int(_field(reader, 'split.no') or 0) + 1} of {int(parts)} of a split GGUF, which slimml "
            f"reads only whole; merge the parts with llama.cpp's `llama-gguf-split --merge {first} merged.gguf`, "
            "then convert merged.gguf."
        )
    arch = _field(reader, "general.architecture")
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch == GPT_OSS:  # read by slimml itself (gguf_gpt_oss): the installed transformers need only know the model
        from transformers import CONFIG_MAPPING

        if "gpt_oss" not in CONFIG_MAPPING:
            import transformers

            raise SourceError(f"{path} holds a gpt-oss model, which transformers {transformers.__version__} does not "
                              "know; `pip install -U 'transformers>=4.55'`.")
    # transformers renames llama.cpp's "qwen2moe"/"qwen3moe" before it looks its list up
    elif arch not in GGUF_SUPPORTED_ARCHITECTURES and _RENAMED.get(arch) not in GGUF_SUPPORTED_ARCHITECTURES:
        import transformers

        raise SourceError(
            f"{path} holds a {arch!r} model, which transformers {transformers.__version__} cannot read from GGUF "
            f"(slimml converts GGUF {', '.join(gguf_decoders(GGUF_SUPPORTED_ARCHITECTURES))}); "
            "convert the original Hugging Face folder instead."
        )
    if arch in _RECURRENT:  # as their Hugging Face folders are refused (export_torch_decoder), before the reader runs
        raise SourceError(
            f"{path} holds a {arch!r} model ({_RECURRENT[arch]}), which keeps a recurrent state where slimml's decode loop "
            "needs one key and one value tensor per layer: state-space and hybrid models are not supported yet; "
            "convert a transformer decoder (llama, qwen2, qwen3, gemma, phi3, ...)."
        )
    if "t5" in str(arch):  # transformers reads these as encoder-decoders; slimml converts GGUF decoders
        raise SourceError(
            f"{path} holds a {arch!r} encoder-decoder; slimml converts GGUF decoders (llama, qwen2, ...). "
            "Convert the original Hugging Face folder of this model instead."
        )
    _check_tokenizer(path, reader)
    file_type = _field(reader, "general.file_type")
    return {
        "format": "gguf", "gguf_version": version, "architecture": arch,
        "gguf_file_type": _file_type(file_type) if file_type is not None else None,
        "gguf_tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors).most_common()),
    }


def _file_type(value: int) -> str:
    """llama.cpp's name of a ``general.file_type`` (``Q4_K_M``), newer ones as the installed gguf names them."""
    if value in _FILE_TYPES:
        return _FILE_TYPES[value]
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


def _check_tokenizer(path: Path, reader: Any) -> None:
    """Refuse a byte-level BPE vocabulary labelled as sentencepiece (``tokenizer.ggml.model = "llama"``).

    llama.cpp's ``convert_hf_to_gguf.py`` writes one from a folder whose tokenizer looks like
    sentencepiece to it (a ``tokenizer.json`` with byte fallback, as transformers saves a GGUF's
    tokenizer): every space then reads as an unknown token, and the model, source and artifact
    alike, scores perplexity ~10^4 on English text, so comparing the two cannot catch it.
    """
    field = reader.fields.get("tokenizer.ggml.tokens")
    if _field(reader, "tokenizer.ggml.model") != "llama" or field is None:
        return
    tokens = field.contents()
    byte_level = sum(t.startswith("\u0120") for t in tokens)  # "Ġ": GPT-2's byte for a space
    if byte_level > len(tokens) // 10 and not any("\u2581" in t for t in tokens):  # "▁": sentencepiece's space
        raise SourceError(
            f"{path} labels its tokenizer sentencepiece ('llama') but its vocabulary is byte-level BPE "
            f"({byte_level} of {len(tokens)} tokens start with 'Ġ'), so text would read as unknown tokens; "
            "re-make the file with llama.cpp's convert_hf_to_gguf.py from a folder whose tokenizer.json is the "
            "original (no tokenizer.model, no byte fallback)."
        )


def gguf_to_folder(path: Path, folder: Path) -> None:
    """Write the GGUF model as a Hugging Face folder: dequantized weights, config, tokenizer, chat template.

    Needs ``torch``, ``transformers``, ``gguf`` and ``accelerate`` (the ``convert`` extra). gpt-oss is
    read by slimml itself (``gguf_gpt_oss``: no transformers reads its files whole).
    """
    with parsed_once():  # one parse of the file serves every read below
        _gguf_to_folder(path, folder)


def _gguf_to_folder(path: Path, folder: Path) -> None:
    if _field(read_gguf(path), "general.architecture") == GPT_OSS:
        from slimml.convert.gguf_gpt_oss import gpt_oss_folder

        gpt_oss_folder(path, folder)
        return
    import io
    import logging
    import warnings

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        import accelerate  # noqa: F401  (transformers refuses GGUF without it)
    except ImportError:
        raise SourceError("reading a GGUF file needs accelerate; `pip install accelerate` (part of the convert extra).") from None
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), _reader_fixes():  # (stderr: its tqdm bar)
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            for key, value in missed_config(path, config).items():
                rope = getattr(config, "rope_parameters", None)  # transformers 5 reads RoPE values from it
                if isinstance(rope, dict) and key == "rope_scaling" and "rope_type" in rope:
                    rope.update(value)  # (its rope_scaling is rope_parameters: setting it would drop rope_theta)
                    continue
                setattr(config, key, value)
                if isinstance(rope, dict) and (key in rope or (key == "original_max_position_embeddings" and "rope_type" in rope)):
                    rope[key] = value
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config, dtype="float32")
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise SourceError(
            f"transformers {transformers.__version__} could not read the model in {path} ({type(e).__name__}: {first}); "
            "convert the original Hugging Face folder of this model instead."
        ) from None
    if _field(read_gguf(path), "tokenizer.ggml.add_bos_token") is False and getattr(tokenizer, "add_bos_token", False):
        # the file says no bos before a text (SmolLM2's), as llama.cpp reads it and the model's own tokenizer
        # does; transformers' reader puts one before every prompt (an empty prompt became [bos])
        tokenizer.add_bos_token = False
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if isinstance(eos, int) and tokenizer.convert_ids_to_tokens(eos) is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)  # the file's eos id; the GGUF tokenizer may name another
    if getattr(model, "hf_quantizer", None) is not None:  # transformers 5 marks a GGUF model quantized (its weights
        model.hf_quantizer = None                            # are dequantized floats) and then refuses to save it
        model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def missed_config(path: Path, config: Any) -> dict[str, Any]:
    """Config values the file holds and transformers' GGUF reader drops (4.57 and 5), as ``config`` attributes.

    - ``head_dim`` from ``attention.key_length`` where the config says otherwise (the reader leaves
      Qwen3's at the class default, 128, and a Qwen3 of another head size does not load);
    - ``partial_rotary_factor`` from ``rope.dimension_count`` (Phi-3 / Phi-4-mini, StableLM);
    - Phi-3's ``sliding_window`` (``attention.sliding_window``, 0 for none);
    - Qwen2/3-MoE's expert sizes (``expert_feed_forward_length``, ``expert_shared_feed_forward_length``)
      and whether the top k experts' weights are renormalized (``norm_topk_prob``: the file's
      ``expert_weights_norm``, else what llama.cpp computes for the architecture: Qwen3-MoE yes,
      Qwen2-MoE no; transformers 4.57 leaves Qwen3-MoE's at the class default, no);
    - GPT-2's ``n_positions`` from ``context_length`` (the reader sets only ``n_ctx``, and the
      position table of any GPT-2 whose context is not 1024 does not load);
    - Gemma 2/3's attention scale, soft-capping and Gemma 3's global RoPE scaling (``_gemma_config``);
    - a scaled RoPE (Llama 3's, linear, YaRN, Phi-3's LongRoPE: ``gguf_rope.rope_config``);
    - a ``pad_token_id`` (a class default) beyond a smaller vocabulary: the file's own, or none.
    """
    reader = read_gguf(path)
    arch = _field(reader, "general.architecture")
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    fixes: dict[str, Any] = {}
    key_length = _field(reader, f"{arch}.attention.key_length")
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if key_length and int(key_length) != head_dim:
        fixes["head_dim"] = head_dim = int(key_length)
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    factor = getattr(config, "partial_rotary_factor", None)  # transformers 5 keeps it in rope_parameters
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor") if factor is None else factor
    if rotary and head_dim and factor is not None and int(rotary) != round(float(factor) * head_dim):
        fixes["partial_rotary_factor"] = int(rotary) / head_dim
    window = _field(reader, f"{arch}.attention.sliding_window")
    if arch == "phi3" and window and getattr(config, "sliding_window", None) != int(window):
        fixes["sliding_window"] = int(window)
    for key, attr in (("expert_feed_forward_length", "moe_intermediate_size"),  # Qwen2/3-MoE: left at the class default
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        value = _field(reader, f"{arch}.{key}")
        if value and hasattr(config, attr) and getattr(config, attr) != int(value):
            fixes[attr] = int(value)
    norm = _field(reader, f"{arch}.expert_weights_norm")
    norm = bool(norm) if norm is not None else {"qwen3moe": True, "qwen2moe": False}.get(arch)
    if norm is not None and hasattr(config, "norm_topk_prob") and bool(config.norm_topk_prob) != norm:
        fixes["norm_topk_prob"] = norm
    if arch in ("gemma2", "gemma3"):
        fixes.update(_gemma_config(reader, arch, config, hidden, heads, head_dim))
    context = _field(reader, f"{arch}.context_length")
    if arch == "gpt2" and context and getattr(config, "n_positions", None) != int(context):
        fixes["n_positions"] = int(context)
    fixes.update(rope_config(reader, arch, config, _field))  # Llama 3's baked scaling, linear/YaRN fields, Phi-3's LongRoPE
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(pad, int) and vocab and pad >= vocab:  # a class default (Phi-3's 32000) beyond a smaller vocabulary
        own = _field(reader, "tokenizer.ggml.padding_token_id")
        fixes["pad_token_id"] = int(own) if own is not None and int(own) < vocab else None
    return fixes


@contextlib.contextmanager
def _reader_fixes() -> Iterator[None]:
    """transformers' GGUF reader, while it reads, with two Qwen2-MoE faults mended (4.57 and 5):

    - 4.57 renames ``qwen2moe`` to ``qwen2_moe`` before it reads the fields, and its config mapping
      knows only ``qwen2moe``: every field is skipped, the config comes out at the class defaults
      (2048 wide, 24 layers, 60 experts), and the weights fail to load. The mapping is lent the
      second name (``qwen3moe`` is mapped as ``qwen3_moe`` already).
    - the shared expert's gate: the reader adds a leading axis to make the 1-D vector of older files
      a ``(1, hidden)`` matrix, and so makes the ``(1, hidden)`` that llama.cpp's converter writes now
      ``(1, 1, hidden)``, which does not load. It is given the vector.
    """
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    added = [new for old, new in _RENAMED.items() if old in GGUF_CONFIG_MAPPING and new not in GGUF_CONFIG_MAPPING]
    for old, new in _RENAMED.items():
        if new in added:
            GGUF_CONFIG_MAPPING[new] = GGUF_CONFIG_MAPPING[old]
    processor = TENSOR_PROCESSORS.get("qwen2moe")
    process = processor.process if processor is not None else None

    def flat_gate(self, weights, name, **kwargs):
        if "ffn_gate_inp_shexp" in name and weights.ndim == 2:
            weights = weights.reshape(-1)
        return process(self, weights, name, **kwargs)

    if processor is not None:
        processor.process = flat_gate
    try:
        yield
    finally:
        for new in added:
            GGUF_CONFIG_MAPPING.pop(new, None)
        if processor is not None:
            processor.process = process


def _gemma_config(reader: Any, arch: str, config: Any, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """What a Gemma 2/3 GGUF means and transformers' reader leaves at its class defaults:

    - ``query_pre_attn_scalar``: the file has none; llama.cpp scales attention by ``head_dim ** -0.5``,
      by ``(hidden / heads) ** -0.5`` for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), as
      Google's configs do; the reader leaves 256, wrong for both 27B models;
    - Gemma 2's ``attn_logit_softcapping`` and ``final_logit_softcapping`` as the file writes them;
    - Gemma 3's ``rope.scaling`` (linear, factor 8 on the 4B and larger models): global layers only.
    """
    fixes: dict[str, Any] = {}
    layers = int(_field(reader, f"{arch}.block_count") or 0)
    scalar = hidden // heads if (arch, layers) in (("gemma2", 46), ("gemma3", 62)) else head_dim
    if scalar and getattr(config, "query_pre_attn_scalar", None) != scalar:
        fixes["query_pre_attn_scalar"] = scalar
    for key in ("attn_logit_softcapping", "final_logit_softcapping") if arch == "gemma2" else ():
        value = _field(reader, f"{arch}.{key}")
        if value is not None and getattr(config, key, None) != float(value):
            fixes[key] = float(value)
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if arch == "gemma3" and _field(reader, f"{arch}.rope.scaling.type") == "linear" and factor and float(factor) != 1.0:
        scaling = {"rope_type": "linear", "factor": float(factor)}
        nested = getattr(config, "rope_parameters", None)
        if isinstance(nested, dict) and isinstance(nested.get("full_attention"), dict):  # transformers 5: per layer type
            if {k: nested["full_attention"].get(k) for k in scaling} != scaling:
                fixes["rope_parameters"] = {**nested, "full_attention": {**nested["full_attention"], **scaling}}
        elif (getattr(config, "rope_scaling", None) or {}).get("factor") != float(factor):
            fixes["rope_scaling"] = scaling
    return fixes


_PARSED: dict[tuple[str, int, int], Any] = {}
_BLOCKS: list[None] = []  # one entry per open parsed_once block


def read_gguf(path: str | Path) -> Any:
    """gguf-py's ``GGUFReader`` of ``path``, parsed once while the file stays as it is.

    Parsing is slow in Python (SmolLM2's 49,152-token vocabulary: 6-9 s on 2 cores), and one
    convert reads the file seven times over (slimml's checks; transformers' config, tokenizer and
    weights, each twice): inside a :func:`parsed_once` block one parse serves them all, and the
    parse (its mapping of the file) is let go when the block ends. Outside one, a fresh parse.
    """
    from gguf.gguf_reader import GGUFReader  # (the class itself: parsed_once lends gguf.GGUFReader this function)

    resolved = Path(path).resolve()
    if not _BLOCKS:
        return GGUFReader(str(resolved))
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key not in _PARSED:
        _PARSED.clear()
        _PARSED[key] = GGUFReader(str(resolved))
    return _PARSED[key]


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """transformers' GGUF reads, while it reads, served by :func:`read_gguf`, and gguf-py's tensor
    name map built once per architecture (transformers 4.57 builds it again for every module of
    the model: 397 times, 13 s, for SmolLM2)."""
    import functools

    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def cached(path: Any, mode: str = "r") -> Any:
        return read_gguf(path) if mode == "r" else reader(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = cached, functools.lru_cache(maxsize=8)(name_map)
    _BLOCKS.append(None)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        _BLOCKS.pop()
        if not _BLOCKS:
            _PARSED.clear()  # the convert's last read of the file: its mapping is not kept past it


def _field(reader: Any, key: str) -> Any:
    """One metadata value of a GGUF file (a string, a number), or None."""
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:
        return None


def as_huggingface(src: Any, work: Path) -> Any:
    """A ``kind="gguf"`` source as a Hugging Face folder source in ``work/gguf-model`` (same name and facts)."""
    import dataclasses

    folder = work / "gguf-model"
    folder.mkdir(parents=True, exist_ok=True)
    gguf_to_folder(src.path, folder)
    # "path" in extra: the manifest names the GGUF file, not the temporary folder
    return dataclasses.replace(src, kind="huggingface", path=folder, extra={**src.extra, "path": str(src.path)})


def quantization_note(info: dict[str, Any]) -> str:
    """``"Q4_1 (Q4_1 x210, F32 x61, Q8_0 x1)"``: the file type and its tensors' types, for the report."""
    kinds = ", ".join(f"{k} x{n}" for k, n in info.get("gguf_tensor_types", {}).items())
    return f"{info.get('gguf_file_type') or 'unknown'} ({kinds})"
