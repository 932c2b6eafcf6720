"""Run an artifact's shards across machines: pipeline stages as Ray actors (``pip install slimml[serve]``).

Example:
    >>> from slimml.scale import pipeline
    >>> model = pipeline("artifacts/all-MiniLM-L6-v2", stages=2, address="auto")
    >>> model.encode(["A man is playing a guitar."]).shape
    (1, 384)
"""

from __future__ import annotations

from slimml.scale.balance import split_stages
from slimml.scale.pipeline import pipeline

__all__ = ["pipeline", "split_stages"]
