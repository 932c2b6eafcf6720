"""CUDA weight slots: a streamed shard's weights copied to the GPU ahead of its turn.

:class:`CudaSlots` keeps the slot contract of :class:`~slimml.runtime.engine.slots.FedSlots`
(:class:`~slimml.runtime.engine.contracts.WeightSource`: ``compile`` once with the weights as
graph inputs, ``fill`` on the loader thread, ``Slot.release`` after the shard ran). Its ``fill`` copies the shard's whole data file to device
memory in one transfer, while the previous shard computes. The slot then hands out
:class:`DeviceWeight` records: each weight is bound to the session through IOBinding at the
device buffer's address plus the weight's offset in the file, so no weight is copied again.

Device buffers come from ONNX Runtime's CUDA allocator, an arena: a released slot's memory is
reused by the next fill, so at most K shards' weights sit on the GPU at once.

The host side decides the transfer's speed. A copy from pageable memory (a mapped file) runs at
a fraction of the link's (8-12 GB/s against 54 on an H100's PCIe 5 link), because the driver
stages it through small pinned buffers of its own. Where ``cuda-python`` is installed
(``pip install slimml[gpu]``):

- **pinned once**: when the machine's free memory holds the streamed shards 1.5 times over (a
  small GPU in a large host, the common case), each shard's data file is mapped once and its
  pages locked (``cudaHostRegister``, read-only) on first use, and every later transfer runs at
  the link's speed, with no host copy;
- **staged**: otherwise each shard is copied by several threads into one page-locked staging
  buffer, allocated once at the largest shard's size, and sent from there; the host keeps only
  that buffer and the page cache the kernel may drop.

Without cuda-python, transfers run from the mapped files (pageable).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from slimml.runtime.engine.budget import available_memory
from slimml.runtime.engine.slots import FedSlots, Slot

log = logging.getLogger("slimml")
_COPY_THREADS = 4


@dataclass(frozen=True, slots=True)
class DeviceWeight:
    """A weight already in device memory: ``address`` is a CUDA pointer valid while its slot is
    held. The CUDA backend binds it in place (``IOBinding.bind_input`` at that address)."""

    address: int
    dtype: np.dtype
    shape: tuple[int, ...]


class _DeviceBuffers:
    """What backs a CUDA slot's weights; ``close`` hands the memory back to ORT's arena."""

    def __init__(self, values: list):
        self.values = values

    def close(self) -> None:
        self.values = []


class CudaSlots(FedSlots):
    """Weights fed as graph inputs from device buffers, filled by the loader thread.

    ``host``: ``"auto"`` (pinned once if memory allows, else staged), ``"pinned"``, ``"staged"``
    or ``"pageable"``; default the class's ``host``. ``host_mode`` says what was chosen once the
    first shard streamed in. ``backend`` is the CUDA backend: it copies to the device.
    """

    how = "weights copied to device slots and bound in place"
    kind = "device slots"
    host = "auto"

    def __init__(self, *args, host: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.host_mode = host or type(self).host
        self._chosen = False
        self._rt = None
        self._mapped: dict[int, np.ndarray] = {}  # pinned once: shard -> its locked mapping
        self._staging: np.ndarray | None = None
        self._pool: ThreadPoolExecutor | None = None

    def fill(self, index: int) -> Slot:
        shard = self.manifest.shards[index]
        if shard.data is None or not self.specs[index]:
            return Slot(index, {}, 0)
        if not self._chosen:
            self._choose_host()
        self._recheck(shard.data)  # a file changed since it was hashed is hashed again, or refused
        if self.host_mode == "pinned":
            flat = self._mapped.get(index)
            if flat is None:
                flat = self._mapped[index] = self._map_locked(index)
            return self._to_device(index, flat)
        mm = self._map_checked(index)
        try:
            return self._to_device(index, self._stage(np.frombuffer(mm, dtype=np.uint8)))
        finally:
            try:
                mm.close()
            except BufferError:  # a view still referenced: unmapped when it goes
                pass

    def _to_device(self, index: int, flat: np.ndarray) -> Slot:
        buffer = self.backend.to_device(flat)  # one transfer
        base, values, weights = buffer.data_ptr(), [buffer], {}
        for w in self.specs[index]:
            if w.offset % max(w.dtype.itemsize, 4) == 0:
                weights[w.name] = DeviceWeight(base + w.offset, w.dtype, w.shape)
            else:  # misaligned in the file: a buffer of its own
                raw = np.ascontiguousarray(flat[w.offset: w.offset + w.nbytes]).view(w.dtype).reshape(w.shape)
                values.append(self.backend.to_device(raw))
                weights[w.name] = values[-1]
        return Slot(index, weights, int(flat.size), _DeviceBuffers(values))

    def _choose_host(self) -> None:
        """Pick how shards reach the GPU, once (the first fill)."""
        wanted, self._rt, self._chosen = self.host_mode, _cudart(), True
        if self._rt is None or wanted == "pageable":
            self.host_mode = "pageable"
            return
        streamed = sum(self.entries[s.data].bytes for s in self.manifest.shards if s.data)
        if wanted == "auto":
            wanted = "pinned" if available_memory() >= 1.5 * streamed else "staged"
        if wanted == "staged":
            largest = max(self.entries[s.data].bytes for s in self.manifest.shards if s.data)
            self._staging = _page_locked(self._rt, largest)
            if self._staging is None:
                wanted = "pageable"
            else:
                self._pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="slimml-stage")
        self.host_mode = wanted

    def _map_locked(self, index: int) -> np.ndarray:
        """The shard's data file mapped read-only for the model's lifetime, its pages locked."""
        flat = np.frombuffer(self._map_checked(index), dtype=np.uint8)
        rt = self._rt
        (err,) = rt.cudaHostRegister(flat.ctypes.data, flat.size, rt.cudaHostRegisterReadOnly)
        if err == rt.cudaError_t.cudaSuccess:
            weakref.finalize(flat, rt.cudaHostUnregister, flat.ctypes.data)
        else:  # locked-memory limits (ulimit -l): this shard goes pageable
            log.warning("slimml: %s streams from pageable memory: its pages could not be locked (%s)",
                        self.manifest.shards[index].data, err)
        return flat

    def _stage(self, flat: np.ndarray) -> np.ndarray:
        """``flat`` copied into the page-locked staging buffer, or ``flat`` itself where there is none."""
        if self._staging is None or flat.size > self._staging.size:
            return flat
        stage, step = self._staging[:flat.size], -(-flat.size // _COPY_THREADS)
        list(self._pool.map(lambda i: np.copyto(stage[i: i + step], flat[i: i + step]),
                            range(0, flat.size, step)))  # numpy copies without the GIL
        return stage


def _cudart():
    """cuda-python's runtime module, or None where it is not installed."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python before 12.6
        except ImportError:
            log.info("slimml: install cuda-python (pip install slimml[gpu]) to stream weights at the link's speed")
            return None
    return runtime


def _page_locked(rt, nbytes: int) -> np.ndarray | None:
    """``nbytes`` of page-locked host memory as a numpy array (freed with it); None if refused."""
    err, ptr = rt.cudaMallocHost(nbytes)
    if err != rt.cudaError_t.cudaSuccess:
        log.warning("slimml: streaming through pageable memory: %d bytes of page-locked memory were refused (%s)",
                    nbytes, err)
        return None
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(ptr)))
    weakref.finalize(array, rt.cudaFreeHost, ptr)
    return array
