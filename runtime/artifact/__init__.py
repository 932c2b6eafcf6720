"""The artifact: the on-disk format that convert and quantize write and the runtime and serve read.

The manifest's fields and their validation (:mod:`.manifest`), the file and shard checks
(:mod:`.integrity`), the watch that refuses files changed after load (:mod:`.watch`) and the one
atomic writer (:mod:`.atomic`). This layer imports nothing else of slimml but its errors.
"""
