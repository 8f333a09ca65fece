"""Host shared memory that the daemon maps: how CPU tensors are registered live.

A `SharedArena` is one anonymous memory file (memfd) cut into tensors. The daemon maps it once,
from its file descriptor (handed over the daemon's handle socket, never by name), and reads and
writes the tensors in place. The file is sealed against shrinking, so no process can truncate it
under the daemon's mapping (which would kill the daemon with SIGBUS).

    arena = refit.SharedArena(1 << 30)
    w = arena.empty((4096, 4096), "bf16")      # a torch tensor (numpy array without torch)
    refit.share_module_(model)                   # or: move a CPU module's parameters into one
"""
import bisect
import fcntl
import mmap
import os
import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from refit import dtypes
from refit.errors import ArenaFull, InvalidArgument

_ALIGN = 256  # every tensor aligned for any element type and for the daemon's 16-byte copies

# Arenas by address range, so that any tensor (or a view inside one) finds the arena it lives in.
_lock = threading.Lock()
_starts: List[int] = []                # sorted start addresses
_arenas: Dict[int, "SharedArena"] = {}  # start -> arena


class SharedArena:
    """An anonymous, sealed shared-memory file of `nbytes`, mapped here, cut into tensors."""

    def __init__(self, nbytes: int, name: str = "refit-arena") -> None:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise InvalidArgument(f"a shared arena needs a positive size, not {nbytes}")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.nbytes = nbytes
        self._used = 0
        import ctypes
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        with _lock:
            bisect.insort(_starts, self.address)
            _arenas[self.address] = self

    def _take(self, nbytes: int) -> int:
        start = (self._used + _ALIGN - 1) // _ALIGN * _ALIGN
        if start + nbytes > self.nbytes:
            raise ArenaFull(f"shared arena of {self.nbytes} bytes is full: {nbytes} more bytes "
                              f"do not fit after {self._used} (make a larger SharedArena)")
        self._used = start + nbytes
        return start

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """A new tensor of `shape` and refit/torch dtype `dtype` in this arena (uninitialised)."""
        shape = tuple(int(s) for s in shape)
        name = dtypes.canonical(dtype)
        count = 1
        for s in shape:
            count *= s
        nbytes = count * dtypes.ELEMENT_BYTES[name]
        offset = self._take(max(nbytes, 1))
        if dtypes.have_torch():
            import torch
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=max(nbytes, 1), offset=offset)
            if name in ("fp8_e4m3", "fp8_e5m2", "e8m0"):
                try:
                    dtypes.torch_dtype(name)
                except ValueError:  # a PyTorch without this float8 dtype: held as its bytes
                    return flat[:nbytes].view(shape)
            return flat[:nbytes].view(dtypes.torch_dtype(name)).view(shape)
        import numpy
        return numpy.frombuffer(self._map, dtype=dtypes.numpy_storage(name), count=count,
                                offset=offset).reshape(shape)

    def locate(self, address: int, nbytes: int) -> Optional[int]:
        """The offset of [address, address + nbytes) in this arena, or None if it is not inside."""
        if address < self.address or address + nbytes > self.address + self.nbytes:
            return None
        return address - self.address

    def close(self) -> None:
        """Forget the arena here (tensors cut from it must no longer be used)."""
        with _lock:
            if self.address in _arenas:
                del _arenas[self.address]
                _starts.remove(self.address)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def find_arena(address: int, nbytes: int) -> Tuple[Optional[SharedArena], Optional[int]]:
    """(arena, offset) holding [address, address + nbytes), or (None, None)."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None, None
        arena = _arenas[_starts[i]]
    offset = arena.locate(address, nbytes)
    return (arena, offset) if offset is not None else (None, None)


def arena_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of a SharedArena that holds tensors like `tensors` (torch tensors or NumPy arrays),
    each aligned as `empty` aligns it: `SharedArena(arena_bytes(params))`."""
    def nbytes(t: Any) -> int:
        return int(t.numel() * t.element_size()) if dtypes.is_torch(t) else int(t.nbytes)
    return sum(nbytes(t) + _ALIGN for t in tensors) + _ALIGN


def share_module_(module: Any, arena: Optional[SharedArena] = None) -> SharedArena:
    """Moves every CPU parameter and buffer of a torch module into one shared arena, in place
    (`param.data` is replaced; the module's code is unchanged). One copy, at setup; from then on
    the daemon reads and writes the module's live tensors. Returns the arena."""
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.device.type == "cpu"]
    arena = arena or SharedArena(arena_bytes(tensors))
    seen: Dict[Any, Any] = {}
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen:  # tied weights stay tied
            t.data = seen[key]
            continue
        if str(t.dtype) == "torch.uint8":  # fp8 codes held as bytes: copied as bytes, never cast
            shared = arena.empty(tuple(t.shape), "int8").view(t.dtype)
        else:
            shared = arena.empty(tuple(t.shape), t.dtype)
        shared.copy_(t.data)
        seen[key] = shared
        t.data = shared
    return arena
