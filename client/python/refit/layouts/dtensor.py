"""Trainer layouts from DTensor placements (FSDP2, tensor parallelism, HSDP, any mesh).

What a user must know
---------------------
* ``local_box(global_shape, mesh_shape, coordinate, placements)`` is the pure rule: the box of the
  global tensor that the rank at ``coordinate`` of the mesh holds, i.e. what its ``to_local()``
  holds:

  - ``Shard(d)`` cuts dim ``d`` like ``torch.chunk``: chunks of ``ceil(n / k)``, the last ranks
    short or EMPTY (FSDP2's uneven shards);
  - ``Replicate()`` keeps the whole extent;
  - several placements sharding one dim apply left to right (mesh dim 0 first), each cutting what
    the previous left;
  - ``_StridedShard(d, split_factor)`` is FSDP2 + TP: FSDP2 shards (``torch.chunk`` on dim ``d``)
    the shard that TP (or EP) left, so it cuts after every later cut of dim ``d``, and
    ``split_factor`` must be the product of those cuts' mesh sizes (what FSDP2 writes:
    ``num_shards_map[d]`` of the TP spec);
  - ``Partial`` is refused: a pending reduction is not weights.

  This is torch's ``compute_local_shape_and_global_offset`` wherever torch computes what FSDP2
  stores: in the versions that reorder placements (``_explicit_order_placements``) and, in torch
  2.11, everywhere but uneven ``_StridedShard`` splits, where 2.11 follows its
  ``_StridedShard._split_tensor`` rule and FSDP2's ``to_local()`` does not (``head.weight``
  [7, 12], TP 2 inside FSDP 3: FSDP2 puts row 6 on mesh coordinate (2, 1), torch 2.11 says
  (2, 0)). FSDP2 is the only producer of uneven ``_StridedShard`` (2.11's ``distribute_tensor``
  refuses them), so refit follows FSDP2's data; ``trainer_worker`` checks every local shape
  against ``to_local()``.

  A placement whose shard is not one box (a ``_StridedShard`` whose ``split_factor`` is not the
  product above, e.g. one that no later ``Shard`` of its dim follows) is refused with an error
  naming the parameter.
* Placements may be torch's objects (duck-typed: torch 2.x's ``Shard``, ``_StridedShard``,
  ``Replicate``, ``Partial``), this module's ``Shard``, ``StridedShard``, ``Replicate``,
  ``Partial``, or strings: ``"S(0)"``, ``"Shard(0)"``, ``"R"``, ``"Replicate()"``, ``"P"``,
  ``"_S(0, 2)"``, ``"_StridedShard(dim=0, sf=2)"``.
* Conventions (those of ``refit-layout --fsdp``/``--fsdp2``): a rank's worker is named
  ``fsdp-rank<r>`` (``worker_name`` changes it: a format string with ``{rank}`` or a callable), its
  node and GPU come from ``RankPlacement`` (``r // gpus_per_node`` past ``first_node``); one buffer
  per parameter, named after the parameter, holding the local shard row-major (what
  ``to_local()`` returns); a rank whose shard is empty has no buffer for it; the logical tensor is
  ``name_map(parameter name)`` (default: the name itself; pass a map when the trainer's module names
  are not Hugging Face's, e.g. to strip ``_orig_mod.``).
* Plain tensors (no ``placements``) are full replicas on every rank that lists them. FSDP leaves
  module buffers (``register_buffer``) whole and out of ``named_parameters()``; when one is a
  checkpoint tensor (transformers' DeepSeek-V3 ``gate.e_score_correction_bias``), pass
  ``itertools.chain(module.named_parameters(), module.named_buffers())``.
* Ranks: a mesh's ranks are ``Mesh.ranks`` in row-major order of the mesh (``DeviceMesh``'s
  default ``arange(world).view(shape)``); ``Mesh.from_device_mesh`` reads a live one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import (Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

from .core import Box, LayoutBuilder, LayoutError, RankPlacement, chunk, named_items

__all__ = [
    "Shard", "StridedShard", "Replicate", "Partial", "Mesh", "ParamSpec", "normalize_placement",
    "local_box", "trainer_layout", "trainer_worker", "worker_layout", "local_buffers",
]


# ------------------------------------------------------------------------------------------------
# Placements.

@dataclass(frozen=True)
class Shard:
    """Dim ``dim`` cut over one mesh dim, ``torch.chunk`` style."""
    dim: int


@dataclass(frozen=True)
class StridedShard:
    """Torch's ``_StridedShard(dim, split_factor)``: see the module's docstring."""
    dim: int
    split_factor: int


@dataclass(frozen=True)
class Replicate:
    """The whole extent on every rank of the mesh dim."""


@dataclass(frozen=True)
class Partial:
    """A pending reduction (refused: not weights)."""
    reduce_op: str = "sum"


_PLACEMENT_RE: List[Tuple["re.Pattern[str]", Callable[["re.Match[str]"], Any]]] = [
    (re.compile(r"^(?:_S|_StridedShard)\(\s*(?:dim=)?(-?\d+)\s*,\s*(?:sf=|split_factor=)?(\d+)\s*\)$"),
     lambda m: StridedShard(int(m.group(1)), int(m.group(2)))),
    (re.compile(r"^(?:S|Shard)\(\s*(?:dim=)?(-?\d+)\s*\)$"), lambda m: Shard(int(m.group(1)))),
    (re.compile(r"^(?:R|Replicate\(\s*\))$"), lambda m: Replicate()),
    (re.compile(r"^(?:P|Partial\(.*\))$"), lambda m: Partial()),
]


def normalize_placement(p: Any, ndim: int, what: str = "tensor") -> Union[Shard, StridedShard, Replicate]:
    """This module's placement for ``p`` (torch's, ours or a string), with a non-negative dim.

    Raises ``LayoutError`` naming ``what`` for ``Partial`` and for anything unknown.
    """
    if isinstance(p, str):
        for pattern, make in _PLACEMENT_RE:
            m = pattern.match(p.strip())
            if m:
                p = make(m)
                break
        else:
            raise LayoutError(f"{what}: placement {p!r} is not one of Shard(d), Replicate(), "
                              "_StridedShard(d, sf), Partial()")
    cls = type(p).__name__
    is_partial = getattr(p, "is_partial", None)
    if isinstance(p, Partial) or "Partial" in cls or (callable(is_partial) and is_partial()):
        raise LayoutError(f"{what}: placement {p!r} is Partial (a pending reduction, not weights); "
                          "redistribute it to Shard or Replicate before a refit")
    if isinstance(p, Replicate) or cls == "Replicate" or _call(p, "is_replicate"):
        return Replicate()
    dim = getattr(p, "dim", None)
    if dim is None or not isinstance(dim, int):
        raise LayoutError(f"{what}: placement {p!r} is not Shard, _StridedShard, Replicate or Partial")
    if not -ndim <= dim < ndim:
        raise LayoutError(f"{what}: placement {p!r} shards dim {dim} of a tensor of rank {ndim}")
    dim %= ndim
    split_factor = getattr(p, "split_factor", None)
    if split_factor is not None:
        if int(split_factor) < 1:
            raise LayoutError(f"{what}: placement {p!r} has split_factor {split_factor} < 1")
        return StridedShard(dim, int(split_factor))
    return Shard(dim)


def _call(obj: Any, method: str) -> bool:
    f = getattr(obj, method, None)
    try:
        return bool(f()) if callable(f) else False
    except TypeError:
        return False


# ------------------------------------------------------------------------------------------------
# The rule.

def _shard_order_entries(shard_order: Any) -> Dict[int, Tuple[int, ...]]:
    """{tensor dim: mesh dims in the order they cut it} from a mapping or torch's ShardOrderEntry."""
    if shard_order is None:
        return {}
    if hasattr(shard_order, "items"):
        return {int(k): tuple(int(m) for m in v) for k, v in shard_order.items()}
    return {int(e.tensor_dim): tuple(int(m) for m in e.mesh_dims) for e in shard_order}


