"""From live tensors to what the daemon maps: BufferMemory messages and the descriptors that
go with them. Nothing is copied: each buffer is the tensor's own memory.

- CPU tensors must live in a `SharedArena` (refit.shm): the arena's memfd travels once, and
  every tensor in it is an offset.
- CUDA tensors in legacy allocations travel as IPC handles plus offsets; in CUDA VMM memory as
  ranges of physical allocations whose descriptors travel (refit.cuda). Tensors that share a
  range (PyTorch's expandable segments map many tensors into one) share its descriptors.
"""
import os
from typing import Any, Dict, List, Sequence, Tuple

from refit import dtypes, shm
from refit._proto import refit_pb2
from refit.errors import ExportError  # re-exported

Device = Tuple[str, Any]  # ("cuda", index) or ("cpu", None)
Pairs = Sequence[Tuple[str, Any]]  # (buffer name, tensor), in the layout's order


def describe(t: Any) -> Tuple[int, int, Device]:
    """(address, nbytes, device) of a torch tensor or numpy array."""
    if dtypes.is_torch(t):
        nbytes = t.numel() * t.element_size()
        dev = t.device
        return t.data_ptr(), nbytes, (dev.type, dev.index)
    import numpy
    if isinstance(t, numpy.ndarray):
        return t.__array_interface__["data"][0], t.nbytes, ("cpu", None)
    raise ExportError(f"a {type(t).__name__} is not a tensor: pass torch tensors or numpy arrays")


def is_contiguous(t: Any) -> bool:
    if dtypes.is_torch(t):
        return t.is_contiguous()
    return t.flags["C_CONTIGUOUS"]


class Exported:
    """The memory of a worker's buffers: one BufferMemory each, the descriptors to hand over,
    the VMM ranges, and the GPU (by UUID) when they are on one."""

    def __init__(self) -> None:
        self.memory: List[Any] = []
        self.fds: List[int] = []          # owned here; close() closes them
        self.owned_fds: List[int] = []    # of those, the ones this module opened (VMM exports, dup'd memfds)
        self.vmm_ranges: List[Any] = []
        self.gpu_uuid = ""
        self._arena_fd_index: Dict[int, int] = {}

    def close(self) -> None:
        for fd in self.owned_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.owned_fds = []
        self.fds = []

    def _add_fd(self, fd: int, owned: bool) -> int:
        self.fds.append(fd)
        if owned:
            self.owned_fds.append(fd)
        return len(self.fds) - 1


def export_buffers(buffers: Pairs) -> Exported:
    """`buffers`: (name, tensor) pairs in the layout's order. Returns an Exported; on error,
    closes whatever it opened and raises ExportError naming the buffer."""
    out = Exported()
    try:
        cuda = [(n, t) for n, t in buffers if describe(t)[2][0] == "cuda"]
        host = [(n, t) for n, t in buffers if describe(t)[2][0] == "cpu"]
        other = [(n, t) for n, t in buffers if describe(t)[2][0] not in ("cuda", "cpu")]
        if other:
            raise ExportError(f"buffer {other[0][0]!r} is on {describe(other[0][1])[2][0]}, neither "
                              "a CUDA GPU nor host memory")
        if cuda and host:
            raise ExportError(f"buffer {cuda[0][0]!r} is on a GPU and {host[0][0]!r} in host memory: "
                              "a worker's buffers are all on one GPU or all on the host")
        devices = {describe(t)[2][1] for _, t in cuda}
        if len(devices) > 1:
            raise ExportError(f"the buffers are on CUDA devices {sorted(devices)}: a worker holds one "
                              "GPU's memory (register one worker per GPU)")
        if cuda:
            _export_cuda(out, buffers, devices.pop())
        else:
            _export_host(out, buffers)
        return out
    except BaseException:
        out.close()
        raise


