"""The training side of distillation: the student's layers, batches, losses against cached targets, the loop.

The teacher never runs here: its outputs come from ``convert.teacher`` (computed once by the slimml
runtime and memory-mapped). The student is built from the teacher's config with fewer layers and
filled from the teacher's checkpoint one tensor at a time (``convert.weights``), so the teacher is
never whole in memory.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import slimml.convert.distill.precision as mp
from slimml.convert.folder_facts import usable_positions
from slimml.convert.sources import max_seq_length, sentence_transformers_pooling
from slimml.convert.weights import open_weights
from slimml.errors import ConfigError

# What the student matches, by the head class the teacher's config names.
_KIND_BY_SUFFIX = [
    ("ForSequenceClassification", "logits-kl"),
    ("ForCausalLM", "lm-kl"),
    ("LMHeadModel", "lm-kl"),
    ("Model", "hidden-mse"),
]
TEMPERATURE = 2.0  # softens classifier logits so the student also learns the teacher's second choices
HELDOUT_MAX = 256  # texts kept out of training to measure the student against the teacher


def teacher_kind(folder: Path) -> tuple[str, str]:
    """The objective (``embedding-cosine``, ``hidden-mse``, ``logits-kl``, ``lm-kl``) and the model class name."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if sentence_transformers_pooling(folder) is not None:
        return "embedding-cosine", "AutoModel"
    for arch in config.architectures or []:
        for suffix, kind in _KIND_BY_SUFFIX:
            if arch.endswith(suffix) and hasattr(transformers, arch):
                return kind, arch
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
    raise ConfigError(f"cannot find the {n} transformer layers of {type(model).__name__}; this architecture cannot be "
                      "distilled: leave --distill-layers out (--prune alone works for BERT-like and Llama-like models).")


def build_student(folder: Path, model_class: str, kept_layers: list[int]) -> Any:
    """The teacher's architecture with only ``kept_layers``, its weights read from the teacher's checkpoint
    tensor by tensor (so a teacher bigger than memory can give a student that fits)."""
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    config.num_hidden_layers = len(kept_layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept_layers]
    cls = getattr(transformers, model_class)
    student = (cls.from_config(config) if model_class == "AutoModel" else cls(config)).to(torch.float32)
    _, path = _layer_list(student)
    weights = open_weights(folder)
    prefix = student.base_model_prefix
    layer_re = re.compile(rf"^{re.escape(path)}\.(\d+)\.")
    tied = {k for k, _ in _tied_keys(student)}
    missing = []
    state = student.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            source = layer_re.sub(lambda m: f"{path}.{kept_layers[int(m.group(1))]}.", name)
            found = next((c for c in (source, f"{prefix}.{source}", source.removeprefix(f"{prefix}."))
                          if c in weights), None)
            if found is None:
                if name not in tied and name in dict(student.named_parameters()):
                    missing.append(name)
                continue
            tensor.copy_(weights.torch(found).to(tensor.dtype))
    if missing:
        raise ConfigError(f"the checkpoint in {folder} lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}; "
                          "the weights do not match config.json: re-save or re-download the model.")
    student.tie_weights()
    return student.eval()


def _tied_keys(model: Any) -> list[tuple[str, Any]]:
    out = model.get_output_embeddings()
    if out is None or not getattr(model.config, "tie_word_embeddings", False):
        return []
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight]