def _order(mesh_shape: Sequence[int], placements: Sequence[Any], what: str,
           shard_order: Any) -> List[Tuple[int, int]]:
    """(mesh dim, tensor dim) of every cut, in the order the cuts apply (torch's
    ``_explicit_order_placements``)."""
    order = _shard_order_entries(shard_order)
    strided = any(isinstance(p, StridedShard) for p in placements)
    if order and not all(list(v) == sorted(v) for v in order.values()):
        if strided:
            raise LayoutError(f"{what}: a shard order and _StridedShard cannot be combined")
        ordered: List[Tuple[int, int]] = []
        listed = set()
        for tdim, mdims in sorted(order.items()):
            for m in mdims:
                p = placements[m]
                if not isinstance(p, Shard) or p.dim != tdim:
                    raise LayoutError(f"{what}: shard order puts mesh dim {m} on tensor dim {tdim}, "
                                      f"but its placement is {p}")
                ordered.append((m, tdim))
                listed.add(m)
        for m, p in enumerate(placements):
            if isinstance(p, Shard) and m not in listed:
                raise LayoutError(f"{what}: mesh dim {m} ({p}) is missing from the shard order")
        return ordered

    cuts: List[Tuple[int, int]] = []
    for dim in sorted({p.dim for p in placements if isinstance(p, (Shard, StridedShard))}):
        mine = [(m, p) for m, p in enumerate(placements)
                if isinstance(p, (Shard, StridedShard)) and p.dim == dim]
        cuts.extend((m, dim) for m in _cut_order(mine, mesh_shape, placements, what))
    return cuts


