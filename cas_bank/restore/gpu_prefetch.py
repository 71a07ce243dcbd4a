"""Restored arrays moved to the GPU in one go, on MLX's CUDA build.

On CUDA a restore fills arrays made on MLX's CPU stream, which MLX allocates in unified
(managed) memory, through their CPU pointers (`arrays.fill_stream`): their pages are
then on the host. Left there, the first forward pass reads them on the GPU by page
faults, the driver moving a few pages at a time: on an H200 the first token after a
reopened restore came at 0.80x mlx-lm's file at medium-qwen3 4k, whose load lands in
device memory (benchmarks/RESULTS.md, "MLX's CUDA build"). `prefetch` asks the CUDA
driver to move them all at once (`cuMemPrefetchAsync`), at the link's speed, and waits
until they are there: the restore then hands out arrays already on the GPU.

Through the driver library MLX itself loads (`libcuda.so.1`, with ctypes): MLX links
the CUDA runtime statically, so there is no runtime library of its to call. The moves
go on the legacy default stream and the call waits for them; MLX's streams are
non-blocking, so MLX's own work neither waits for them nor holds them up. Best
effort: where the driver, the call or the memory does not allow it (no managed memory
on this system: MLX uses pinned host memory instead), the first failure is logged and
turns it off for the bank (each bank has its own `GpuPrefetch`, in its
`cas_bank.restore.resources.Resources`); a restore never fails for it. `CAS_BANK_GPU_PREFETCH=0`
turns it off. The driver library, loaded once, is the process's (MLX's own context).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence

from cas_bank import arrays

log = logging.getLogger("cas_bank")

PREFETCH_ENV = "CAS_BANK_GPU_PREFETCH"
"""Set to `0`: restored arrays stay where the CPU filled them (the GPU faults them in)."""

_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


class _Location(ctypes.Structure):
    """CUmemLocation: where `cuMemPrefetchAsync_v2` moves the pages."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Driver:
    """The few CUDA driver calls a prefetch makes, on device `ordinal`."""

    def __init__(self, lib: ctypes.CDLL, ordinal: int) -> None:
        self.lib = lib
        self.ordinal = ordinal
        self.device = ctypes.c_int()
        self._check(lib.cuInit(0), "cuInit")
        self._check(lib.cuDeviceGet(ctypes.byref(self.device), ordinal), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), self.device),
            "cuDevicePrimaryCtxRetain",
        )
        self._v2 = getattr(lib, "cuMemPrefetchAsync_v2", None)
        if self._v2 is not None:
            self._v2.argtypes = [
                ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p,
            ]  # fmt: skip
        else:  # a driver before CUDA 12.2: (pointer, bytes, device, stream)
            lib.cuMemPrefetchAsync.argtypes = [
                ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
            ]  # fmt: skip

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise OSError(f"{call} returned CUDA error {code}")

    def prefetch(self, runs: Sequence[tuple[int, int]]) -> None:
        """Move each (address, bytes) run to the device and wait until they are there."""
        lib = self.lib
        # The calling thread may never have made a CUDA call: MLX's primary context.
        self._check(lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        where = _Location(_LOCATION_DEVICE, self.ordinal)
        for address, size in runs:
            if self._v2 is not None:
                code = self._v2(address, size, where, 0, None)
            else:
                code = lib.cuMemPrefetchAsync(address, size, self.device, None)
            self._check(code, "cuMemPrefetchAsync")
        self._check(lib.cuStreamSynchronize(None), "cuStreamSynchronize")


@functools.cache
def _driver() -> _Driver | None:
    """The driver on MLX's default GPU; None where it cannot be loaded (logged)."""
    import mlx.core as mx

    # MLX's Device shows its index only in its repr: "Device(gpu, 0)".
    found = re.search(r"(\d+)\)$", repr(mx.default_device()))
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"), int(found.group(1)) if found else 0)
    except (OSError, AttributeError) as e:
        log.warning("cas_bank: restored arrays stay in host memory (no CUDA prefetch): %s", e)
        return None


class GpuPrefetch:
    """One bank's prefetch of restored arrays: on until it fails once (logged)."""

    def __init__(self) -> None:
        self.failed = False
        self._lock = threading.Lock()

    def prefetcher(self) -> Callable[[Sequence[tuple[int, int]]], None] | None:
        """`prefetch` where it applies (MLX's CUDA build, not turned off), else None."""
        if self.failed or os.environ.get(PREFETCH_ENV, "") == "0":
            return None
        return self.prefetch if arrays.mlx_backend() == "cuda" else None

    def prefetch(self, runs: Sequence[tuple[int, int]]) -> None:
        """Move the (address, bytes) runs of unified memory to MLX's GPU, waiting for
        them; nothing once a prefetch failed here, or the driver could not be loaded
        (the first failure is logged; `prefetcher` then answers None)."""
        driver = None if self.failed else _driver()
        if driver is None:
            self.failed = True
            return
        if not runs:
            return
        try:
            with self._lock:
                driver.prefetch(runs)
        except OSError as e:
            self.failed = True
            log.warning("cas_bank: CUDA prefetch of restored arrays turned off: %s", e)
