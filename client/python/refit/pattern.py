"""The test pattern of plan/verify.h, in NumPy: a value for every element of every tensor (a
function of the tensor's name, the element's index and a seed), so that a source filled here and
a destination checked by C++ (or the reverse) agree bit for bit, and poison (0xA5) for bytes
nobody should write. Used by the tests and by anyone checking a refit end to end.
"""
from typing import Any, List, Mapping, Sequence, Tuple

import numpy as np

from refit import dtypes

POISON = 0xA5
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: Any) -> Any:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_name(name: str) -> int:
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def values(name: str, linear: Any, dtype: Any, seed: int) -> Any:
    """The raw values (as unsigned integers of the dtype's size) of elements `linear` (an int64
    array of row-major indices into the whole tensor) of tensor `name`."""
    size = dtypes.ELEMENT_BYTES[dtypes.canonical(dtype)]
    with np.errstate(over="ignore"):
        h = _splitmix64(np.uint64(hash_name(name)) ^ _splitmix64(np.uint64(seed) + linear.astype(np.uint64)))
    storage = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    v = (h & np.uint64((1 << (8 * size)) - 1 if size < 8 else 0xFFFFFFFFFFFFFFFF)).astype(storage)
    poison = storage(int.from_bytes(bytes([POISON]) * size, "little"))
    return np.where(v == poison, v ^ storage(1), v)


def _box(box: Any, shape: Sequence[int]) -> Tuple[List[int], List[int]]:
    origin = list(box.origin) if box is not None and len(box.origin) else [0] * len(shape)
    extent = list(box.shape) if box is not None and len(box.shape) else list(shape)
    return origin, extent


def _flat_indices(origin: Sequence[int], extent: Sequence[int], shape: List[int]) -> Any:
    """Row-major linear indices, into an array of `shape`, of the box's elements in order."""
    if not shape:
        return np.zeros(1, dtype=np.int64)
    grids = np.meshgrid(*[np.arange(o, o + e, dtype=np.int64) for o, e in zip(origin, extent)], indexing="ij")
    return np.ravel_multi_index([g.ravel() for g in grids], shape).astype(np.int64)


def buffer_view(tensor: Any, nbytes: int) -> Any:
    """The bytes of a live tensor or array, as a writable uint8 NumPy array (CPU memory)."""
    if dtypes.is_torch(tensor):
        import torch
        return tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else np.zeros(0, np.uint8)
    return tensor.reshape(-1).view(np.uint8)


def piece_positions(piece: Any, tensor_shape: Sequence[int], buffer_shape: Sequence[int]) -> Tuple[Any, Any]:
    """(tensor linear indices, buffer element indices) of a piece, matched in row-major order."""
    t_origin, t_extent = _box(piece.tensor_box if piece.HasField("tensor_box") else None, tensor_shape)
    b_origin, b_extent = _box(piece.buffer_box if piece.HasField("buffer_box") else None, buffer_shape)
    return (_flat_indices(t_origin, t_extent, list(tensor_shape)),
            _flat_indices(b_origin, b_extent, list(buffer_shape)))


def fill(worker: Any, specs: Sequence[Any], tensors: Mapping[str, Any], seed: int) -> None:
    """Writes every piece of `worker` (a refit.v1.Worker) into its live CPU tensors (buffer
    name -> tensor) with the pattern of `seed`."""
    shapes = {t.name: list(t.shape) for t in specs}
    for b in worker.buffers:
        raw = buffer_view(tensors[b.name], 0)
        size = dtypes.ELEMENT_BYTES[dtypes.canonical(b.dtype)]
        elems = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
        for p in b.pieces:
            linear, at = piece_positions(p, shapes[p.tensor], list(b.shape))
            elems[at] = values(p.tensor, linear, b.dtype, seed)


def poison(tensors: Mapping[str, Any]) -> None:
    for t in tensors.values():
        buffer_view(t, 0)[:] = POISON


def check(worker: Any, specs: Sequence[Any], tensors: Mapping[str, Any], seed: int) -> int:
    """Checks every byte of `worker`'s buffers: pieces hold the pattern of `seed`, every other
    byte is still poison. Returns the number of elements checked; raises AssertionError naming
    the buffer, tensor and first wrong element."""
    shapes = {t.name: list(t.shape) for t in specs}
    checked = 0
    for b in worker.buffers:
        raw = buffer_view(tensors[b.name], 0)
        size = dtypes.ELEMENT_BYTES[dtypes.canonical(b.dtype)]
        elems = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
        covered = np.zeros(elems.shape[0], dtype=bool)
        for p in b.pieces:
            linear, at = piece_positions(p, shapes[p.tensor], list(b.shape))
            want = values(p.tensor, linear, b.dtype, seed)
            bad = np.nonzero(elems[at] != want)[0]
            if bad.size:
                i = bad[0]
                raise AssertionError(f"buffer {b.name!r}: tensor {p.tensor!r} element {int(linear[i])} is "
                                     f"{int(elems[at][i]):#x}, expected {int(want[i]):#x} ({bad.size} wrong)")
            covered[at] = True
            checked += at.size
        stray = np.nonzero(~covered)[0]
        if stray.size:
            rest = raw.reshape(-1, size)[stray]
            if (rest != POISON).any():
                j = stray[np.nonzero((rest != POISON).any(axis=1))[0][0]]
                raise AssertionError(f"buffer {b.name!r}: element {int(j)} outside every piece was written")
    return checked
