"""refit as a NeMo-RL checkpoint engine:
``policy.generation.refit_transport: "refit.integrations.nemo_rl:RefitCheckpointEngine"`` with its
settings under ``policy.generation.refit_cfg["refit.integrations.nemo_rl:RefitCheckpointEngine"]``
(``control``, ``daemon``, ``group``, ``node``, ``timeout_s``).

* Policy side: the worker of rank 0 stages the policy's ``(name, tensor)`` stream into buffers
  registered with refitd (the first refit allocates them) and runs one refit round per
  ``send_weights``; other ranks drain the stream (its collectives run on every rank).
* Generation side: ``receive_weight_batches()`` returns once the group committed a newer version
  and yields no batch: refit wrote the vLLM workers' live weights, which registered through
  ``refit.integrations.vllm`` (``window="idle"``: NeMo-RL refits between generation phases).
"""
from __future__ import annotations

from typing import Any, AsyncGenerator, Dict, Iterable, List, Tuple

from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

from refit.integrations._common import IntegrationError, StagedSync, env_or

TRANSPORT = "refit.integrations.nemo_rl:RefitCheckpointEngine"

__all__ = ["TRANSPORT", "RefitCheckpointEngine", "IntegrationError"]


class RefitCheckpointEngine(CheckpointEngine):
    """See the module's docstring."""

    shard_expert_weights = False

    def __init__(self, bucket_size: int, *, control: str = "", daemon: str = "", group: str = "policy",
                 node: int = -1, timeout_s: float = 120.0, **unused: Any) -> None:
        if unused:
            # NeMo-RL passes its common refit_cfg keys (e.g. update_weights_bucket_memory_ratio) too.
            unknown = sorted(k for k in unused if not k.startswith("update_weights_"))
            if unknown:
                raise IntegrationError(f"unknown refit_cfg keys for {TRANSPORT}: {', '.join(unknown)}")
        self.bucket_size = bucket_size  # unused: refit moves weights without buckets
        self.group = group
        self._sender = False
        self._sync = StagedSync(control=env_or(control, "REFIT_CONTROL", ""), daemon=env_or(daemon, "REFIT_DAEMON", ""),
                                group=group, node=int(env_or(node if node >= 0 else None, "REFIT_NODE", 0)),
                                timeout_s=timeout_s, config=f"refit_cfg['{TRANSPORT}']")

    @property
    def committed_version(self) -> int:
        """The version this rank's last send_weights committed (0: none yet, or not the sending rank)."""
        return self._sync.committed_version

    def prepare(self) -> Dict[str, Any]:
        return {"backend": "refit", "group": self.group}

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: List[Any]) -> None:
        self._sender = worker_rank == 0
        if self._sender:
            self._sync.start_sender()

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: List[Any]) -> None:
        self._sync.start_receiver()

    def finalize(self) -> None:
        self._sync.close()

    async def send_weights(self, weights: Iterable[Tuple[str, Any]]) -> None:
        await self._sync.send(weights, sending=self._sender,
                              not_started="send_weights before init_policy_process_group (or after finalize)")

    async def receive_weight_batches(self) -> AsyncGenerator[List[Tuple[str, Any]], None]:
        await self._sync.wait_next()
        return
        yield  # no batch: the weights are already in place