def _cut_order(mine: List[Tuple[int, Any]], mesh_shape: Sequence[int], placements: Sequence[Any],
               what: str) -> List[int]:
    """Mesh dims cutting one tensor dim, in the order they cut: a Shard in mesh order; a
    _StridedShard after every later cut of the dim (FSDP shards what TP/EP left), its
    split_factor the product of their mesh sizes."""
    if not mine:
        return []
    (m, p), rest = mine[0], mine[1:]
    later = _cut_order(rest, mesh_shape, placements, what)
    if not isinstance(p, StridedShard):
        return [m] + later
    need = 1
    for r, _ in rest:
        need *= mesh_shape[r]
    if p.split_factor != need:
        raise LayoutError(
            f"{what}: placements {_fmt(placements)}: the local shard is not a single box: "
            f"_StridedShard({p.dim}, split_factor={p.split_factor}) on mesh dim {m} holds "
            f"{p.split_factor} strided pieces of dim {p.dim}, but the later cuts of that dim "
            f"make {need} (split_factor must equal the product of their mesh sizes)")
    return later + [m]


def _fmt(placements: Sequence[Any]) -> str:
    def one(p: Any) -> str:
        if isinstance(p, StridedShard):
            return f"_StridedShard({p.dim}, {p.split_factor})"
        if isinstance(p, Shard):
            return f"Shard({p.dim})"
        return "Replicate()"
    return "(" + ", ".join(one(p) for p in placements) + ")"


