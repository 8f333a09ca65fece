"""Stand-in for verl/checkpoint_engine/base.py (volcengine/verl @ b178a3c) and the workers that
build checkpoint engines (verl/workers/engine_workers.py @ 54d7495): the registry, the engine's
abstract interface, and one weight sync in the manager's order, with Ray's remote calls made
directly (trainer and rollout sides run concurrently, as their Ray tasks do)."""
import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from verl.utils.import_utils import import_external_libs


class CheckpointEngineRegistry:
    _registry: dict = {}

    def register(backend: str):
        def wrapper(cls):
            CheckpointEngineRegistry._registry[backend] = cls
            return cls

        return wrapper

    @classmethod
    def get(cls, backend: str):
        return cls._registry[backend]

    @classmethod
    def new(cls, backend: str, *args, **kwargs):
        if backend not in cls._registry:
            raise ValueError(f"Checkpoint engine {backend} not registered")
        return cls._registry[backend](*args, **kwargs)


class CheckpointEngine(ABC):
    @abstractmethod
    def prepare(self) -> Dict[str, Any]:
        raise NotImplementedError

    @classmethod
    @abstractmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
        raise NotImplementedError

    @abstractmethod
    def init_process_group(self, **kwargs):
        raise NotImplementedError

    @abstractmethod
    def finalize(self):
        raise NotImplementedError

    @abstractmethod
    async def send_weights(self, weights):
        raise NotImplementedError

    @abstractmethod
    async def receive_weights(self):
        raise NotImplementedError


@dataclass
class CheckpointEngineConfig:
    backend: str = "naive"
    update_weights_bucket_megabytes: int = 512
    engine_kwargs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    custom_backend_module: Optional[str] = None


class TrainerWorker:
    """The actor worker's checkpoint-engine part: the engine built as engine_workers.py builds it;
    update_weights sends the model engine's per-tensor stream."""

    def __init__(self, config: CheckpointEngineConfig, rank: int, per_tensor_param):
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, is_master=(rank == 0), bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}))
        self.per_tensor_param = per_tensor_param

    async def update_weights(self):
        await self.checkpoint_engine.send_weights(self.per_tensor_param())

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class CheckpointEngineWorker:
    """The rollout side: receive_weights' stream goes to the server adapter's update_weights."""

    def __init__(self, config: CheckpointEngineConfig, server_adapter):
        import_external_libs(config.custom_backend_module or None)
        self.server_adapter = server_adapter
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend, bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}))

    async def update_weights(self):
        weights = self.checkpoint_engine.receive_weights()
        await self.server_adapter.update_weights(weights)

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class CheckpointEngineManager:
    """update_weights in CheckpointEngineManager's order: abort the replicas' requests, prepare
    every worker, build the topology, init the process groups, update trainer and rollout
    together, finalize, resume the requests."""

    def __init__(self, backend: str, trainer: List[TrainerWorker], rollout: List[CheckpointEngineWorker],
                 replicas: list):
        self.backend = backend
        self.backend_cls = CheckpointEngineRegistry.get(backend)
        self.trainer, self.rollout, self.replicas = trainer, rollout, replicas

    def build_process_group(self):
        metadata = [w.execute_checkpoint_engine("prepare") for w in self.trainer + self.rollout]
        trainer_kwargs, rollout_kwargs = self.backend_cls.build_topology(len(self.trainer), len(self.rollout),
                                                                         metadata)
        for side, kwargs in ((self.trainer, trainer_kwargs), (self.rollout, rollout_kwargs)):
            for k, v in kwargs.items():
                assert len(v) == len(side), f"{k} must have length {len(side)}"
            for i, w in enumerate(side):
                w.execute_checkpoint_engine("init_process_group", **{k: v[i] for k, v in kwargs.items()})

    async def update_weights(self):
        await asyncio.gather(*[r.abort_all_requests() for r in self.replicas])
        self.build_process_group()
        await asyncio.gather(*[w.update_weights() for w in self.trainer + self.rollout])
        for w in self.trainer + self.rollout:
            w.execute_checkpoint_engine("finalize")
        await asyncio.gather(*[r.resume_all_requests() for r in self.replicas])
