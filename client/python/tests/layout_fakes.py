"""Stand-ins for torch 2.x's DTensor and DeviceMesh (torch 1.13 has neither), and oracles that cut
real tensors with torch.chunk, to check refit.layouts.dtensor's arithmetic against data.

The stand-ins have exactly the attributes refit.layouts reads from the real classes:
DTensor ``.shape`` (global), ``.dtype``, ``.placements``, ``.device_mesh``, ``.to_local()``;
DeviceMesh ``.shape``, ``.get_coordinate()``, ``.get_rank()``, ``.mesh`` (a tensor of ranks).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from refit.layouts import Replicate, Shard, StridedShard, normalize_placement


class FakeMesh:
    def __init__(self, shape: Sequence[int], rank: int, ranks: Optional[Sequence[int]] = None):
        n = 1
        for s in shape:
            n *= s
        self.mesh = torch.tensor(list(ranks) if ranks is not None else list(range(n))).view(*shape)
        self.shape = tuple(shape)
        self._rank = rank

    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> Optional[List[int]]:
        hits = (self.mesh == self._rank).nonzero().tolist()
        return hits[0] if hits else None


class FakeDTensor:
    """A DTensor of ``global_tensor`` on ``mesh`` whose local data is cut by ``oracle_local``."""

    def __init__(self, global_tensor: torch.Tensor, mesh: FakeMesh, placements: Sequence[Any],
                 local: Optional[torch.Tensor] = None):
        self.shape = tuple(global_tensor.shape)
        self.dtype = global_tensor.dtype
        self.placements = tuple(placements)
        self.device_mesh = mesh
        coord = mesh.get_coordinate()
        if local is None:
            local = (oracle_local(global_tensor, mesh.shape, coord, placements) if coord is not None
                     else global_tensor.new_empty(0))
        self._local = local

    def to_local(self) -> torch.Tensor:
        return self._local


def _chunk(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    chunks = list(torch.chunk(t, parts, dim=dim))
    if index < len(chunks):
        return chunks[index]
    return t.narrow(dim, t.shape[dim], 0)  # torch.chunk returned fewer: this rank is empty


def oracle_local(t: torch.Tensor, mesh_shape: Sequence[int], coord: Sequence[int],
                 placements: Sequence[Any]) -> torch.Tensor:
    """The data FSDP2 / DTensor puts at ``coord``, cut with torch.chunk: every Shard left to right,
    then every _StridedShard from the last mesh dim to the first (FSDP2 shards what TP left)."""
    norm = [normalize_placement(p, t.dim()) for p in placements]
    local = t
    for m, p in enumerate(norm):
        if isinstance(p, Shard):
            local = _chunk(local, mesh_shape[m], coord[m], p.dim)
    for m in reversed(range(len(norm))):
        p = norm[m]
        if isinstance(p, StridedShard):
            local = _chunk(local, mesh_shape[m], coord[m], p.dim)
    return local.contiguous()


def split_semantics_local(t: torch.Tensor, mesh_shape: Sequence[int], coord: Sequence[int],
                          placements: Sequence[Any]) -> torch.Tensor:
    """The data torch 2.11's ``_StridedShard._split_tensor`` defines (``distribute_tensor``, and what
    its ``compute_local_shape_and_global_offset`` computes): left to right; a _StridedShard(d, sf)
    on a mesh dim of m ranks cuts its input into sf chunks, each of them into m, and rank i keeps
    the i-th piece of every chunk. Agrees with ``oracle_local`` (FSDP2's data) on even splits."""
    norm = [normalize_placement(p, t.dim()) for p in placements]
    local = t
    for m, p in enumerate(norm):
        if isinstance(p, Replicate):
            continue
        n = mesh_shape[m]
        if isinstance(p, StridedShard):
            first = [_chunk(local, p.split_factor, j, p.dim) for j in range(p.split_factor)]
            local = torch.cat([_chunk(f, n, coord[m], p.dim) for f in first], dim=p.dim)
        else:
            local = _chunk(local, n, coord[m], p.dim)
    return local


def box_of(t: torch.Tensor, box: Tuple[Tuple[int, ...], Tuple[int, ...]]) -> torch.Tensor:
    out = t
    for d, (o, s) in enumerate(zip(*box)):
        out = out.narrow(d, o, s)
    return out


def torch_placements() -> Optional[Any]:
    """torch's placement module when this torch has DTensor (2.x), else None."""
    for mod in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"):
        try:
            return __import__(mod, fromlist=["Shard"])
        except ImportError:
            continue
    return None


def torch_local_shape_and_offset() -> Optional[Any]:
    """torch's ``_compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate,
    placements)`` (plain data, no mesh) when importable, else None."""
    for mod in ("torch.distributed.tensor._utils", "torch.distributed._tensor._utils"):
        try:
            m = __import__(mod, fromlist=["_compute_local_shape_and_global_offset"])
        except ImportError:
            continue
        f = getattr(m, "_compute_local_shape_and_global_offset", None)
        if f is not None:
            return f
    return None


def to_torch(p: Any, tp_mod: Any, ndim: int) -> Any:
    """Our placement (or string) as torch's object."""
    q = normalize_placement(p, ndim)
    if isinstance(q, StridedShard):
        return tp_mod._StridedShard(q.dim, split_factor=q.split_factor)
    if isinstance(q, Shard):
        return tp_mod.Shard(q.dim)
    return tp_mod.Replicate()


# ------------------------------------------------------------------------------------------------
# Real FSDP2 (+ TP) on gloo, one process per rank (torch 2.x only).

def tiny_model() -> "torch.nn.Module":
    """Sizes chosen to be uneven on 2 and 3 ranks."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(12, 10, bias=True)     # colwise: 10 rows
            self.o_proj = torch.nn.Linear(10, 12, bias=False)    # rowwise: 10 columns
            self.norm = torch.nn.LayerNorm(12)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 12)
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.head = torch.nn.Linear(12, 7, bias=False)     # colwise: 7 rows

    return Net()


def fsdp2_rank(rank: int, world: int, mesh_shape: Tuple[int, ...], init_file: str, queue: Any) -> None:
    """Builds tiny_model on this rank: FSDP2 on a 1-D mesh; on 2-D (dp, tp) TP then FSDP2 over dp;
    on 3-D (rep, dp, tp) TP then HSDP over (rep, dp). Reports (rank, trainer_worker's layout,
    problems, torch's disagreements)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from refit.layouts import trainer_worker
    problems, torch_disagrees = [], []
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        names = {1: ("dp",), 2: ("dp", "tp"), 3: ("rep", "dp", "tp")}[len(mesh_shape)]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        torch.manual_seed(0)
        net = tiny_model()
        full = {n: p.detach().clone() for n, p in net.named_parameters()}
        if len(mesh_shape) >= 2:
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)
            for layer in net.layers:
                parallelize_module(layer, mesh["tp"], {"q_proj": ColwiseParallel(),
                                                       "o_proj": RowwiseParallel()})
            parallelize_module(net, mesh["tp"], {"head": ColwiseParallel()})
            dp_mesh = mesh["dp"] if len(mesh_shape) == 2 else mesh["rep", "dp"]
        else:
            dp_mesh = mesh
        for layer in net.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(net, mesh=dp_mesh)
        layout = trainer_worker(net)
        bufs = {b["name"]: b for b in layout["workers"][0]["buffers"]}
        for name, p in net.named_parameters():
            local = p.to_local()
            size, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if name not in bufs:
                if local.numel() != 0:
                    problems.append(f"{name}: no buffer but to_local() has {tuple(local.shape)}")
                box = None
            else:
                tb = bufs[name]["pieces"][0]["tensorBox"]
                box = (tuple(tb["origin"]), tuple(tb["shape"]))
                if not torch.equal(box_of(full[name], box), local):
                    problems.append(f"{name} {tuple(str(x) for x in p.placements)}: box {box} does "
                                    "not hold to_local()'s data")
            theirs = None if 0 in tuple(size) else (tuple(offset), tuple(size))
            if theirs != box:
                torch_disagrees.append(f"rank {rank} {name} {tuple(str(x) for x in p.placements)} "
                                       f"mesh {tuple(p.device_mesh.shape)}: to_local() "
                                       f"{tuple(local.shape)} at {box}, torch's compute_local_shape_"
                                       f"and_global_offset {tuple(size)} at {tuple(offset)}")
        queue.put((rank, layout, problems, torch_disagrees))
    except BaseException as e:  # report, never hang the parent
        import traceback
        queue.put((rank, None, [f"rank {rank}: {traceback.format_exc()}"], []))
        raise SystemExit(1) from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

