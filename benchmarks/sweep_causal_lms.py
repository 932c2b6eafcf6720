"""Every causal-LM class the installed transformers knows, through ``slimml convert`` as a user runs it.

For each model type (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), in a process of its own (inside a
cgroup v1 memory group with ``--cap``, as root): a tiny random model from the class's config with
small sizes, saved as a folder; ``slimml convert FOLDER -o ART`` (default exporter and task); then
8 greedy tokens through ``load(ART).generate`` against transformers' own ``generate``. One JSON
line per type: ``ok`` (tokens equal), ``mismatch``, ``refused`` (convert's one-line error),
``crash`` (a traceback), or ``config`` / ``build`` / ``too_big`` / ``killed`` where the generic small
config does not fit the class (``--override`` gives a type its own values, ``null`` drops one).

    python benchmarks/sweep_causal_lms.py --out sweep.jsonl [--types llama gpt2 ...] [--cap 5GB]
        [--override '{"glm": {"pad_token_id": 0}}']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=300, max_position_embeddings=128, n_embd=64, n_layer=2, n_head=4, d_model=64, num_layers=2,
             ffn_dim=128, head_dim=16)
PROMPT = [5, 9, 13, 21, 7, 30]


def one(model_type: str, folder: Path, override: dict) -> dict:
    """Build, convert and compare one model type (runs in its own process)."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    result: dict = {"type": model_type}
    small = {k: v for k, v in {**SMALL, **override}.items() if v is not None}
    try:
        config = AutoConfig.for_model(model_type, **small)
    except Exception as e:
        return {**result, "stage": "config", "msg": str(e)[:200]}
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        if sum(p.numel() for p in model.parameters()) > 3e7:
            return {**result, "stage": "too_big"}
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(folder / "hf")
    except Exception as e:
        return {**result, "stage": "build", "msg": str(e)[:200]}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "slimml", "convert", str(folder / "hf"), "-o", str(folder / "art")],
                          capture_output=True, text=True, timeout=600)
    result["convert_s"] = round(time.time() - start, 1)
    lines = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0:
        crashed = any("Traceback" in line for line in lines)
        return {**result, "stage": "crash" if crashed else "refused", "msg": (lines[-1] if lines else "")[:400]}
    from slimml.runtime import load

    art = load(folder / "art")
    try:
        mine = art.generate([PROMPT], max_new_tokens=8).tokens[0]
    finally:
        art.close()
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        ref = model.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))[0, len(PROMPT):]
    ref = ref.tolist()
    return {**result, "stage": "ok" if mine == ref else "mismatch", "mine": mine, "ref": ref}


def _cgroup(cap: str | None) -> Path | None:
    if not cap:
        return None
    from slimml.runtime.engine.budget import parse_bytes

    group = Path(f"/sys/fs/cgroup/memory/slimml-sweep-{os.getpid()}")
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(parse_bytes(cap)))
    return group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines, one a model type (appended)")
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--cap", help="a cgroup v1 memory limit for each type's process (as root), e.g. 5GB")
    parser.add_argument("--override", default="{}", help="JSON: model type -> config values (null drops one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = json.loads(os.environ.get("SLIMML_SWEEP_OVERRIDE", args.override))
    if args.one:
        print("RESULT " + json.dumps(one(args.one, Path(args.folder), overrides.get(args.one, {}))), flush=True)
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    group = _cgroup(args.cap)
    try:
        for model_type in args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            with tempfile.TemporaryDirectory() as tmp:
                enter = f"echo $$ > {group}/cgroup.procs; " if group else ""
                command = f"{enter}exec {sys.executable} {__file__} --one {model_type} --folder {tmp} --out -"
                try:
                    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1", "SLIMML_SWEEP_OVERRIDE": args.override})
                    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                    row = json.loads(lines[-1][7:]) if lines else {"type": model_type, "stage": "killed"}
                except subprocess.TimeoutExpired:
                    row = {"type": model_type, "stage": "killed", "msg": "over 900 s"}
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(model_type, row["stage"], row.get("msg", "")[:120], flush=True)
    finally:
        if group:
            group.rmdir()


if __name__ == "__main__":
    main()
