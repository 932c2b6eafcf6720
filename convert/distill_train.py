"""The training side of distillation: teacher loading, the student's layers, batches, losses, the loop."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slimml.convert.sources import max_seq_length, sentence_transformers_pooling
from slimml.errors import ConfigError

# What the student matches, by the head class the teacher's config names.
_KIND_BY_SUFFIX = [
    ("ForSequenceClassification", "logits-kl"),
    ("ForCausalLM", "lm-kl"),
    ("LMHeadModel", "lm-kl"),
    ("Model", "hidden-mse"),
]
_TARGETS: dict[tuple, Any] = {}
TEMPERATURE = 2.0  # softens classifier logits so the student also learns the teacher's second choices


def load_teacher(folder: Path) -> tuple[Any, str, dict | None]:
    """The teacher in eval mode, its objective kind and its pooling (sentence-transformers folders)."""
    import transformers
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    pooling = sentence_transformers_pooling(folder)
    if pooling is not None:
        return AutoModel.from_pretrained(str(folder), local_files_only=True).eval(), "embedding-cosine", pooling
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    for arch in config.architectures or []:
        for suffix, kind in _KIND_BY_SUFFIX:
            if arch.endswith(suffix) and hasattr(transformers, arch):
                model = getattr(transformers, arch).from_pretrained(str(folder), local_files_only=True)
                return model.eval(), kind, None
    raise ConfigError(
        f"distillation knows encoders (*Model), sentence-transformers folders, *ForSequenceClassification and "
        f"causal LMs; {folder} declares {config.architectures}. Leave --distill-layers and --prune out for it."
    )


def _layer_list(model: Any) -> tuple[Any, str]:
    """The ModuleList holding the transformer blocks, and its attribute path."""
    import torch

    n = model.config.num_hidden_layers
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n:
            return mod, name
    raise ConfigError(f"cannot find the {n} transformer layers of {type(model).__name__}; this architecture cannot be distilled.")


class Trainer:
    """Tokenized texts, the teacher's targets and the training loop for one student."""

    def __init__(self, teacher: Any, kind: str, folder: Path, texts: list[str], config: Any, targets: Any = None):
        import torch
        from transformers import AutoTokenizer

        torch.manual_seed(config.seed)
        self.teacher, self.kind, self.config = teacher, kind, config
        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        max_len = min(config.max_length, max_seq_length(folder) or config.max_length)
        self.ids = self.tok(texts, truncation=True, max_length=max_len)["input_ids"]
        self.pad_id = self.tok.pad_token_id or 0
        self.student_ids, self.student_pad = self.ids, self.pad_id  # differ once the vocabulary is pruned
        self.targets = targets
        if kind == "embedding-cosine" and targets is None:
            key = (str(folder.resolve()), max_len, hash(tuple(texts)))
            if key not in _TARGETS:  # a sweep in one process computes the teacher's embeddings once
                _TARGETS.clear()
                _TARGETS[key] = self._cached_embeddings()
            self.targets = _TARGETS[key]

    def renumber(self, remap: dict[int, int]) -> None:
        """The student's token ids after vocabulary pruning (every id the data uses was kept)."""
        self.student_ids = [[remap[i] for i in s] for s in self.ids]
        self.student_pad = remap.get(self.pad_id, 0)

    def student(self, kept_layers: list[int]) -> Any:
        """A copy of the teacher keeping only ``kept_layers`` (teacher indices)."""
        import torch

        student = copy.deepcopy(self.teacher)
        layers, path = _layer_list(student)
        new = torch.nn.ModuleList([layers[i] for i in kept_layers])
        for i, layer in enumerate(new):  # decoders index their KV cache by layer
            for mod in layer.modules():
                if hasattr(mod, "layer_idx"):
                    mod.layer_idx = i
        parent = student.get_submodule(path.rsplit(".", 1)[0]) if "." in path else student
        setattr(parent, path.rsplit(".", 1)[-1], new)
        student.config.num_hidden_layers = len(kept_layers)
        if isinstance(getattr(student.config, "layer_types", None), list):
            student.config.layer_types = [student.config.layer_types[i] for i in kept_layers]
        return student

    def _collate(self, idx: list[int]) -> dict[str, Any]:
        import torch

        def pad(table, pad_id):
            seqs = [table[i] for i in idx]
            ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s)
            return ids

        ids = pad(self.ids, self.pad_id)  # (B, T)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            mask[r, : len(self.ids[i])] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "index": torch.tensor(idx)}
        batch["student_input_ids"] = ids if self.student_ids is self.ids else pad(self.student_ids, self.student_pad)
        return batch

    def _order(self, epoch: int) -> list[list[int]]:
        """One epoch of batches: shuffled, then length-sorted within chunks to cut padding."""
        rng = random.Random(self.config.seed * 1000 + epoch)
        idx = list(range(len(self.ids)))
        rng.shuffle(idx)
        bs, chunk = self.config.batch_size, self.config.batch_size * 50
        batches = []
        for c in range(0, len(idx), chunk):
            part = sorted(idx[c : c + chunk], key=lambda i: len(self.ids[i]))
            batches += [part[b : b + bs] for b in range(0, len(part), bs)]
        rng.shuffle(batches)
        return [b for b in batches if len(b) >= 2]

    def batches(self, n: int) -> list[dict[str, Any]]:
        return [self._collate(b) for b in self._order(-1)[:n]]

    def _cached_embeddings(self) -> Any:
        """The teacher's mean-pooled embeddings of every text, computed once (the targets never change)."""
        import torch

        out = torch.empty(len(self.ids), self.teacher.config.hidden_size)
        order = sorted(range(len(self.ids)), key=lambda i: len(self.ids[i]))
        with torch.inference_mode():
            for b in range(0, len(order), 128):
                batch = self._collate(order[b : b + 128])
                out[batch["index"]] = self._embed(self.teacher, batch)
        return out

    def _embed(self, model: Any, batch: dict[str, Any]) -> Any:
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, H)

    def loss(self, student: Any, batch: dict[str, Any]) -> Any:
        import torch
        import torch.nn.functional as F

        feeds = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        s_feeds = {"input_ids": batch["student_input_ids"], "attention_mask": batch["attention_mask"]}
        if self.kind == "embedding-cosine":
            s = F.normalize(self._embed(student, s_feeds), dim=-1)
            t = F.normalize(self.targets[batch["index"]], dim=-1)
            cosine = (1 - (s * t).sum(-1)).mean()
            relation = F.mse_loss(s @ s.T, t @ t.T)  # (B, B) similarity matrices: what ranking depends on
            return cosine + 10.0 * relation
        with torch.no_grad():
            t_out = self.teacher(**feeds)
        s_out = student(**s_feeds)
        mask = batch["attention_mask"].unsqueeze(-1).float()
        if self.kind == "hidden-mse":
            diff = (s_out.last_hidden_state - t_out.last_hidden_state) ** 2 * mask
            return diff.sum() / (mask.sum() * diff.shape[-1])
        temp = TEMPERATURE if self.kind == "logits-kl" else 1.0
        s_logp = F.log_softmax(s_out.logits / temp, dim=-1)
        t_logp = F.log_softmax(t_out.logits / temp, dim=-1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # (B,) or (B, T)
        if self.kind == "lm-kl":
            m = batch["attention_mask"].float()
            kl = (kl * m).sum() / m.sum()
        return kl.mean() * temp * temp

    def steps(self, epochs: float) -> int:
        """Optimizer steps for ``epochs`` passes over the data (capped by ``config.max_steps``)."""
        total = max(1, math.ceil(len(self._order(0)) * epochs))
        return total if self.config.max_steps is None else min(total, self.config.max_steps)

    def train(self, student: Any, total: int, state: dict | None, save: Callable[[int, dict], None],
              progress: Callable[[int, float], None] | None, first_epoch: int = 0) -> dict[str, Any]:
        """Train ``student`` in place for ``total`` steps; resume from ``state`` (a checkpoint) when given.

        ``first_epoch`` numbers the data orders, so a second phase does not replay the first one's batches.
        """
        import torch

        per_epoch = len(self._order(0))
        # The student keeps the teacher's token embeddings: they are most of its weights and already
        # fit the vocabulary; freezing them also halves the optimizer's work on a small encoder.
        student.get_input_embeddings().weight.requires_grad_(False)
        params = [p for p in student.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.01)
        warm = max(1, total // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            optim, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
        step = 0
        if state is not None:
            student.load_state_dict(state["student"])
            optim.load_state_dict(state["optim"]["optim"])
            sched.load_state_dict(state["optim"]["sched"])
            step = state["step"]
        resumed_at, running = step, None
        student.train()
        while step < total:
            epoch, offset = divmod(step, per_epoch)
            for b in self._order(first_epoch + epoch)[offset:]:
                loss = self.loss(student, self._collate(b))
                optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optim.step()
                sched.step()
                step += 1
                running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
                if progress is not None:
                    progress(step, running)
                if step % self.config.checkpoint_every == 0 and step < total:
                    save(step, {"optim": optim.state_dict(), "sched": sched.state_dict()})
                if step >= total:
                    break
        student.eval()
        return {"steps": total, "loss": float(running or 0.0), "resumed_at": resumed_at}
