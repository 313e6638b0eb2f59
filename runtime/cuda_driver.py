"""The few CUDA driver calls the runtime makes itself, through ``ctypes`` on ``libcuda.so.1``.

TVM's tensor copies take no stream and wait for the device after each copy. Three runtime paths need copies
that do not: the offloaded experts' copy stream (``expert_cache.CudaStreamCopies``), the step inputs copied while
the previous decode step still runs, and the token ids read back without waiting for the steps enqueued after
them (``engine``). ``CudaDriver`` gives them asynchronous copies between page-locked host memory and device
tensors on a stream, events, and page-locked host arrays. TVM's runtime keeps its own kernels on its current
stream (``launch_stream``: the legacy default stream unless set otherwise), so copies enqueued there are ordered
with the kernels before and after them.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from ..compiler.errors import MoecError

NOT_READY = 600  # CUDA_ERROR_NOT_READY
_EVENT_DISABLE_TIMING = 0x2
_HOST_ALLOC_PORTABLE = 0x1


def stream_handle(value) -> int:
    """A stream handle from TVM's FFI as an integer: an int, a pointer object, or the pointer's bytes (little endian,
    as ``runtime.get_cuda_stream`` returns it on the GPU machine's TVM)."""
    if value is None:
        return 0
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(bytes(value), "little")
    if hasattr(value, "value"):
        return int(value.value or 0)
    return int(value)


def launch_stream() -> int:
    """The stream TVM launches its kernels on (0: the legacy default stream)."""
    import tvm_ffi

    current = tvm_ffi.get_global_func("runtime.get_cuda_stream", allow_missing=True)
    return stream_handle(current()) if current is not None else 0


class CudaDriver:
    """``libcuda.so.1`` with the signatures the runtime uses; ``what`` names the runtime feature in errors."""

    def __init__(self, device_index: int, what: str) -> None:
        self.index, self.what = device_index, what
        try:
            cu = self.cu = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise MoecError(f"{what} on CUDA need the CUDA driver library (libcuda.so.1): {exc}") from None
        vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
        cu.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, sz, vp]
        cu.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, sz, vp]
        cu.cuStreamQuery.argtypes = [vp]
        cu.cuStreamSynchronize.argtypes = [vp]
        cu.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        cu.cuEventRecord.argtypes = [vp, vp]
        cu.cuEventSynchronize.argtypes = [vp]
        cu.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        cu.cuEventDestroy_v2.argtypes = [vp]
        cu.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_uint]
        cu.cuMemFreeHost.argtypes = [vp]
        cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        cu.cuCtxSetCurrent.argtypes = [vp]
        cu.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        cu.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, rc: int, call: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(msg))
            raise MoecError(f"{self.what}: {call} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def bind(self) -> None:
        """The driver calls need the device's primary context current on this thread (TVM's runtime calls make it
        current; bind it here if none is)."""
        ctx = ctypes.c_void_p()
        self.check(self.cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.cu.cuDeviceGet(ctypes.byref(dev), self.index), "cuDeviceGet")
            self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def htod(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.cu.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def dtoh(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.cu.cuMemcpyDtoHAsync_v2(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def stream_ready(self, stream: int) -> bool:
        rc = self.cu.cuStreamQuery(stream)
        if rc == NOT_READY:
            return False
        self.check(rc, "cuStreamQuery")
        return True

    def stream_synchronize(self, stream: int) -> None:
        self.check(self.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def event(self, owner, timing: bool = False) -> int:
        """A new event (with ``timing``, one ``elapsed`` can measure), destroyed when ``owner`` is collected."""
        self.bind()
        ev = ctypes.c_void_p()
        self.check(self.cu.cuEventCreate(ctypes.byref(ev), 0 if timing else _EVENT_DISABLE_TIMING), "cuEventCreate")
        weakref.finalize(owner, self.cu.cuEventDestroy_v2, ev.value)
        return ev.value

    def elapsed(self, start: int, end: int) -> float:
        """Seconds between two completed timing events."""
        ms = ctypes.c_float()
        self.check(self.cu.cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return ms.value * 1e-3

    def record(self, event: int, stream: int) -> None:
        self.check(self.cu.cuEventRecord(event, stream), "cuEventRecord")

    def wait_event(self, event: int) -> None:
        self.check(self.cu.cuEventSynchronize(event), "cuEventSynchronize")

    def pinned(self, nbytes: int, owner) -> tuple[np.ndarray, int]:
        """A page-locked host byte array of ``nbytes`` (and its address), freed when ``owner`` is collected."""
        self.bind()
        ptr = ctypes.c_void_p()
        self.check(self.cu.cuMemHostAlloc(ctypes.byref(ptr), max(nbytes, 1), _HOST_ALLOC_PORTABLE), "cuMemHostAlloc")
        weakref.finalize(owner, self.cu.cuMemFreeHost, ptr.value)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr.value))
        return arr, ptr.value


class PinnedStages:
    """Page-locked host buffers used in turn (``count``), each with an event recorded after the copy that used it:
    ``take(nbytes)`` waits until the next buffer's last copy has run, then hands it out (grown to the next power of
    two when too small, once every buffer's copy has run). The caller enqueues its copy and ``record``s the event."""

    def __init__(self, driver: CudaDriver, count: int = 2) -> None:
        self._drv, self._count, self._cap, self._turn, self._bufs = driver, count, 0, 0, []

    def take(self, nbytes: int) -> tuple[np.ndarray, int, int]:
        """``(host bytes, their address, event)`` of the next buffer, at least ``nbytes`` long."""
        drv = self._drv
        drv.bind()
        if nbytes > self._cap:
            for _, _, ev in self._bufs:  # the old buffers' copies must have run before their memory goes
                drv.wait_event(ev)
            self._cap = 1 << max(0, nbytes - 1).bit_length()
            self._bufs = [(*drv.pinned(self._cap, self), drv.event(self)) for _ in range(self._count)]
        buf = self._bufs[self._turn]
        self._turn = (self._turn + 1) % self._count
        drv.wait_event(buf[2])  # at once unless the host is ``count`` copies ahead of the device
        return buf


__all__ = ["CudaDriver", "NOT_READY", "PinnedStages", "launch_stream", "stream_handle"]
