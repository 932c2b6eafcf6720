"""The engine: a chain of shards in, outputs out, on ONNX Runtime. It knows no task.

:class:`~.engine.Engine` (checked ``run``, ``run_trusted`` for feeds a task built) over an
execution plan (:mod:`.plan`) whose segments and weight sources keep the contracts declared in
:mod:`.contracts`; how to load is a :class:`~.config.LoadConfig`; every device question goes to
the device's backend (:mod:`.backends`: cpu, cuda). Also the memory budget (:mod:`.budget`), the
shard streamer and its weight sources (:mod:`.stream`, :mod:`.slots`, :mod:`.packed`,
:mod:`.cuda_slots`), steps (:mod:`.session`), merging (:mod:`.merge`) and feed checks
(:mod:`.feeds`). It imports only the artifact layer.
"""
