"""Read a Hugging Face folder's weights one tensor at a time (safetensors), never the whole model.

Used where the model may be bigger than memory: the layer-by-layer export of a big decoder and the
student that starts from a few of its teacher's layers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slimml.errors import SourceError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def has_safetensors(folder: Path) -> bool:
    return (folder / SINGLE).is_file() or (folder / INDEX).is_file()


def weight_bytes(folder: Path) -> int:
    """Bytes of the folder's weight files (safetensors or not)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())


class SafetensorsReader:
    """Tensors of a (possibly sharded) safetensors checkpoint by name, read on demand.

    Example:
        >>> reader = SafetensorsReader(folder)
        >>> q = reader.torch("model.layers.7.self_attn.q_proj.weight")  # one tensor in memory
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():
            weight_map = json.loads((self.folder / INDEX).read_text())["weight_map"]
        elif (self.folder / SINGLE).is_file():
            weight_map = {name: SINGLE for name in self._keys(self.folder / SINGLE)}
        else:
            raise SourceError(
                f"{self.folder} has no model.safetensors; reading a model tensor by tensor needs safetensors weights. "
                "Save the model with save_pretrained(..., safe_serialization=True)."
            )
        self.files = weight_map
        self._open: dict[str, Any] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def torch(self, name: str) -> Any:
        """The tensor ``name`` as stored (its own dtype)."""
        from safetensors import safe_open

        file = self.files.get(name)
        if file is None:
            raise SourceError(f"{self.folder} has no weight named {name!r}; the weights do not match config.json: re-save or re-download the model.")
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
        return self._open[file].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
        return list(self._open[file].get_slice(name).get_shape())

    def numpy32(self, name: str) -> Any:
        """The tensor ``name`` as a float32 numpy array (bf16 and fp16 checkpoints are widened)."""
        import torch

        return self.torch(name).to(torch.float32).numpy()


class PlainSafetensors:
    """The tensors of every ``*.safetensors`` file in a folder, read one at a time as float32 numpy
    arrays with plain reads (no mmap, no torch), each read dropped from the page cache after it.

    For a checkpoint bigger than memory: mapped pages stay charged to the reader's memory cgroup
    until the kernel reclaims them under pressure, and a conversion that also writes as much
    fights that reclaim (measured: killed at 2.9 GB in a 3 GB cgroup, docs/convert.md).

    Example:
        >>> w = PlainSafetensors(folder)
        >>> q = w["model.layers.7.self_attn.q_proj.weight"]  # (out, in) float32
    """

    def __init__(self, folder: Path):
        self.index: dict[str, tuple[Path, str, list[int], int, int]] = {}  # name -> file, dtype, shape, start, end
        for path in sorted(Path(folder).glob("*.safetensors")):
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                try:
                    header = json.loads(f.read(size))
                except ValueError:
                    raise SourceError(f"{path} is not a safetensors file (its header is not JSON); save the model "
                                      "again with save_pretrained(..., safe_serialization=True).") from None
            for name, info in header.items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    self.index[name] = (path, info["dtype"], list(info["shape"]), 8 + size + begin, 8 + size + end)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> list[int]:
        return list(self.index[name][2])

    def __getitem__(self, name: str) -> Any:
        return self.part(name)

    def part(self, name: str, index: int | None = None) -> Any:
        """Tensor ``name`` as float32, or only its ``index``-th slice along the first axis (one expert of
        a stacked mixture: a contiguous run of the file, read without the rest)."""
        import numpy as np

        raw, dtype, shape = self._read(name, index)
        if dtype == "BF16":  # the high half of a float32
            wide = np.zeros(raw.size // 2, np.uint32)
            wide[:] = raw.view(np.uint16)
            return (wide << 16).view(np.float32).reshape(shape)
        kinds = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
        if dtype not in kinds:
            raise SourceError(f"{self.index[name][0]}: tensor {name!r} is {dtype}, not a float type slimml reads; save the "
                              "model in float32, float16 or bfloat16.")
        return raw.view(kinds[dtype]).astype(np.float32, copy=False).reshape(shape)

    def codes(self, name: str, index: int | None = None) -> Any:
        """Tensor ``name`` (or its ``index``-th slice) as the bytes it stores: uint8, for MXFP4 blocks and scales."""
        raw, dtype, shape = self._read(name, index)
        if dtype not in ("U8", "I8"):
            raise SourceError(f"{self.index[name][0]}: tensor {name!r} is {dtype}, where a quantized checkpoint stores "
                              "bytes (U8); the checkpoint does not match its quantization_config: download it again.")
        return raw.reshape(shape)

    def _read(self, name: str, index: int | None) -> tuple[Any, str, list[int]]:
        import numpy as np

        path, dtype, shape, start, end = self.index[name]
        if index is not None:  # the slice [index] of the first axis
            step = (end - start) // shape[0]
            start, end, shape = start + index * step, start + (index + 1) * step, shape[1:]
        raw = np.empty(end - start, np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            view, done = memoryview(raw), 0
            while done < len(raw):
                n = os.preadv(fd, [view[done:]], start + done)
                if n <= 0:
                    raise SourceError(f"{path} ends inside tensor {name!r}: the file is truncated; download it again.")
                done += n
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)  # read once: leave the cache to others
        finally:
            os.close(fd)
        return raw, dtype, shape


class TorchBinReader:
    """``pytorch_model.bin`` checkpoints, memory-mapped by ``torch.load(mmap=True)``: tensors are paged in
    as they are read, not all at once."""

    def __init__(self, folder: Path):
        import torch

        path = Path(folder) / "pytorch_model.bin"
        try:
            self.state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:
            raise SourceError(f"cannot read {path} ({type(e).__name__}); save the model with safetensors instead.") from None
        self.folder = Path(folder)

    def names(self) -> list[str]:
        return list(self.state)

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def torch(self, name: str) -> Any:
        return self.state[name]

    def shape(self, name: str) -> list[int]:
        return list(self.state[name].shape)


def numel(reader: SafetensorsReader | TorchBinReader, name: str) -> int:
    """Elements of tensor ``name``, from its shape (nothing is read)."""
    n = 1
    for d in reader.shape(name):
        n *= d
    return n


def open_weights(folder: Path) -> SafetensorsReader | TorchBinReader:
    """A tensor-by-tensor reader for the folder's checkpoint (safetensors, else pytorch_model.bin)."""
    folder = Path(folder)
    if has_safetensors(folder):
        return SafetensorsReader(folder)
    if (folder / "pytorch_model.bin").is_file():
        return TorchBinReader(folder)
    raise SourceError(f"{folder} has no model.safetensors or pytorch_model.bin; save the model with save_pretrained.")
