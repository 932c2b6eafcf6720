"""``slimml serve``: an artifact over HTTP on Ray Serve."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from slimml.cli.common import Artifact, app, err
from slimml.cli.options import Options, OptionValues, config_options
from slimml.serve.config import ServeConfig


@app.command("serve")
@config_options(serving=Options(ServeConfig))
def serve_(
    artifact: Artifact,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for other machines).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    address: Annotated[Optional[str], typer.Option(help="Ray cluster to join ('auto' after `ray start`); default: a local Ray.")] = None,
    direct_ingress: Annotated[bool, typer.Option("--direct-ingress", help="One replica answers HTTP on --port itself, without Serve's proxy in between (Ray Serve's direct ingress): 0.87-0.90x of in-process encode at 32 texts a request on 2 cores, against 0.73x through the proxy. A replica that crashes leaves the port refusing connections until Serve's replacement listens (seconds to a minute, as Serve notices).")] = False,
    serving: OptionValues = None,
):
    """Serve an artifact over HTTP on Ray Serve (needs the serve extra); Ctrl-C or SIGTERM stops it."""
    from slimml.scale.cluster import require_ray
    from slimml.serve import serve

    require_ray()
    serving.values["api_key"] = serving["api_key"] or None  # an empty SLIMML_API_KEY is no key
    config = serving.build(artifact=str(artifact))
    serve(config, host=host, port=port, address=address, direct_ingress=direct_ingress,
          ready=lambda url: err.print(f"serving {artifact} at {url} (POST /v1/embeddings, /v1/chat/completions, "
                                      "/v1/completions, /v1/rerank, /v1/entities, /v1/answer, /v1/classify, "
                                      "/v1/audio/transcriptions, /v1/responses, /v1/generate or /v1/run, as the model allows; GET /health, "
                                      "/v1/models); Ctrl-C stops"))
