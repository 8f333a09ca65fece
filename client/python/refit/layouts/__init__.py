"""Layouts from what a training or inference process already knows.

A layout (docs/LAYOUTS.md) says which box of which logical tensor (Hugging Face names) sits where
in which buffer of which worker. This package derives them in Python as plain dicts in the proto3
JSON form of ``refit.v1.Layout`` (``json.dumps`` them for ``refit-plan`` or the daemon); it needs
neither torch nor the generated protobuf modules, and reads live torch objects by duck typing.

Trainer side (``dtensor``): ``local_box`` is DTensor's placement rule (Shard, _StridedShard,
Replicate; uneven ``torch.chunk`` splits, empty shards, any mesh); ``trainer_layout`` builds a whole
trainer from a description of its parameters; ``trainer_worker`` builds one rank's worker from its
live ``named_parameters()`` (DTensors or plain tensors) and ``local_buffers`` gives the tensors to
register under the same buffer names.

Engine side (``vllm``): ``engine_worker`` builds one vLLM rank's worker from its parameters and an
``EngineConfig``, mapping fused buffers (qkv_proj, gate_up_proj, stacked experts, padded
vocabularies) to Hugging Face tensors, extensible like vLLM's ``packed_modules_mapping``;
``engine_layout`` builds every rank.

``merge_layouts`` joins per-rank layouts; ``compare`` normalises and diffs layouts.
"""

from .compare import coverage, diff_layouts, normalize_layout
from .core import Box, LayoutBuilder, LayoutError, RankPlacement, chunk, dtype_name, merge_layouts
from .dtensor import (Mesh, ParamSpec, Partial, Replicate, Shard, StridedShard, local_box,
                      local_buffers, normalize_placement, trainer_layout, trainer_worker)
from .vllm import (VLLM_EXPERT_MODULES, VLLM_PACKED_MODULES, VLLM_SHARDING, EngineConfig,
                   engine_layout, engine_worker, expert_ids)

__all__ = [
    "Box", "LayoutBuilder", "LayoutError", "RankPlacement", "chunk", "dtype_name", "merge_layouts",
    "Mesh", "ParamSpec", "Partial", "Replicate", "Shard", "StridedShard", "local_box",
    "local_buffers", "normalize_placement", "trainer_layout", "trainer_worker",
    "VLLM_EXPERT_MODULES", "VLLM_PACKED_MODULES", "VLLM_SHARDING", "EngineConfig",
    "engine_layout", "engine_worker", "expert_ids",
    "coverage", "diff_layouts", "normalize_layout",
]
