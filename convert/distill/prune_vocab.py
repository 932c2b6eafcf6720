"""Vocabulary pruning: drop the rarest rows of the token embedding and the same tokens from the tokenizer.

In a small encoder the token embedding is most of the weights (all-MiniLM-L6-v2: 11.7 M of 22.7 M
parameters), so pruning heads and FFN neurons alone leaves the model's size mostly where it was.
WordPiece vocabularies (BERT's) list their word pieces by frequency after the special tokens and
single characters, so a token's id is its frequency rank. We keep: every special token, every
single character (alone and as ``##x``, so any word still tokenizes), every token the
distillation data uses, then the most frequent of the rest up to ``(1 - fraction)`` of the
vocabulary. A dropped word is tokenized into smaller pieces that remain, never into ``[UNK]``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from slimml.errors import ConfigError

_UNUSED = re.compile(r"^\[unused\d+\]$")


def is_wordpiece(folder: Path) -> bool:
    file = folder / "tokenizer.json"
    if not file.is_file():
        return False
    return json.loads(file.read_text(encoding="utf-8")).get("model", {}).get("type") == "WordPiece"


def plan(folder: Path, used_ids: set[int], fraction: float) -> list[int]:
    """Old ids to keep, ascending (the new id of a token is its position in this list)."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = spec["model"]["vocab"]
    n = len(vocab)
    special = {t["id"] for t in spec.get("added_tokens", [])}
    chars = {i for tok, i in vocab.items() if len(tok.removeprefix("##")) == 1}
    must = special | chars | set(used_ids)
    budget = max(len(must), round(n * (1 - fraction)))
    unused = {i for tok, i in vocab.items() if _UNUSED.match(tok)}
    rest = [i for i in range(n) if i not in must and i not in unused]  # ascending id = descending frequency
    return sorted(must | set(rest[: budget - len(must)]))


def apply(model: Any, keep: list[int]) -> dict[int, int]:
    """Keep only the embedding rows ``keep`` (in place); return old id -> new id for the tokenizer."""
    import torch

    emb = model.get_input_embeddings()
    if model.get_output_embeddings() is not None:
        raise ConfigError("vocabulary pruning does not handle models with an output (LM) head; prune with vocab=False.")
    idx = torch.tensor(keep, dtype=torch.long)
    new = torch.nn.Embedding(len(keep), emb.embedding_dim, padding_idx=None)
    with torch.no_grad():
        new.weight.copy_(emb.weight.detach().index_select(0, idx))
    model.set_input_embeddings(new)
    model.config.vocab_size = len(keep)
    remap = {old: new_id for new_id, old in enumerate(keep)}
    pad = getattr(model.config, "pad_token_id", None)
    if pad is not None:
        model.config.pad_token_id = remap.get(pad, 0)
    return remap


def write_tokenizer(folder: Path, out_dir: Path, remap: dict[int, int]) -> None:
    """``tokenizer.json``, ``vocab.txt`` and ``tokenizer_config.json`` of ``folder`` with ids renumbered."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {tok: remap[i] for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i in remap}
    for t in spec.get("added_tokens", []):
        t["id"] = remap[t["id"]]
    post = spec.get("post_processor") or {}
    for special in (post.get("special_tokens") or {}).values():
        special["ids"] = [remap[i] for i in special["ids"]]
    for key in ("cls", "sep"):  # BertProcessing stores [token, id] pairs
        if isinstance(post.get(key), list):
            post[key][1] = remap[post[key][1]]
    if spec.get("padding"):
        spec["padding"]["pad_id"] = remap.get(spec["padding"]["pad_id"], 0)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    kept = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    (out_dir / "vocab.txt").write_text("".join(tok + "\n" for tok, _ in kept), encoding="utf-8")
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in cfg:
            cfg["added_tokens_decoder"] = {str(remap[int(k)]): v for k, v in cfg["added_tokens_decoder"].items()}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
