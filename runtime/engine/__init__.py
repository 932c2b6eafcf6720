"""The engine: a chain of shards in, outputs out, on ONNX Runtime. It knows no task.

The execution plan and its segments (:mod:`.plan`), the memory budget (:mod:`.budget`), the
shard streamer and its weight sources (:mod:`.stream`, :mod:`.slots`, :mod:`.packed`,
:mod:`.cuda_slots`), sessions (:mod:`.session`), merging (:mod:`.merge`) and feed checks
(:mod:`.feeds`). It imports only the artifact layer.
"""
