"""Stand-in for nemo_rl/utils/checkpoint_engines/base.py (NVIDIA-NeMo/RL @ 7ea279a) and the
synchronizer's order (nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py)."""
import asyncio
import importlib
from abc import ABC, abstractmethod
from typing import Any


class CheckpointEngine(ABC):
    shard_expert_weights: bool = False

    def get_target_weight_layout(self):
        if self.shard_expert_weights:
            raise NotImplementedError(f"{type(self).__name__} must implement get_target_weight_layout()")
        return None

    @abstractmethod
    def prepare(self) -> Any:
        raise NotImplementedError

    @abstractmethod
    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: list) -> None:
        raise NotImplementedError

    @abstractmethod
    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: list) -> None:
        raise NotImplementedError

    def finalize(self) -> None:
        pass

    @abstractmethod
    async def send_weights(self, weights) -> None:
        raise NotImplementedError

    @abstractmethod
    def receive_weight_batches(self):
        raise NotImplementedError


def create_checkpoint_engine(backend: str, *, bucket_size_bytes: int, engine_kwargs: dict) -> CheckpointEngine:
    if backend == "nixl":
        backend = "nemo_rl.utils.checkpoint_engines.nixl:NIXLCheckpointEngine"
    if ":" not in backend:
        raise ValueError(f"Unknown checkpoint-engine backend {backend!r}: expected 'nixl' or a "
                         "'module:ClassName' path to a CheckpointEngine implementation.")
    module_name, class_name = backend.split(":", 1)
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    return engine_cls(bucket_size=bucket_size_bytes, **engine_kwargs)


class Synchronizer:
    """One policy and generation topology, refit after refit, in the synchronizer's order.
    `policy` is a list of per-rank weight iterables' factories; `generation` a list of loaders
    (callables taking one batch of (name, tensor)) standing for the vLLM workers."""

    def __init__(self, refit_transport: str, refit_cfg: dict, policy: list, generation: list,
                 bucket_size_bytes: int = 1 << 20):
        self.backend = refit_transport
        self.kwargs = dict(refit_cfg.get(refit_transport, {}))
        self.policy_iters, self.loaders = policy, generation
        self.bucket_size_bytes = bucket_size_bytes
        self.policy_engines: list = []
        self.generation_engines: list = []
        self.loaded_batches = 0

    def _ensure_ready(self):
        if self.policy_engines:
            return
        make = lambda: create_checkpoint_engine(self.backend, bucket_size_bytes=self.bucket_size_bytes,
                                                engine_kwargs=self.kwargs)
        self.policy_engines = [make() for _ in self.policy_iters]
        self.generation_engines = [make() for _ in self.loaders]
        metadata = [e.prepare() for e in self.policy_engines] + [e.prepare() for e in self.generation_engines]
        topology = dict(metadata=metadata, train_world_size=len(self.policy_engines),
                        rollout_world_size=len(self.generation_engines))
        for rank, e in enumerate(self.policy_engines):
            e.init_policy_process_group(worker_rank=rank, **topology)
        for rank, e in enumerate(self.generation_engines):
            e.init_rollout_process_group(rollout_rank=rank, **topology)

    async def _receive(self, engine, loader) -> bool:
        async for batch in engine.receive_weight_batches():
            loader(batch)
            self.loaded_batches += 1
        return True

    def sync_weights(self) -> None:
        self._ensure_ready()

        async def both():
            results = await asyncio.gather(
                *[e.send_weights(make_iter()) for e, make_iter in zip(self.policy_engines, self.policy_iters)],
                *[self._receive(e, l) for e, l in zip(self.generation_engines, self.loaders)])
            if not all(r for r in results[len(self.policy_engines):] if r is not None):
                raise RuntimeError(f"Weight transfer failed during {self.backend} checkpoint-engine sync.")

        asyncio.run(both())

    def shutdown(self) -> None:
        for e in self.policy_engines + self.generation_engines:
            e.finalize()
        self.policy_engines, self.generation_engines = [], []
