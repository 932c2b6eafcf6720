"""``slimml bench``: latency, throughput, memory and size of an artifact, a K,P sweep, and the gates on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from slimml.cli.common import Artifact, AsJson, BaselineIn, BaselineOut, app, console
from slimml.cli.gate import GATE_RUNS, counted, log, refuse_ungated, with_baseline
from slimml.cli.options import Options, OptionValues, config_options
from slimml.errors import ConfigError, SlimmlError
from slimml.runtime.engine.config import LoadConfig


@app.command()
@config_options(loading=Options(LoadConfig, only=("device", "resident", "prefetch", "memory_budget", "pin", "pack", "cache_dir")))
def bench(
    artifact: Artifact,
    batch: Annotated[int, typer.Option(help="Batch size.")] = 1,
    seq: Annotated[Optional[int], typer.Option(help="Sequence length for dynamic axes (default 128, or a model's most tokens where fewer; with --baseline, the baseline's).", show_default=False)] = None,
    runs: Annotated[int, typer.Option(help="Timed runs.")] = 50,
    loading: OptionValues = None,
    baseline: BaselineIn = None,
    save_baseline: BaselineOut = None,
    max_latency_increase: Annotated[Optional[float], typer.Option(help="Percent the p50 latency may rise above --baseline (or --against). [default: 50]", show_default=False)] = None,
    max_size_increase: Annotated[Optional[float], typer.Option(help="Percent the model size may grow above --baseline (or --against). [default: 1]", show_default=False)] = None,
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="Try every K,P: e.g. '2,3,4' or '2,3,4:0,1' (K values:P values).")] = None,
    sweep_out: Annotated[Path, typer.Option("--sweep-out", help="Folder for the sweep's table, CSV and PNG plot.")] = Path("sweep"),
    component: Annotated[Optional[str], typer.Option("--component", help="For an artifact of components: the one to time (default: each).")] = None,
    against: Annotated[Optional[Path], typer.Option("--against", help="A reference artifact timed alternately with this one in this run; exit 3 if this one's p50 is past --max-latency-increase of it (steadier than a saved --baseline on a shared machine).", show_default=False)] = None,
    as_json: AsJson = False,
):
    """Latency p50/p90, throughput, peak RSS and size of an artifact; streaming counters; a K,P sweep."""
    device, pin = loading["device"], loading["pin"]
    from slimml.runtime import load
    from slimml.runtime.tools.baseline import Baseline, Tolerances, check_settings
    from slimml.runtime.tools.bench import bench as do_bench, latency_settings, model_identity, shape_words

    for flag, value, most in (("--batch", batch, (1 << 31) - 1), ("--seq", seq, (1 << 31) - 1), ("--runs", runs, 1 << 20)):
        if value is not None and not 1 <= value <= most:
            raise SlimmlError(f"{flag} must be a whole number from 1 to {most:,}, got {value}.")
    refuse_ungated({"--max-latency-increase": max_latency_increase, "--max-size-increase": max_size_increase},
                   gated=baseline is not None or against is not None, against=True)
    asked = seq is not None  # else 128, or fewer for a model that takes fewer tokens (CLIP's text: 77)
    tol = Tolerances(**{k: v for k, v in (("latency_increase_pct", max_latency_increase),
                                          ("size_increase_pct", max_size_increase)) if v is not None})
    if sweep is not None and (baseline is not None or save_baseline is not None or against is not None):
        raise ConfigError("--sweep times many K,P plans and a gate one: drop --baseline/--save-baseline/--against, "
                          "or --sweep (then give the plan to gate with --resident/--prefetch or --memory-budget).")
    if against is not None and baseline is not None:
        raise ConfigError("--against gates on a reference timed in this run, --baseline on a run saved before: give one "
                          "of them.")
    if against is not None and save_baseline is not None:
        raise ConfigError("--save-baseline saves this run to gate later ones with --baseline, and a run with --against "
                          "is timed beside its reference (their figures hold for that pair alone): save it in a run of "
                          "its own, without --against.")
    if (baseline is not None or against is not None or save_baseline is not None) and runs < GATE_RUNS:
        log.warning("slimml: a latency gate on %s is noise on a shared machine (one burst of load decides it); give "
                    "--runs %d or more.", counted(runs, "timed run"), GATE_RUNS)
    old = Baseline.load(baseline) if baseline else None
    if save_baseline is not None:
        Baseline.check_writable(save_baseline, kind="bench")
    if old is not None:  # other settings fail before the timing runs
        from slimml.runtime.engine.backends import resolve_device

        if not asked and isinstance(old.settings.get("seq"), int):
            seq, asked = old.settings["seq"], True  # measured as the baseline was

        check_settings(old, "bench", {"batch": batch, "seq": seq or 128, "device": resolve_device(device),
                                      "component": component})  # None: the whole of a one-chain artifact
    if sweep is not None:
        from slimml.runtime.tools.sweep import sweep as do_sweep

        ks, _, ps = sweep.partition(":")
        try:
            k_values = [int(x) for x in ks.split(",") if x.strip()]
            p_values = [int(x) for x in ps.split(",") if x.strip()] or None
        except ValueError:
            raise SlimmlError(f"--sweep {sweep!r} is not 'K,K,...' or 'K,K,...:P,P,...' (whole numbers).") from None
        for flag in ("memory_budget", "resident", "prefetch"):
            if loading[flag] is not None:
                raise ConfigError(f"--sweep times every K,P it is given, and --{flag.replace('_', '-')} picks one: drop "
                                  "one of them.")
        result = do_sweep(artifact, k_values, p_values, sweep_out, device=device, batch=batch, seq=seq or 128, runs=runs,
                          pin=pin, pack=loading["pack"], cache_dir=loading["cache_dir"])
        if as_json:
            print(json.dumps({"rows": result.rows, "table": str(result.table), "plot": str(result.plot) if result.plot else None,
                              "skipped": result.skipped}))
            return
        console.print(result.table.read_text())
        if result.skipped:
            console.print(f"skipped: {'; '.join(result.skipped)}")
        console.print(f"wrote {result.table}, {result.csv}" + (f", {result.plot}" if result.plot else
                      " (no plot: pip install 'slimml[bench]' for matplotlib)"))
        return
    model = load(artifact, loading.build())
    parts = model.parts
    if parts:  # several graphs: each is timed on its own sample inputs
        if component is None:
            if old is not None or save_baseline is not None or against is not None:
                raise ConfigError(f"{artifact} has components {', '.join(parts)}; a gate is for one: add --component NAME.")
            seqs = {name: _seq_for(part, seq, asked, name) for name, part in parts.items()}
            results = {name: do_bench(part, batch=batch, seq=seqs[name], runs=runs) for name, part in parts.items()}
            if as_json:
                print(json.dumps({name: r.to_json() for name, r in results.items()}))
                return
            for name, r in results.items():
                shape = shape_words(parts[name].inputs, batch, seqs[name], parts[name].manifest.source)
                console.print(f"component {name}: {shape} on {device}: p50 {r.p50_ms:.2f} ms, "
                              f"p90 {r.p90_ms:.2f} ms, {r.throughput_per_s:.1f} items/s, model {r.model_mb:.1f} MB")
            return
        model = model.part(component)
    elif component is not None:
        raise SlimmlError(f"{artifact} is one chain of shards, without components; leave --component out.")
    seq = _seq_for(model, seq, asked, component)
    timed = {"component": component, **model_identity(model), **latency_settings(model)}
    if old is not None:  # another streaming plan or thread count: refused before the timing runs
        check_settings(old, "bench", timed)
    if not as_json:
        console.print(model.plan.describe(), highlight=False)
    if against is not None:
        _bench_against(model, against, loading.build(), component, batch, seq, runs, timed, tol, as_json)
        return
    result = do_bench(model, batch=batch, seq=seq, runs=runs)
    now = Baseline.from_bench(result, str(artifact), **timed)
    if as_json:
        with_baseline(result.to_json(), now, old, baseline, save_baseline, tol)
        return
    rate = f"{result.throughput_per_s:.1f} items/s"
    if str(model.manifest.task).startswith("text-generation"):  # a pass is a prefill of seq tokens a row
        rate = f"{result.throughput_per_s:.1f} prompts/s ({result.throughput_per_s * seq:.0f} prompt tokens/s prefilled)"
    console.print(
        f"{shape_words(model.inputs, batch, seq, model.manifest.source)} on {model.device}: p50 {result.p50_ms:.2f} ms, "
        f"p90 {result.p90_ms:.2f} ms, "
        f"{rate}, peak RSS {result.peak_rss_mb:.0f} MB, model {result.model_mb:.1f} MB"
    )
    if result.stream:
        st = result.stream
        console.print(
            f"per run: {st['bytes_per_run'] / 1e6:.1f} MB streamed in, {st['wait_s_per_run'] * 1e3:.1f} ms waiting on "
            f"loads, {st['compute_s_per_run'] * 1e3:.1f} ms computing; peak RSS during runs {result.run_peak_rss_mb:.0f} MB"
        )
    with_baseline(None, now, old, baseline, save_baseline, tol)


def _seq_for(model, seq: int | None, asked: bool, component: str | None) -> int:
    """The sequence length to time ``model`` at: ``--seq``, refused past the tokens the model takes;
    else 128, or the model's most tokens where fewer."""
    longest = model.max_sequence_length
    if longest is None or not any(t.name == "input_ids" for t in model.manifest.inputs):
        return seq or 128
    if not asked:
        return min(128, longest)
    if seq > longest:
        whose = f"component {component!r} takes" if component else "this model takes"
        raise ConfigError(f"--seq {seq} is past the {longest} tokens {whose}; give --seq {longest} or less.")
    return seq