class Trainer:
    """Tokenized texts, the teacher's cached targets and the training loop for one student."""

    def __init__(self, kind: str, folder: Path, texts: list[str], config: Any, pooler: Any = None):
        import torch
        from transformers import AutoTokenizer

        torch.manual_seed(config.seed)
        self.kind, self.config = kind, config
        # a sentence embedder's student is pooled as the teacher's artifact pools (its mode and projections)
        from slimml.convert.distill.pooled import StudentPooling

        self.pooling = StudentPooling(pooler) if pooler is not None else None
        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        # as the library reads: sentence_bert_config.json's length, else the tokenizer's (sentence-transformers
        # 5 saves max_seq_length there as model_max_length); a limit past 100,000 is transformers' "none"
        named = self.tok.model_max_length if 0 < self.tok.model_max_length < 100_000 else None
        max_len = min(config.max_length, max_seq_length(folder) or named or config.max_length)
        positions = usable_positions(folder) if (Path(folder) / "config.json").is_file() else None
        if positions is not None:  # a length setting past the position table (copied from another model's folder)
            max_len = min(max_len, positions)
        self.ids = self.tok(texts, truncation=True, max_length=max_len)["input_ids"]
        self.pad_id = self.tok.pad_token_id or 0
        self.student_ids, self.student_pad = self.ids, self.pad_id  # differ once the vocabulary is pruned
        held = min(HELDOUT_MAX, len(texts) // 10)
        rng = random.Random(config.seed + 7)
        heldout = set(rng.sample(range(len(texts)), held)) if held >= 8 else set()
        self.heldout = sorted(heldout)
        self.train_idx = [i for i in range(len(texts)) if i not in heldout]
        self.targets = None  # convert.teacher.TeacherOutputs, set by use()
        self.device = training_device(config.device)
        self.precision = None  # chosen in train() (measured when "auto")
        self.precision_ms: dict[str, float] = {}

    def use(self, targets: Any) -> None:
        self.targets = targets

    def renumber(self, remap: dict[int, int]) -> None:
        """The student's token ids after vocabulary pruning (every id the data uses was kept)."""
        self.student_ids = [[remap[i] for i in s] for s in self.ids]
        self.student_pad = remap.get(self.pad_id, 0)

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
        batch = {"attention_mask": mask, "index": idx,
                 "student_input_ids": ids if self.student_ids is self.ids else pad(self.student_ids, self.student_pad)}
        batch.update(self._targets(idx, ids.shape[1]))
        return {k: v.to(self.device) if hasattr(v, "to") else v for k, v in batch.items()}

    def _targets(self, idx: list[int], width: int) -> dict[str, Any]:
        """The teacher's cached outputs for these texts, padded to the batch's width where per token."""
        import numpy as np
        import torch

        rows = self.targets.rows(idx)
        out = {}
        for name, value in rows.items():
            if isinstance(value, list):  # per token: pad each text's rows to the batch width
                first = value[0]
                arr = np.zeros((len(value), width, *first.shape[1:]), dtype=first.dtype)
                for r, v in enumerate(value):
                    arr[r, : len(v)] = v
                value = arr
            out[f"t_{name}"] = torch.from_numpy(np.ascontiguousarray(value))
        return out

    def _order(self, epoch: int) -> list[list[int]]:
        """One epoch of batches: shuffled, then length-sorted within chunks to cut padding."""
        rng = random.Random(self.config.seed * 1000 + epoch)
        idx = list(self.train_idx)
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

    def _embed(self, model: Any, batch: dict[str, Any]) -> Any:
        hidden = model(input_ids=batch["student_input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return self.pooling(hidden, batch["attention_mask"])  # (B, width)

    def loss(self, student: Any, batch: dict[str, Any]) -> Any:
        import torch
        import torch.nn.functional as F

        mask = batch["attention_mask"]
        if self.kind == "embedding-cosine":
            s = F.normalize(self._embed(student, batch).float(), dim=-1)
            t = F.normalize(batch["t_embeddings"], dim=-1)
            cosine = (1 - (s * t).sum(-1)).mean()
            relation = F.mse_loss(s @ s.T, t @ t.T)  # (B, B) similarity matrices: what ranking depends on
            return cosine + 10.0 * relation
        out = student(input_ids=batch["student_input_ids"], attention_mask=mask)
        m = mask.float()
        if self.kind == "hidden-mse":
            diff = (out.last_hidden_state.float() - batch["t_hidden"]) ** 2 * m.unsqueeze(-1)
            return diff.sum() / (m.sum() * diff.shape[-1])
        logits = out.logits.float()
        if self.kind == "logits-kl":
            t_logp = F.log_softmax(batch["t_logits"] / TEMPERATURE, dim=-1)
            s_logp = F.log_softmax(logits / TEMPERATURE, dim=-1)
            return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean() * TEMPERATURE * TEMPERATURE
        # lm-kl against the teacher's top-k: KL over the top tokens plus one bucket for the rest of the mass
        s_logp_all = F.log_softmax(logits, dim=-1)  # (B, T, V)
        ids = batch["t_top_ids"].long()
        s_logp = torch.gather(s_logp_all, -1, ids)  # (B, T, k)
        t_logp = batch["t_top_values"] - batch["t_lse"].unsqueeze(-1)
        t_p = t_logp.exp()
        kl = (t_p * (t_logp - s_logp)).sum(-1)
        t_rest = (1 - t_p.sum(-1)).clamp(min=1e-8)
        s_rest = (1 - s_logp.exp().sum(-1)).clamp(min=1e-8)
        kl = kl + t_rest * (t_rest.log() - s_rest.log())
        return (kl * m).sum() / m.sum()

    def heldout_loss(self, student: Any) -> float | None:
        """The loss on the texts kept out of training (the student against its teacher on unseen data)."""
        import torch

        if not self.heldout:
            return None
        was_training = student.training
        student.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for b in range(0, len(self.heldout), self.config.batch_size):
                idx = self.heldout[b: b + self.config.batch_size]
                if len(idx) < 2:
                    continue
                total += float(self.loss(student, self._collate(idx))) * len(idx)
                n += len(idx)
        student.train(was_training)
        return total / max(1, n)

    def steps(self, epochs: float) -> int:
        """Optimizer steps for ``epochs`` passes over the data (capped by ``config.max_steps``)."""
        per_epoch = math.ceil(len(self._order(0)) / self.config.grad_accum)
        total = max(1, math.ceil(per_epoch * epochs))
        return total if self.config.max_steps is None else min(total, self.config.max_steps)

    def _micro_batches(self, first_epoch: int, start_step: int):
        """Batches from optimizer step ``start_step`` on, ``grad_accum`` to a step, across epochs."""
        n = self.config.grad_accum
        per_epoch = len(self._order(0))
        b = start_step * n
        while True:
            epoch, offset = divmod(b, per_epoch)
            for batch in self._order(first_epoch + epoch)[offset:]:
                yield batch
            b = (epoch + 1) * per_epoch

    def _choose_precision(self, student: Any, first: list[int]) -> str:
        import torch

        requested = self.config.mixed_precision
        if requested != "auto":
            return requested
        rng = torch.get_rng_state()
        batch = self._collate(first)

        def step(precision: str) -> None:
            with mp.autocast(precision, self.device.type):
                self.loss(student, batch).backward()
            student.zero_grad(set_to_none=True)

        choice, self.precision_ms = mp.measure(step, self.device.type)
        torch.set_rng_state(rng)  # the measurement must not change what training draws
        return choice

    def train(self, student: Any, total: int, state: dict | None, save: Callable[[int, dict], None],
              progress: Callable[[int, float], None] | None, first_epoch: int = 0) -> dict[str, Any]:
        """Train ``student`` in place for ``total`` optimizer steps; resume from ``state`` (a checkpoint).

        Each step accumulates the gradients of ``grad_accum`` batches. ``first_epoch`` numbers the
        data orders, so a second phase does not replay the first one's batches.
        """
        import torch

        student.to(self.device)
        # The student keeps the teacher's token embeddings: they are most of its weights and already
        # fit the vocabulary; freezing them also halves the optimizer's work on a small encoder.
        student.get_input_embeddings().weight.requires_grad_(False)
        if self.config.checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in student.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.01)
        warm = max(1, total // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            optim, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
        step = 0
        student.train()
        if state is not None:
            student.load_state_dict(state["student"])
            optim.load_state_dict(state["optim"]["optim"])
            sched.load_state_dict(state["optim"]["sched"])
            torch.set_rng_state(state["optim"]["rng"])
            self.precision = state["optim"]["precision"]
            step = state["step"]
        else:
            self.precision = self._choose_precision(student, self._order(first_epoch)[0])
        scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        resumed_at, running = step, None
        t0 = time.perf_counter()
        if step < total:
            micro = self._micro_batches(first_epoch, step)
            while step < total:
                optim.zero_grad(set_to_none=True)
                step_loss = 0.0
                for _ in range(self.config.grad_accum):
                    with mp.autocast(self.precision, self.device.type):
                        loss = self.loss(student, self._collate(next(micro))) / self.config.grad_accum
                    (scaler.scale(loss) if scaler else loss).backward()
                    step_loss += loss.item()
                if scaler:
                    scaler.unscale_(optim)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                if scaler:
                    scaler.step(optim)
                    scaler.update()
                else:
                    optim.step()
                sched.step()
                step += 1
                running = step_loss if running is None else 0.95 * running + 0.05 * step_loss
                if progress is not None:
                    progress(step, running)
                if step % self.config.checkpoint_every == 0 and step < total:
                    save(step, {"optim": optim.state_dict(), "sched": sched.state_dict(),
                                "rng": torch.get_rng_state(), "precision": self.precision})
        if self.config.checkpointing:
            student.gradient_checkpointing_disable()
        student.eval().to("cpu")
        return {"steps": total, "loss": float(running or 0.0), "resumed_at": resumed_at,
                "seconds": round(time.perf_counter() - t0, 1)}


def training_device(requested: str) -> Any:
    """The torch device the student trains on: ``auto`` is CUDA when torch sees a GPU."""
    import torch

    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("distillation device 'cuda' asked for, but torch sees no CUDA GPU; use device 'cpu' or 'auto'.")
    return torch.device(requested)
