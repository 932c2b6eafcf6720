"""The artifact: the on-disk format that convert and quantize write and the runtime and serve read.

As gguf-py keeps its reader and writer side by side, so does this package:

- :mod:`.records`: the manifest's records (tokenizer, preprocessor, pooling, zero_shot, seq2seq),
  each declared once with its JSON form and its checks; the assets each component uses.
- :mod:`.manifest`: :class:`Manifest` (chains of shards, files, records), reading and validating
  ``manifest.json`` (versions 1 to 3).
- :mod:`.files`: the files it lists: paths kept inside the folder, sizes and sha256, and the checks
  that each is there, is the one hashed, and was not swapped after load.
- :mod:`.writer`: :class:`ArtifactWriter`, the only way an artifact is written (atomic folder,
  chains, assets, shared weight files, hashes, manifest last), over :mod:`.atomic` and :mod:`.share`.
- :mod:`.integrity` (what a shard file may reference) and :mod:`.watch` (files changed after load).

This layer imports nothing else of slimml but its errors.
"""
