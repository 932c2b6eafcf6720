"""``slimml eval``: an embedding model's STS score, or a language model's perplexity, gated on a baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from slimml.cli.common import Artifact, AsJson, BaselineIn, BaselineOut, Progress, app, console
from slimml.cli.gate import GATE_PAIRS, GATE_TOKENS, counted, log, refuse_ungated, with_baseline
from slimml.cli.options import Options, OptionValues, config_options
from slimml.errors import ConfigError
from slimml.runtime.engine.config import LoadConfig
from slimml.runtime.tasks.limits import a_or_an


@app.command("eval")
@config_options(loading=Options(LoadConfig, only=("device",)))
def eval_(
    artifact: Artifact,
    data: Annotated[Path, typer.Option(help="An embedding model: a CSV with sentence1,sentence2,score (STS style). "
                                            "A language model: a UTF-8 text file, scored by perplexity.")],
    loading: OptionValues = None,
    batch_size: Annotated[Optional[int], typer.Option(help="An embedding model: sentences per batch (default 32).", show_default=False)] = None,
    window: Annotated[Optional[int], typer.Option(help="A language model: tokens a scored window holds (default 512, at most its context).", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="A language model: tokens of the text scored at most (default 32768).", show_default=False)] = None,
    progress: Progress = False,
    baseline: BaselineIn = None,
    save_baseline: BaselineOut = None,
    max_accuracy_drop: Annotated[Optional[float], typer.Option(help="An embedding model: points (x100) the score may fall below --baseline. [default: 0.1]", show_default=False)] = None,
    max_perplexity_increase: Annotated[Optional[float], typer.Option(help="A language model: percent its perplexity may rise above --baseline. [default: 0.1]", show_default=False)] = None,
    as_json: AsJson = False,
):
    """Spearman x100 of cosine similarity against gold scores (STS benchmark style); for a language
    model, its perplexity on a text."""
    from slimml.runtime import load, read_manifest
    from slimml.runtime.tools.baseline import Baseline, Tolerances
    from slimml.runtime.tools.evaluate import evaluate_perplexity, evaluate_sts, read_sts, read_text

    old = Baseline.load(baseline) if baseline else None  # a missing baseline fails before the model runs
    if save_baseline is not None:
        Baseline.check_writable(save_baseline, data, kind="eval")
    refuse_ungated({"--max-accuracy-drop": max_accuracy_drop, "--max-perplexity-increase": max_perplexity_increase},
                   gated=baseline is not None)
    task = str(read_manifest(artifact).task)
    language = task.startswith("text-generation")
    if language and max_accuracy_drop is not None or not language and max_perplexity_increase is not None:
        raise ConfigError("--max-accuracy-drop gates an embedding model's Spearman score and --max-perplexity-increase "
                          f"a language model's perplexity; this artifact ({task}) is gated by "
                          f"{'--max-perplexity-increase' if language else '--max-accuracy-drop'}.")
    tol = Tolerances(accuracy_drop=0.1 if max_accuracy_drop is None else max_accuracy_drop,
                     perplexity_increase_pct=0.1 if max_perplexity_increase is None else max_perplexity_increase)
    if not language and "encode" not in _methods(artifact):  # before its data is read as STS pairs
        raise ConfigError(f"slimml eval scores sentence-embedding models (Spearman on STS pairs) and language models "
                          f"(perplexity); {artifact} is {a_or_an(task)} model. Score it on your labelled data through the "
                          "Python API (docs/runtime.md), and gate its speed with slimml bench.")
    read_text(data) if language else read_sts(data)  # a bad data file fails before the model loads
    metric = "perplexity" if language else "spearman"
    if old is not None and old.kind == "eval" and old.settings.get("metric", metric) != metric:
        raise ConfigError(f"the baseline {baseline} holds {old.settings['metric']}, and this artifact is scored by {metric}; "
                          "compare with a baseline saved from this kind of model (--save-baseline).")
    for name, value, low in (("--window", window, 2), ("--max-tokens", max_tokens, 2), ("--batch-size", batch_size, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be at least {low}, got {value}.")
    if language and (batch_size is not None or progress):
        raise ConfigError(f"{'--batch-size' if batch_size is not None else '--progress'} is for embedding models (STS "
                          "pairs); a language model is scored one window at a time: drop it.")
    if not language and (window is not None or max_tokens is not None):
        raise ConfigError("--window and --max-tokens are for language models (perplexity); drop them.")
    if old is not None:  # other data or another window: refused before the model runs, not after
        from slimml.runtime.artifact.files import sha256_file
        from slimml.runtime.tools.baseline import check_settings

        if language and window is None and isinstance(old.settings.get("window"), int):
            window = old.settings["window"]  # measured as the baseline was
        if language and max_tokens is None and isinstance(old.settings.get("max_tokens"), int):
            max_tokens = old.settings["max_tokens"]
        if not language and batch_size is None and isinstance(old.settings.get("batch_size"), int):
            batch_size = old.settings["batch_size"]
        early = {"metric": metric, "data": data.name, "data_sha256": sha256_file(data),
                 **({"window": window} if language and window is not None else {}),
                 **({"max_tokens": max_tokens} if language and max_tokens is not None else {}),
                 **({} if language else {"batch_size": batch_size or 32})}
        check_settings(old, "eval", early)
    model = load(artifact, loading.build())
    if language:
        result = evaluate_perplexity(model, data, window=window, max_tokens=max_tokens)
        said = (f"perplexity = {result.score:.4f} on {counted(result.count, 'token')} ({data.name}, "
                f"{counted(result.settings['windows'], 'window')} of up to {result.settings['window']} tokens)")
        if result.count < GATE_TOKENS and (baseline is not None or save_baseline is not None):
            log.warning("slimml: a gate scored on only %s: a perplexity on so few moves with chance more than with the "
                        "model; give a text of %d tokens or more (a few thousand is better).", counted(result.count, "token"),
                        GATE_TOKENS)
    else:
        result = evaluate_sts(model, data, batch_size=batch_size or 32, show_progress=progress)
        said = f"{result.metric} x100 = {result.score:.2f} on {counted(result.count, 'pair')} ({data.name})"
        if result.count < GATE_PAIRS and (baseline is not None or save_baseline is not None):
            log.warning("slimml: a gate scored on only %s: a Spearman score on so few moves by whole points with one pair's "
                        "rank; give %d pairs or more (STSb's dev split has 1,500).", counted(result.count, "pair"), GATE_PAIRS)
    now = Baseline.from_eval(result, str(artifact), data)
    if as_json:
        with_baseline(result.to_json(), now, old, baseline, save_baseline, tol)
    else:
        console.print(said)
        with_baseline(None, now, old, baseline, save_baseline, tol)


def _methods(artifact: Path) -> frozenset[str]:
    """The task methods ``load(artifact)`` would offer, read from its manifest without loading it."""
    from slimml.runtime.artifact.manifest import read_manifest
    from slimml.runtime.tasks.registry import kind_of, registered

    return frozenset(registered()[kind_of(read_manifest(artifact))].methods)
