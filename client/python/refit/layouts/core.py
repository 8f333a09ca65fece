"""The pieces every layout builder shares: boxes, dtypes, ranks on nodes, and building a layout.

A layout here is a plain ``dict`` in the proto3 JSON form of ``refit.v1.Layout`` (camelCase keys,
docs/LAYOUTS.md)::

    {"model": "...",
     "tensors": [{"name": ..., "shape": [...], "dtype": "bf16"}],
     "workers": [{"name": ..., "node": 0, "gpu": 0, "buffers": [
         {"name": ..., "dtype": "bf16", "shape": [...], "pieces": [
             {"tensor": ..., "tensorBox": {"origin": [...], "shape": [...]},
                             "bufferBox": {"origin": [...], "shape": [...]}}]}]}]}

``json.dumps(layout)`` is what ``refit-plan`` and ``refitd`` read. Builders here always write both
boxes of a piece explicitly (an omitted box means "all of it"; ``compare.normalize_layout`` treats
the two spellings as equal).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Set, Tuple

from refit.errors import InvalidArgument


class LayoutError(InvalidArgument):
    """A layout cannot be derived: the message names the parameter (or tensor) and what is wrong."""


# ------------------------------------------------------------------------------------------------
# Boxes.

class Box(NamedTuple):
    """An n-d region of a tensor: per dimension ``[origin[d], origin[d] + shape[d])``."""

    origin: Tuple[int, ...]
    shape: Tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> "Box":
        return Box((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def is_empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> Dict[str, List[int]]:
        return {"origin": list(self.origin), "shape": list(self.shape)}


def chunk(extent: int, parts: int, index: int) -> Tuple[int, int]:
    """``[begin, end)`` of part ``index`` when ``extent`` is cut like ``torch.chunk``.

    Every part but the last non-empty one holds ``ceil(extent / parts)``; the last ranks may be
    short or empty (then ``begin == end == extent``).
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"chunk: part {index} of {parts} does not exist")
    size = -(-extent // parts) if extent else 0
    begin = min(extent, index * size)
    return begin, min(extent, begin + size)


def even_part(extent: int, parts: int, index: int, what: str) -> Tuple[int, int]:
    """``[begin, end)`` of part ``index`` of ``parts`` equal parts; refuses an uneven split."""
    if extent % parts != 0:
        raise LayoutError(f"{what}: {extent} does not divide into {parts} equal parts")
    size = extent // parts
    return index * size, (index + 1) * size


# ------------------------------------------------------------------------------------------------
# Dtypes.

_DTYPES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
    "int8": "int8", "i8": "int8",
    "int32": "int32", "i32": "int32",
    "int64": "int64", "i64": "int64",
    "e8m0": "e8m0", "float8_e8m0fnu": "e8m0", "fp8_e8m0": "e8m0",
}


def dtype_name(dtype: Any) -> str:
    """The layout's spelling of a dtype: a ``torch.dtype``, a numpy dtype or a name.

    >>> dtype_name("torch.bfloat16")
    'bf16'
    """
    name = str(dtype).lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in _DTYPES:
        raise LayoutError(
            f"dtype {dtype!s} has no layout spelling (bf16, fp16, fp32, fp8_e4m3, fp8_e5m2, int8, "
            "int32, int64, e8m0)")
    return _DTYPES[name]


# ------------------------------------------------------------------------------------------------
# Ranks on nodes.

class RankPlacement(NamedTuple):
    """Where rank ``r`` of one side runs: node ``first_node + r // gpus_per_node``, GPU
    ``r % gpus_per_node`` (refit-layout's ``--gpus-per-node`` and ``--first-node``). Both sides of
    a model group share one node numbering."""

    gpus_per_node: int = 8
    first_node: int = 0

    def where(self, rank: int) -> Tuple[int, int]:
        if self.gpus_per_node < 1:
            raise LayoutError(f"gpus_per_node must be >= 1, not {self.gpus_per_node}")
        return self.first_node + rank // self.gpus_per_node, rank % self.gpus_per_node


# ------------------------------------------------------------------------------------------------
# Building a layout.

