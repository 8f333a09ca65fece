"""Exporting live CUDA tensors to the daemon, through the CUDA driver API (ctypes on libcuda).

Two kinds of memory, both found from the tensor's own address (nothing is copied):
- legacy allocations (cudaMalloc: PyTorch's caching allocator by default): the CUDA IPC handle
  of the allocation that holds the tensor, and the tensor's offset from its base;
- CUDA VMM memory (cuMemCreate: PyTorch's `expandable_segments:True`, vLLM's sleep mode,
  SGLang's memory saver): one range of the worker's address space, made of physical
  allocations mapped back to back; each is exported as a POSIX file descriptor
  (cuMemExportToShareableHandle) and handed to the daemon, which maps them into its own
  address space.
GPUs are named by UUID, never by this process's CUDA index (workers run under
CUDA_VISIBLE_DEVICES).
"""
import contextlib
import ctypes
import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from refit.errors import ExportError

CUDA_SUCCESS = 0
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
CU_MEMORYTYPE_DEVICE = 2
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

NOT_SHAREABLE = (
    "the CUDA VMM allocation holding {what} was not created shareable as a POSIX file descriptor, "
    "so no other process can map it. With PyTorch, set PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True in a PyTorch that requests CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
    "(2.2 and later do), or start the worker with expandable_segments:False; with your own "
    "cuMemCreate, add CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR to prop.requestedHandleTypes")


