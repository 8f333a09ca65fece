"""refit as a verl checkpoint engine: ``checkpoint_engine.backend=refit`` and
``checkpoint_engine.custom_backend_module=refit.integrations.verl``.

verl imports ``custom_backend_module`` in every worker before it builds the checkpoint engine,
which registers ``RefitCheckpointEngine`` in ``CheckpointEngineRegistry`` under ``"refit"``.
Settings come through ``checkpoint_engine.engine_kwargs.refit`` (``control``, ``daemon``,
``group``, ``node``, ``timeout_s``).

* Trainer side (``is_master`` on rank 0): ``send_weights(weights)`` copies verl's per-tensor
  stream into staged buffers registered with refitd (the first call allocates and registers them)
  and runs one refit round; other ranks drain the stream, so its collectives still run everywhere.
* Rollout side: ``receive_weights()`` returns once the group committed a newer version and yields
  no tensor: refit already wrote the engines' live weights, which registered themselves through
  the vLLM adapter (``refit.integrations.vllm``, ``window="idle"``: verl aborts the rollout's
  requests before it syncs) or the SGLang one.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, Dict, Iterable, List, Optional, Tuple

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from refit.integrations._common import (IntegrationError, StagedTrainer, drain, env_or, group_version,
                                        wait_group_version_above)

BACKEND = "refit"

__all__ = ["BACKEND", "RefitCheckpointEngine", "IntegrationError"]


@CheckpointEngineRegistry.register(BACKEND)
class RefitCheckpointEngine(CheckpointEngine):
    """See the module's docstring."""

    def __init__(self, bucket_size: int, is_master: bool = False, *, control: str = "", daemon: str = "",
                 group: str = "policy", node: int = -1, timeout_s: float = 120.0) -> None:
        self.bucket_size = bucket_size  # unused: refit moves weights without buckets
        self.is_master = is_master
        self.control = env_or(control, "REFIT_CONTROL", "")
        self.daemon = env_or(daemon, "REFIT_DAEMON", "")
        self.group = group
        self.node = int(env_or(node if node >= 0 else None, "REFIT_NODE", 0))
        self.timeout_s = timeout_s
        self.side: Optional[str] = None
        self.rank = 0
        self._staged: Optional[StagedTrainer] = None
        self._controller: Any = None
        self._seen = 0  # rollout side: the last version this worker saw committed

    def prepare(self) -> Dict[str, Any]:
        return {"backend": BACKEND, "group": self.group}

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: List[Dict[str, Any]]) -> Tuple[Dict[str, List[Any]], Dict[str, List[Any]]]:
        groups = {m.get("group") for m in metadata if isinstance(m, dict)}
        if len(groups) > 1:
            raise IntegrationError(f"workers name different refit groups: {sorted(map(str, groups))}")
        return ({"rank": list(range(trainer_world_size)), "side": ["trainer"] * trainer_world_size},
                {"rank": list(range(rollout_world_size)), "side": ["rollout"] * rollout_world_size})

    def _ctl(self) -> Any:
        if self._controller is None:
            import refit
            if not self.control:
                raise IntegrationError("engine_kwargs.refit.control is empty: give a refitd control address "
                                       "('host:port') or set $REFIT_CONTROL")
            self._controller = refit.Controller(self.control)
        return self._controller

    def init_process_group(self, rank: int, side: str) -> None:
        self.rank, self.side = rank, side
        if side == "rollout":
            self._seen = group_version(self._ctl(), self.group)
        elif self.is_master:
            if not self.daemon:
                raise IntegrationError("engine_kwargs.refit.daemon is empty: give this host's refitd worker "
                                       "socket ('unix:/path') or set $REFIT_DAEMON")
            self._ctl()
            if self._staged is None:
                self._staged = StagedTrainer(self.daemon, self.group, self.control, node=self.node,
                                             timeout_s=self.timeout_s)

    def finalize(self) -> None:
        """Keeps the registration: the staged buffers are the next sync's too."""

    async def send_weights(self, weights: Iterable[Tuple[str, Any]]) -> None:
        if not self.is_master:
            drain(weights)
            return
        if self._staged is None:
            raise IntegrationError("send_weights before init_process_group on the trainer's master rank")
        self._staged.stage(weights)
        await asyncio.to_thread(self._staged.round)

    async def receive_weights(self) -> AsyncGenerator[Tuple[str, Any], None]:
        floor = self._seen
        self._seen = await asyncio.to_thread(wait_group_version_above, self._ctl(), self.group, floor,
                                             self.timeout_s)
        return
        yield  # an async generator that yields nothing: the weights are already in place

    def close(self) -> None:
        if self._staged is not None:
            self._staged.close()
            self._staged = None
        if self._controller is not None:
            self._controller.close()
            self._controller = None
