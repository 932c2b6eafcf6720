"""The engine's two contracts, declared: what a plan segment is, and what a weight source is.

An :class:`~slimml.runtime.engine.plan.ExecutionPlan` walks a list of :class:`Segment` objects:
:class:`~slimml.runtime.engine.plan.ResidentSegment`, :class:`~slimml.runtime.engine.plan.StreamedSegment`
and :class:`slimml.scale.segment.RayStages` (pipeline stages on Ray actors) implement it. A
streamed segment's weights come from a :class:`WeightSource`:
:class:`~slimml.runtime.engine.slots.FedSlots`, :class:`~slimml.runtime.engine.packed.PackedSlots`
and :class:`~slimml.runtime.engine.cuda_slots.CudaSlots` implement that. Both are structural
(:class:`typing.Protocol`): a class conforms by having the members, and the plan checks each
segment once, when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import onnxruntime as ort

    from slimml.runtime.engine.slots import Slot
    from slimml.runtime.engine.stream import Streamer


@runtime_checkable
class Segment(Protocol):
    """Consecutive shards of a plan, made ready to run once (at load) and then only run."""

    kind: str  # "resident", "streamed", "ray stages": for describe and for readers
    shards: list[int]  # the shard indices it runs, in order

    @property
    def sessions(self) -> int:
        """ONNX Runtime sessions (or stage actors) it holds."""
        ...

    def run(self, env: dict[str, Any], streamer: Streamer | None) -> None:
        """Run its shards on the activations in ``env`` and update it in place; a streamed
        segment takes its weights from ``streamer`` (None for a plan with nothing streamed)."""
        ...

    def describe(self) -> str:
        """One line (or a few, indented) for ``plan.describe()``."""
        ...

    def check_files(self, deep: bool = False) -> None:
        """Check the files it owns itself (``deep``: re-hash them). Segments whose files the
        engine loaded and watches do nothing here."""
        ...

    def close(self) -> None:
        """Drop its sessions, stop what it started (actors); idempotent."""
        ...


@runtime_checkable
class WeightSource(Protocol):
    """Where a streamed shard's weights come from: a session compiled once per shard, and slots
    filled on the loader thread (:mod:`slimml.runtime.engine.stream`) and released after use."""

    how: str  # what a fill does, in words, for describe
    kind: str  # "fed", "pre-packed", "device slots": what a bench baseline records
    names: dict[int, dict[str, str]]  # shard -> its names -> its session's, where shards share one session

    def compile(self, index: int, threads: int | None, spinning: bool) -> ort.InferenceSession:
        """Shard ``index``'s session, opened once at load; shards of one layer type may share it.

        Raises:
            ArtifactError: the shard cannot stream this way.
        """
        ...

    def fill(self, index: int) -> Slot:
        """Shard ``index``'s weights made ready to feed (on the loader thread); the caller
        releases the slot once the shard has run.

        Raises:
            IntegrityError: a file that changed since load no longer matches its hash.
        """
        ...

    def check_cache(self, deep: bool = False) -> None:
        """Check the files this source made for itself beside the artifact (the pre-packed cache);
        ``deep`` re-hashes them. Nothing for a source that reads only the artifact's files.

        Raises:
            IntegrityError: a cached file no longer matches the hash recorded when it was written.
        """
        ...