class CudaExportError(ExportError, RuntimeError):
    """The CUDA driver cannot export a tensor's memory (or is not there): the message says why."""


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaExportError(f"the CUDA driver (libcuda.so.1) is not loadable: {e}") from e
        self._check(self.lib.cuInit(0), "cuInit")

    def fn(self, *names: str) -> Any:
        for n in names:
            f = getattr(self.lib, n, None)
            if f is not None:
                return f
        raise CudaExportError(f"the CUDA driver lacks {names[0]}")

    def call(self, what: str, names: Sequence[str], *args: Any) -> int:
        r = self.fn(*names)(*args)
        return r

    def _check(self, r: int, what: str) -> None:
        if r != CUDA_SUCCESS:
            raise CudaExportError(f"{what} failed: {self.error_string(r)}")

    def error_string(self, r: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorString(r, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return f"{s.value.decode()} (CUDA error {r})"
        return f"CUDA error {r}"

    def check(self, what: str, names: Sequence[str], *args: Any) -> None:
        self._check(self.call(what, names, *args), what)

    def attribute(self, attribute: int, address: int, ctype: Any = ctypes.c_int) -> Optional[int]:
        v = ctype()
        r = self.call("cuPointerGetAttribute", ["cuPointerGetAttribute"], ctypes.byref(v),
                      ctypes.c_int(attribute), ctypes.c_uint64(address))
        return v.value if r == CUDA_SUCCESS else None

    def address_range(self, address: int) -> Tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check("cuMemGetAddressRange", ["cuMemGetAddressRange_v2", "cuMemGetAddressRange"],
                   ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
        return base.value, size.value

    def device_uuid(self, ordinal: int) -> str:
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ["cuDeviceGet"], ctypes.byref(dev), ctypes.c_int(ordinal))
        raw = (ctypes.c_ubyte * 16)()
        self.check("cuDeviceGetUuid", ["cuDeviceGetUuid_v2", "cuDeviceGetUuid"], raw, dev)
        h = bytes(raw).hex()
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_driver: Optional[_Driver] = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def device_uuid(ordinal: int) -> str:
    """The UUID ("GPU-...") of this process's CUDA device `ordinal`, as nvidia-smi -L prints it."""
    return driver().device_uuid(ordinal)


class IpcExport:
    """A legacy allocation: its 64-byte IPC handle, size, and the tensor's offset in it."""

    def __init__(self, handle: bytes, offset: int, size: int, gpu_uuid: str) -> None:
        self.handle, self.offset, self.size, self.gpu_uuid = handle, offset, size, gpu_uuid


class VmmChunk:
    def __init__(self, address: int, size: int, fd: int) -> None:
        self.address, self.size, self.fd = address, size, fd


@contextlib.contextmanager
def _current_context_for(device_index: int) -> Iterator[None]:
    """The device's primary context (the one PyTorch's runtime uses) current on this thread for the
    block, then the thread's own again. Pushed through the driver: a thread that never used CUDA
    has no current context, and torch.cuda.device(i) makes none current when i is already the
    thread's device (an engine's worker threads: "invalid device context")."""
    d = driver()
    dev = ctypes.c_int()
    d.check("cuDeviceGet", ["cuDeviceGet"], ctypes.byref(dev), ctypes.c_int(device_index))
    ctx = ctypes.c_void_p()
    d.check("cuDevicePrimaryCtxRetain", ["cuDevicePrimaryCtxRetain"], ctypes.byref(ctx), dev)
    try:
        d.check("cuCtxPushCurrent", ["cuCtxPushCurrent_v2", "cuCtxPushCurrent"], ctx)
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            d.call("cuCtxPopCurrent", ["cuCtxPopCurrent_v2", "cuCtxPopCurrent"], ctypes.byref(popped))
    finally:
        d.call("cuDevicePrimaryCtxRelease", ["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"], dev)


def classify(address: int, nbytes: int, device_index: int, what: str) -> str:
    """"ipc" or "vmm" for the memory holding [address, address + nbytes)."""
    d = driver()
    with _current_context_for(device_index):
        mem_type = d.attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
        if mem_type != CU_MEMORYTYPE_DEVICE:
            raise CudaExportError(f"{what} is not in device memory (managed or host memory cannot "
                                  "be shared with the daemon)")
        if d.attribute(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, address):
            return "ipc"
        handle = ctypes.c_uint64()
        r = d.call("cuMemRetainAllocationHandle", ["cuMemRetainAllocationHandle"], ctypes.byref(handle),
                   ctypes.c_void_p(address))
        if r == CUDA_SUCCESS:
            d.call("cuMemRelease", ["cuMemRelease"], handle)
            return "vmm"
        raise CudaExportError(f"{what}: its memory is neither a legacy CUDA allocation nor CUDA VMM "
                              f"memory ({d.error_string(r)}); refit cannot share it")


def export_ipc(address: int, nbytes: int, device_index: int, what: str) -> IpcExport:
    d = driver()
    with _current_context_for(device_index):
        base, size = d.address_range(address)
        if address + nbytes > base + size:
            raise CudaExportError(f"{what} runs past the end of its allocation")
        handle = (ctypes.c_char * 64)()
        d.check(f"cuIpcGetMemHandle ({what})", ["cuIpcGetMemHandle"], handle, ctypes.c_uint64(base))
        return IpcExport(bytes(handle), address - base, size, d.device_uuid(device_index))


def export_vmm_chunks(start: int, end: int, device_index: int, what: str) -> List[VmmChunk]:
    """File descriptors of the physical allocations mapped over [start, end), in address order.
    The caller owns (and closes) the descriptors."""
    d = driver()
    chunks: List[VmmChunk] = []
    with _current_context_for(device_index):
        try:
            a = start
            while a < end:
                base, size = d.address_range(a)
                if not base <= a < base + size:
                    raise CudaExportError(f"{what}: the driver gave a range [{base:#x}, +{size}) that "
                                          f"does not hold address {a:#x}")
                allowed = d.attribute(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, a, ctypes.c_uint64)
                if allowed is not None and not allowed & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
                    raise CudaExportError(NOT_SHAREABLE.format(what=what))
                handle = ctypes.c_uint64()
                d.check(f"cuMemRetainAllocationHandle ({what})", ["cuMemRetainAllocationHandle"],
                        ctypes.byref(handle), ctypes.c_void_p(a))
                fd = ctypes.c_int(-1)
                r = d.call("cuMemExportToShareableHandle", ["cuMemExportToShareableHandle"],
                           ctypes.byref(fd), handle, ctypes.c_int(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                           ctypes.c_uint64(0))
                d.call("cuMemRelease", ["cuMemRelease"], handle)
                if r != CUDA_SUCCESS:
                    raise CudaExportError(NOT_SHAREABLE.format(what=what) + f" ({d.error_string(r)})")
                chunks.append(VmmChunk(base, size, fd.value))
                a = base + size
        except BaseException:
            import os
            for c in chunks:
                os.close(c.fd)
            raise
    return chunks
