"""``slimml info``: an artifact's manifest as a table, after checking its files."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from slimml.cli.common import Artifact, AsJson, app, console


@app.command()
def info(artifact: Artifact, as_json: AsJson = False,
         verify: Annotated[bool, typer.Option("--verify", help="Hash every file against the manifest (else: each file "
                                                               "there, of its recorded size).")] = False):
    """Show an artifact's manifest as a table (after checking its files are there, and with --verify, intact)."""
    from slimml.runtime.artifact.files import check_present, verify_files
    from slimml.runtime.artifact.manifest import read_manifest, tensor_list
    from slimml.runtime.tasks.registry import kind_of, registered

    m = read_manifest(artifact)
    if verify:  # IntegrityError: one line, exit 1
        verify_files(artifact, m)
    else:
        check_present(artifact, m)
    if as_json:
        print(json.dumps(m.to_json(), indent=2))
        return
    console.print(Text(m.name, style="bold") + Text(f"  task={m.task}  format v{m.format_version}  slimml {m.slimml_version}"))
    kind = kind_of(m)  # what load() will make of it, without loading
    methods = sorted(registered()[kind].methods)
    console.print(f"runs as: {kind} ({', '.join(f'{n}()' for n in methods) + ', ' if methods else ''}run())")
    console.print("steps: " + " -> ".join(s.get("step", "?") for s in m.steps))
    if m.components:
        console.print("components: " + ", ".join(f"{n} ({len(c.shards)} shards)" for n, c in m.components.items()))
    if m.labels is not None:
        console.print(f"labels ({len(m.labels)}): " + ", ".join(m.labels[:10]) + (", ..." if len(m.labels) > 10 else ""))
    for name, part in (m.components or {None: m}).items():
        if name is not None:
            console.print(Text(f"component {name}", style="bold"))
        console.print("inputs: " + tensor_list(part.inputs))
        console.print("outputs: " + tensor_list(part.outputs))
        if part.pooling is not None:
            p = part.pooling
            steps = [f"{p.mode} of {p.output}" if p.mode != "none" else f"{p.output} (pooled by the model)", *(f"projection ({d['activation']})" for d in p.dense),
                     *(["normalized"] if p.normalize else []), *([f"first {p.truncate_dim} values"] if p.truncate_dim else [])]
            console.print("pooling: " + " -> ".join(steps) + (f"; prompts: {', '.join(p.prompts)}" if p.prompts else ""))
        table = Table("shard", "file", "MB", "layers", "inputs from", "outputs")
        for s in part.shards:
            size = sum(f.bytes for f in m.files if f.path in (s.file, s.data))
            sources = sorted({"model" if t.source == "input" else f"shard {t.source}" for t in s.inputs})
            table.add_row(str(s.index), s.file, f"{size / 1e6:.1f}", ", ".join(x.rsplit("/", 1)[-1] for x in s.layers),
                          ", ".join(sources), str(len(s.outputs)))
        console.print(table)
    state = "each hashed against the manifest" if verify else "each of its recorded size (--verify hashes them)"
    console.print(f"total {m.total_bytes / 1e6:.1f} MB in {len(m.files)} files, {state}; checks: {m.checks}")