def local_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
              placements: Optional[Sequence[Any]], *, name: str = "tensor",
              shard_order: Any = None) -> Box:
    """The box of a ``global_shape`` tensor held at ``coordinate`` of a ``mesh_shape`` mesh.

    ``placements`` has one entry per mesh dim (``None`` or ``()``: replicated everywhere).
    ``shard_order`` (torch's ``DTensorSpec.shard_order``, or ``{tensor dim: [mesh dims]}``) gives
    a non-default order of the cuts of one dim. An empty shard returns a box with a zero extent
    (``Box.is_empty``). Errors (``LayoutError``) name ``name``.

    >>> local_box([10, 4], [4], [3], ["Shard(0)"])   # chunks of 3: [0,3) [3,6) [6,9) [9,10)
    Box(origin=(9, 0), shape=(1, 4))
    """
    shape = [int(s) for s in global_shape]
    mesh_shape = [int(m) for m in mesh_shape]
    coordinate = [int(c) for c in coordinate]
    if len(coordinate) != len(mesh_shape):
        raise LayoutError(f"{name}: coordinate {coordinate} does not fit mesh shape {mesh_shape}")
    for c, m in zip(coordinate, mesh_shape):
        if not 0 <= c < m:
            raise LayoutError(f"{name}: coordinate {coordinate} lies outside mesh shape {mesh_shape}")
    if not placements:
        return Box.whole(shape)
    if len(placements) != len(mesh_shape):
        raise LayoutError(f"{name}: {len(placements)} placements for a mesh of {len(mesh_shape)} "
                          f"dims {tuple(mesh_shape)}")
    norm = [normalize_placement(p, len(shape), name) for p in placements]
    size = list(shape)
    origin = [0] * len(shape)
    for m, d in _order(mesh_shape, norm, name, shard_order):
        begin, end = chunk(size[d], mesh_shape[m], coordinate[m])
        origin[d] += begin
        size[d] = end - begin
    return Box(tuple(origin), tuple(size))


# ------------------------------------------------------------------------------------------------
# Meshes and whole layouts.

class Mesh:
    """A device mesh as refit needs it: its shape and the global rank at each coordinate.

    ``Mesh((2, 4))`` numbers ranks row-major from 0; ``Mesh((2, 4), ranks=[...])`` takes the 8
    ranks (flat, row-major, or nested lists as ``DeviceMesh.mesh.tolist()`` gives).
    """

    def __init__(self, shape: Sequence[int], ranks: Optional[Sequence[Any]] = None):
        self.shape = tuple(int(s) for s in shape)
        n = 1
        for s in self.shape:
            if s < 1:
                raise LayoutError(f"mesh shape {self.shape} has an extent < 1")
            n *= s
        flat = list(range(n)) if ranks is None else _flatten(ranks)
        if len(flat) != n:
            raise LayoutError(f"mesh of shape {self.shape} needs {n} ranks, got {len(flat)}")
        if len(set(flat)) != n or any(r < 0 for r in flat):
            raise LayoutError(f"mesh ranks {flat} must be distinct and >= 0")
        self.ranks = flat
        self._coord = {r: self._unravel(i) for i, r in enumerate(flat)}

    @staticmethod
    def from_device_mesh(mesh: Any) -> "Mesh":
        """A live ``torch.distributed.DeviceMesh`` (duck-typed: ``.mesh`` a tensor of ranks)."""
        ranks = mesh.mesh.flatten().tolist() if hasattr(mesh, "mesh") else None
        return Mesh(tuple(mesh.shape), ranks)

    def _unravel(self, i: int) -> Tuple[int, ...]:
        out = []
        for s in reversed(self.shape):
            out.append(i % s)
            i //= s
        return tuple(reversed(out))

    def coordinate(self, rank: int) -> Optional[Tuple[int, ...]]:
        """The coordinate of global rank ``rank``, or ``None`` when it is not in the mesh."""
        return self._coord.get(rank)

    def __repr__(self) -> str:
        return f"Mesh({self.shape}, ranks={self.ranks})"