class LayoutBuilder:
    """Accumulates tensors, workers, buffers and pieces; ``build()`` returns the layout dict.

    Tensors are declared on first use; a second declaration must agree in shape and dtype (an
    error names the tensor and both shapes).
    """

    def __init__(self, model: str = ""):
        self.model = model
        self._tensors: Dict[str, Dict[str, Any]] = {}
        self._workers: Dict[str, Dict[str, Any]] = {}
        self._buffer_names: Dict[str, Set[str]] = {}

    def tensor(self, name: str, shape: Sequence[int], dtype: Any, *, what: str = "",
               quantization: Optional[Dict[str, Any]] = None) -> None:
        """``quantization``: an fp8 weight's ``{"format", "block", "scale"}`` (docs/LAYOUTS.md,
        "fp8 engines")."""
        shape = [int(s) for s in shape]
        dtype = dtype_name(dtype)
        old = self._tensors.get(name)
        if old is None:
            self._tensors[name] = {"name": name, "shape": shape, "dtype": dtype}
            if quantization:
                self._tensors[name]["quantization"] = dict(quantization)
        elif old["shape"] != shape or old["dtype"] != dtype or old.get("quantization") != (
                dict(quantization) if quantization else None):
            where = f" ({what})" if what else ""
            raise LayoutError(
                f"tensor {name!r}{where}: shape {shape} {dtype} {quantization or ''} disagrees with "
                f"{old['shape']} {old['dtype']} {old.get('quantization', '')} declared before")

    def worker(self, name: str, node: int, gpu: int) -> Dict[str, Any]:
        if name in self._workers:
            raise LayoutError(f"worker {name!r} is declared twice")
        if node < 0 or gpu < 0:
            raise LayoutError(f"worker {name!r}: node {node} and gpu {gpu} must be >= 0")
        w = {"name": name, "node": int(node), "gpu": int(gpu), "buffers": []}
        self._workers[name] = w
        return w

    def buffer(self, worker: Dict[str, Any], name: str, dtype: Any, shape: Sequence[int]) -> Dict[str, Any]:
        # Names per worker in a set: a trainer holds 10^4-10^5 buffers, so no scan per buffer.
        names = self._buffer_names.get(worker["name"])
        if names is None:
            names = self._buffer_names[worker["name"]] = {b["name"] for b in worker["buffers"]}
        if name in names:
            raise LayoutError(f"worker {worker['name']!r} declares buffer {name!r} twice")
        names.add(name)
        b = {"name": name, "dtype": dtype_name(dtype), "shape": [int(s) for s in shape], "pieces": []}
        worker["buffers"].append(b)
        return b

    @staticmethod
    def piece(buffer: Dict[str, Any], tensor: str, tensor_box: Box, buffer_box: Box) -> None:
        """Adds "``tensor_box`` of ``tensor`` sits at ``buffer_box``"; an empty box adds nothing."""
        if tensor_box.is_empty:
            return
        if tensor_box.numel != buffer_box.numel:
            raise LayoutError(
                f"buffer {buffer['name']!r}: piece of {tensor!r} has {tensor_box.numel} elements in "
                f"the tensor but {buffer_box.numel} in the buffer")
        p: Dict[str, Any] = {"tensor": tensor}
        if tensor_box.shape:  # a scalar's boxes are empty messages: leave them out
            p["tensorBox"] = tensor_box.to_json()
            p["bufferBox"] = buffer_box.to_json()
        buffer["pieces"].append(p)

    def add_layout(self, layout: Dict[str, Any]) -> None:
        """Merges another layout's tensors and workers in (worker names must not repeat)."""
        for t in layout.get("tensors", []):
            self.tensor(t["name"], t.get("shape", []), t["dtype"], quantization=t.get("quantization"))
        for w in layout.get("workers", []):
            if w["name"] in self._workers:
                raise LayoutError(f"worker {w['name']!r} appears in two of the merged layouts")
            self._workers[w["name"]] = {
                "name": w["name"], "node": int(w.get("node", 0)), "gpu": int(w.get("gpu", 0)),
                "buffers": list(w.get("buffers", []))}
            for key in ("replica", "replicaRank", "replicaSize"):  # the engine replica, if declared
                if key in w:
                    self._workers[w["name"]][key] = w[key]

    def build(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.model:
            out["model"] = self.model
        out["tensors"] = list(self._tensors.values())
        out["workers"] = list(self._workers.values())
        return out


def merge_layouts(layouts: Iterable[Dict[str, Any]], model: str = "") -> Dict[str, Any]:
    """One layout from several (e.g. one per rank, as each worker derives its own): tensors are
    united (they must agree in shape and dtype), workers concatenated (names must be unique)."""
    b = LayoutBuilder(model)
    for layout in layouts:
        if not model and not b.model and layout.get("model"):
            b.model = layout["model"]
        b.add_layout(layout)
    return b.build()


def named_items(named: Any) -> List[Tuple[str, Any]]:
    """``(name, object)`` pairs from a mapping, ``module.named_parameters()`` or a module.

    A module (anything with ``named_parameters``) gives its parameters. The same object under a
    second name (tied weights) is dropped, as ``named_parameters()`` itself does.
    """
    if hasattr(named, "named_parameters") and callable(named.named_parameters):
        named = named.named_parameters()
    items = list(named.items()) if hasattr(named, "items") else list(named)
    out, seen = [], set()
    for name, obj in items:
        if not isinstance(obj, (tuple, list, dict)) and not isinstance(obj, (int, str)):
            key = id(obj)
            if key in seen:
                continue
            seen.add(key)
        out.append((str(name), obj))
    return out