def _bench_against(model, against: Path, config, component, batch, seq, runs, timed, tol, as_json) -> None:
    """``slimml bench ART --against REF``: the two timed alternately, ART gated on REF's p50 and size."""
    from slimml.runtime import load
    from slimml.runtime.tools.baseline import Baseline
    from slimml.runtime.tools.bench import bench_against, check_comparable, peak_rss_mb, shape_words

    try:
        reference = load(against, config)
    except SlimmlError as e:  # a budget or a damaged file: say which of the two artifacts it is about
        e.args = (f"the reference {against}: {e}", *e.args[1:])
        raise
    if component is not None:
        if component not in reference.parts:
            raise ConfigError(f"the reference {against} has no component {component!r}"
                              + (f" (it has {', '.join(reference.parts)})" if reference.parts else "")
                              + "; give a reference of the same model.")
        reference = reference.part(component)
    elif reference.parts:
        raise ConfigError(f"the reference {against} has components ({', '.join(reference.parts)}) and {model.folder} "
                          "has none; give a reference of the same model.")
    check_comparable(model, reference, str(against))
    longest = reference.max_sequence_length
    if longest is not None and seq > longest and any(t.name == "input_ids" for t in reference.manifest.inputs):
        raise ConfigError(f"--seq {seq} is past the {longest} tokens the reference {against} takes; give --seq {longest} "
                          "or less.")
    result, ref = bench_against(model, reference, batch=batch, seq=seq, runs=runs)
    now = Baseline.from_bench(result, str(model.folder), **timed)
    then = Baseline.from_bench(ref, str(against), **timed)
    source = f"{against}, timed alternately in this run"
    if as_json:
        both = {"reference": ref.to_json(), "process_peak_rss_mb": round(peak_rss_mb(), 1)}  # the two's, together
        with_baseline(result.to_json() | both, now, then, source, None, tol)
        return
    for who, r in (("this artifact", result), ("the reference", ref)):
        console.print(f"{who}: {shape_words(model.inputs, batch, seq, model.manifest.source)} on {model.device}: "
                      f"p50 {r.p50_ms:.2f} ms, p90 {r.p90_ms:.2f} ms, "
                      f"model {r.model_mb:.1f} MB", highlight=False)
    with_baseline(None, now, then, source, None, tol)
