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

from typing import Any, AsyncGenerator, Dict, Iterable, List, Optional, Tuple

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from refit.integrations._common import IntegrationError, StagedSync, env_or

BACKEND = "refit"

__all__ = ["BACKEND", "RefitCheckpointEngine", "IntegrationError"]


@CheckpointEngineRegistry.register(BACKEND)
class RefitCheckpointEngine(CheckpointEngine):
    """See the module's docstring."""

    def __init__(self, bucket_size: int, is_master: bool = False, *, control: str = "", daemon: str = "",
                 group: str = "policy", node: int = -1, timeout_s: float = 120.0) -> None:
        self.bucket_size = bucket_size  # unused: refit moves weights without buckets
        self.is_master = is_master
        self.group = group
        self.side: Optional[str] = None
        self.rank = 0
        self._sync = StagedSync(control=env_or(control, "REFIT_CONTROL", ""), daemon=env_or(daemon, "REFIT_DAEMON", ""),
                                group=group, node=int(env_or(node if node >= 0 else None, "REFIT_NODE", 0)),
                                timeout_s=timeout_s, config="engine_kwargs.refit")

    @property
    def committed_version(self) -> int:
        """The version this rank's last send_weights committed (0: none yet, or not the sending rank)."""
        return self._sync.committed_version

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

    def init_process_group(self, rank: int, side: str) -> None:
        self.rank, self.side = rank, side
        if side == "rollout":
            self._sync.start_receiver()
        elif self.is_master:
            self._sync.start_sender()

    def finalize(self) -> None:
        """Keeps the registration: the staged buffers are the next sync's too."""

    async def send_weights(self, weights: Iterable[Tuple[str, Any]]) -> None:
        await self._sync.send(weights, sending=self.is_master,
                              not_started="send_weights before init_process_group on the trainer's master rank")

    async def receive_weights(self) -> AsyncGenerator[Tuple[str, Any], None]:
        await self._sync.wait_next()
        return
        yield  # an async generator that yields nothing: the weights are already in place

    def close(self) -> None:
        self._sync.close()
