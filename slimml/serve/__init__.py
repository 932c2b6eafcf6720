"""Serve an artifact over HTTP on Ray Serve (``pip install slimml[serve]``).

Example:
    >>> from slimml.serve import ServeConfig, serve
    >>> serve(ServeConfig("artifacts/all-MiniLM-L6-v2", replicas=2), host="127.0.0.1", port=8000)

The application itself is ``slimml.serve.app:build``, for ``serve run`` and config YAMLs.
"""

from __future__ import annotations

from slimml.serve.config import ServeConfig
from slimml.serve.run import serve

__all__ = ["ServeConfig", "serve"]