def _flatten(x: Any) -> List[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        out: List[int] = []
        for e in x:
            out.extend(_flatten(e))
        return out
    return [int(x)]


class ParamSpec(NamedTuple):
    """One parameter of a trainer described without live objects.

    ``placements``: one per dim of ``mesh`` (``None``: a plain tensor, replicated on the mesh).
    ``mesh``: the mesh this parameter lives on (``None``: the layout's mesh), e.g. one pipeline
    stage's ranks, or the ranks holding one expert.
    """
    shape: Sequence[int]
    dtype: Any
    placements: Optional[Sequence[Any]] = None
    mesh: Optional[Mesh] = None


def _worker_name(pattern: Union[str, Callable[[int], str]], rank: int) -> str:
    return pattern(rank) if callable(pattern) else pattern.format(rank=rank)


def trainer_layout(params: Mapping[str, Any], mesh: Union[Mesh, Sequence[int]], *,
                   placement: RankPlacement = RankPlacement(),
                   worker_name: Union[str, Callable[[int], str]] = "fsdp-rank{rank}",
                   name_map: Optional[Callable[[str], str]] = None, model: str = "",
                   replica: Optional[str] = None) -> Dict[str, Any]:
    """The whole trainer layout: every rank of the mesh(es) as a worker, sorted by rank.

    ``params``: ``{parameter name: ParamSpec or (shape, dtype, placements[, mesh])}`` in the
    order buffers should appear. ``mesh``: a ``Mesh`` or a mesh shape (ranks row-major from 0).
    Each rank's worker holds, per parameter whose mesh contains it, one buffer named after the
    parameter with its ``local_box`` (none when that box is empty). Returns the layout dict.

    ``replica``: for an *engine* described this way (e.g. a TP engine holding row slices), the
    name of the engine replica its ranks form. Every worker then declares ``replica``,
    ``replicaRank`` (its rank's position among the layout's ranks: the mesh rank, for a mesh
    numbered from 0) and ``replicaSize`` (the number of ranks), so the daemons refit the engine
    only once all its ranks are registered, and whole (docs/ROUNDS.md, "Replicas and commit").
    Without it each engine rank is a replica of its own and may hold another version than its
    peers. Trainers leave it out: replicas are an engine's.
    """
    if replica is not None and (not isinstance(replica, str) or not replica):
        raise LayoutError(f"replica must be a non-empty name, not {replica!r}")
    default = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    specs = []
    for name, spec in params.items():
        spec = ParamSpec(*spec) if not isinstance(spec, ParamSpec) else spec
        m = spec.mesh if spec.mesh is not None else default
        if not isinstance(m, Mesh):
            m = Mesh(m)
        specs.append((name, spec, m))
    ranks = sorted(set(default.ranks).union(*(m.ranks for _, _, m in specs)))
    b = LayoutBuilder(model)
    tensor_of = name_map or (lambda n: n)
    for name, spec, _ in specs:
        b.tensor(tensor_of(name), spec.shape, spec.dtype, what=f"parameter {name!r}")
    for replica_rank, rank in enumerate(ranks):
        node, gpu = placement.where(rank)
        w = b.worker(_worker_name(worker_name, rank), node, gpu)
        if replica is not None:
            w["replica"], w["replicaRank"], w["replicaSize"] = replica, replica_rank, len(ranks)
        for name, spec, m in specs:
            coord = m.coordinate(rank)
            if coord is None:
                continue
            box = local_box(spec.shape, m.shape, coord, spec.placements, name=f"parameter {name!r}")
            if box.is_empty:
                continue
            buf = b.buffer(w, name, spec.dtype, box.shape)
            b.piece(buf, tensor_of(name), box, Box.whole(box.shape))
    return b.build()


# ------------------------------------------------------------------------------------------------
# One rank, from live objects.

def _is_dtensor(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("placements", "device_mesh", "to_local"))


def _global_rank(named: List[Tuple[str, Any]]) -> int:
    try:
        import torch.distributed as dist  # only for the default rank
        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    for _, obj in named:
        if _is_dtensor(obj) and hasattr(obj.device_mesh, "get_rank"):
            return int(obj.device_mesh.get_rank())
    raise LayoutError("trainer_worker: no process group is initialised and no DTensor names the "
                      "rank: pass rank=")


def _shard_order(obj: Any) -> Any:
    spec = getattr(obj, "_spec", None)
    return getattr(spec, "shard_order", None)


def _live_box(name: str, obj: Any) -> Tuple[Optional[Box], Any, Any]:
    """(box or None when this rank holds nothing, local tensor, dtype) of one live parameter."""
    if _is_dtensor(obj):
        mesh = obj.device_mesh
        coord = mesh.get_coordinate()
        local = obj.to_local()
        if coord is None:
            return None, local, obj.dtype
        box = local_box(tuple(obj.shape), tuple(mesh.shape), coord, tuple(obj.placements),
                        name=f"parameter {name!r}", shard_order=_shard_order(obj))
        if tuple(local.shape) != box.shape:
            raise LayoutError(
                f"parameter {name!r}: to_local() has shape {tuple(local.shape)} but placements "
                f"{tuple(obj.placements)} on mesh {tuple(mesh.shape)} at {tuple(coord)} give "
                f"{box.shape} (a padded local shard?)")
        return box, local, obj.dtype
    if not hasattr(obj, "shape") or not hasattr(obj, "dtype"):
        raise LayoutError(f"parameter {name!r}: {type(obj).__name__} is neither a tensor nor a DTensor")
    return Box.whole(tuple(obj.shape)), obj, obj.dtype


def trainer_worker(named_tensors: Any, *, rank: Optional[int] = None,
                   placement: RankPlacement = RankPlacement(), node: Optional[int] = None,
                   gpu: Optional[int] = None,
                   worker_name: Union[str, Callable[[int], str]] = "fsdp-rank{rank}",
                   name_map: Optional[Callable[[str], str]] = None, model: str = "") -> Dict[str, Any]:
    """This rank's worker, as a one-worker layout dict, from the live parameters it holds.

    ``named_tensors``: ``module.named_parameters()``, a module, or ``{name: tensor}``. DTensors
    (anything with ``.placements``, ``.device_mesh`` and ``.to_local()``) give their global shape
    and placements; other tensors are full replicas. ``rank`` defaults to
    ``torch.distributed.get_rank()``; ``node``/``gpu`` default to ``placement.where(rank)``.
    Every local shard must be one contiguous box (else ``LayoutError`` naming the parameter).
    Merge the workers of all ranks with ``core.merge_layouts``; register the memory of
    ``local_buffers(named_tensors)``, whose names are the buffers'.
    """
    named = named_items(named_tensors)
    if rank is None:
        rank = _global_rank(named)
    where = placement.where(rank)
    node = where[0] if node is None else node
    gpu = where[1] if gpu is None else gpu
    tensor_of = name_map or (lambda n: n)
    b = LayoutBuilder(model)
    w = b.worker(_worker_name(worker_name, rank), node, gpu)
    for name, obj in named:
        box, local, dtype = _live_box(name, obj)
        b.tensor(tensor_of(name), tuple(obj.shape), dtype, what=f"parameter {name!r}")
        if box is None or box.is_empty:
            continue
        if hasattr(local, "is_contiguous") and not local.is_contiguous():
            raise LayoutError(f"parameter {name!r}: the local tensor is not contiguous; a buffer "
                              "must be one row-major region")
        buf = b.buffer(w, name, dtype, box.shape)
        b.piece(buf, tensor_of(name), box, Box.whole(box.shape))
    return b.build()


worker_layout = trainer_worker  # the name docs/PYTHON.md uses


def local_buffers(named_tensors: Any) -> Dict[str, Any]:
    """``{buffer name: local tensor}`` of ``trainer_worker``'s buffers (``to_local()`` of each
    DTensor; empty shards and parameters outside this rank's mesh left out)."""
    out = {}
    for name, obj in named_items(named_tensors):
        if _is_dtensor(obj):
            if obj.device_mesh.get_coordinate() is None:
                continue
            local = obj.to_local()
        else:
            local = obj
        if any(int(s) == 0 for s in local.shape):
            continue
        out[name] = local
    return out