def _export_host(out: Exported, buffers: Pairs) -> None:
    outside = [name for name, t in buffers
               if shm.find_arena(describe(t)[0], max(describe(t)[1], 1))[0] is None]
    if outside:
        raise ExportError(
            f"{len(outside)} CPU tensor(s) outside refit's shared memory, which the daemon cannot "
            f"reach: {', '.join(repr(n) for n in outside[:5])}{'...' if len(outside) > 5 else ''}. "
            "Allocate them with refit.SharedArena(...).empty(shape, dtype), or move the module's "
            "parameters there once with refit.share_module_(module)")
    for name, t in buffers:
        address, nbytes, _ = describe(t)
        arena, offset = shm.find_arena(address, max(nbytes, 1))
        assert arena is not None and offset is not None  # every buffer was found in one above
        if arena.fd < 0:
            raise ExportError(f"buffer {name!r} lives in a SharedArena that was closed")
        key = id(arena)
        if key not in out._arena_fd_index:
            out._arena_fd_index[key] = out._add_fd(arena.fd, owned=False)
        m = refit_pb2.BufferMemory()
        m.shm.name = ""
        m.shm.offset = offset
        m.shm.size = arena.nbytes
        m.shm.fd = out._arena_fd_index[key] + 1
        out.memory.append(m)


def _export_cuda(out: Exported, buffers: Pairs, device_index: int) -> None:
    from refit import cuda
    out.gpu_uuid = cuda.device_uuid(device_index)
    kinds: Dict[str, str] = {}
    for name, t in buffers:
        address, nbytes, _ = describe(t)
        kinds[name] = cuda.classify(address, max(nbytes, 1), device_index, f"buffer {name!r}")
    # VMM: the union of the buffers' byte ranges, rounded out to whole physical allocations,
    # exported once per allocation however many buffers it holds.
    vmm = sorted((describe(t)[0], describe(t)[0] + max(describe(t)[1], 1), name)
                 for name, t in buffers if kinds[name] == "vmm")
    ranges: List[Any] = []  # [start, end, chunks]
    chunk_of: Dict[int, Tuple[int, int]] = {}
    for start, end, name in vmm:
        if ranges and start < ranges[-1][1]:
            if end > ranges[-1][1]:
                more = cuda.export_vmm_chunks(ranges[-1][1], end, device_index, f"buffer {name!r}")
                _own(out, more)
                ranges[-1][2].extend(more)
                ranges[-1][1] = more[-1].address + more[-1].size
            continue
        chunks = cuda.export_vmm_chunks(start, end, device_index, f"buffer {name!r}")
        _own(out, chunks)
        first = chunks[0].address
        last = chunks[-1].address + chunks[-1].size
        if ranges and ranges[-1][1] == first:  # adjacent allocations: one range
            ranges[-1][2].extend(chunks)
            ranges[-1][1] = last
        else:
            ranges.append([first, last, chunks])
    for i, (first, last, chunks) in enumerate(ranges):
        r = refit_pb2.VmmRange()
        r.chunk_bytes.extend(c.size for c in chunks)
        r.first_fd = len(out.fds)
        r.gpu_uuid = out.gpu_uuid
        for c in chunks:
            out._add_fd(c.fd, owned=False)  # already owned (_own)
        out.vmm_ranges.append(r)
        chunk_of[i] = (first, last)
    for name, t in buffers:
        address, nbytes, _ = describe(t)
        m = refit_pb2.BufferMemory()
        if kinds[name] == "ipc":
            e = cuda.export_ipc(address, max(nbytes, 1), device_index, f"buffer {name!r}")
            m.cuda_ipc.handle = e.handle
            m.cuda_ipc.offset = e.offset
            m.cuda_ipc.size = e.size
            m.cuda_ipc.gpu_uuid = e.gpu_uuid
        else:
            for i, (first, last) in chunk_of.items():
                if first <= address < last:
                    m.cuda_vmm.range = i
                    m.cuda_vmm.offset = address - first
                    break
        out.memory.append(m)


def _own(out: Exported, chunks: Sequence[Any]) -> None:
    # Until they are added to `out.fds`, the chunks' descriptors are tracked for cleanup only.
    out.owned_fds.extend(c.fd for c in chunks)
