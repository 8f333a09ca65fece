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

import asyncio
from typing import Any, AsyncGenerator, Dict, Iterable, List, Optional, Tuple

from nemo_rl.utils.checkpoint_engines.base import CheckpointEngine

from refit.integrations._common import (IntegrationError, StagedTrainer, drain, env_or, group_version,
                                        wait_group_version_above)

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
        self.control = env_or(control, "REFIT_CONTROL", "")
        self.daemon = env_or(daemon, "REFIT_DAEMON", "")
        self.group = group
        self.node = int(env_or(node if node >= 0 else None, "REFIT_NODE", 0))
        self.timeout_s = timeout_s
        self._staged: Optional[StagedTrainer] = None
        self._sender = False
        self._controller: Any = None
        self._seen = 0

    def _ctl(self) -> Any:
        if self._controller is None:
            import refit
            if not self.control:
                raise IntegrationError(f"refit_cfg['{TRANSPORT}'].control is empty: give a refitd control "
                                       "address ('host:port') or set $REFIT_CONTROL")
            self._controller = refit.Controller(self.control)
        return self._controller

    def prepare(self) -> Dict[str, Any]:
        return {"backend": "refit", "group": self.group}

    def init_policy_process_group(self, *, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: List[Any]) -> None:
        self._sender = worker_rank == 0
        if self._sender and self._staged is None:
            if not self.daemon:
                raise IntegrationError(f"refit_cfg['{TRANSPORT}'].daemon is empty: give this host's refitd "
                                       "worker socket ('unix:/path') or set $REFIT_DAEMON")
            self._ctl()
            self._staged = StagedTrainer(self.daemon, self.group, self.control, node=self.node,
                                         timeout_s=self.timeout_s)

    def init_rollout_process_group(self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: List[Any]) -> None:
        self._seen = group_version(self._ctl(), self.group)

    def finalize(self) -> None:
        if self._staged is not None:
            self._staged.close()
            self._staged = None
        if self._controller is not None:
            self._controller.close()
            self._controller = None

    async def send_weights(self, weights: Iterable[Tuple[str, Any]]) -> None:
        if not self._sender:
            drain(weights)
            return
        if self._staged is None:
            raise IntegrationError("send_weights before init_policy_process_group (or after finalize)")
        self._staged.stage(weights)
        await asyncio.to_thread(self._staged.round)

    async def receive_weight_batches(self) -> AsyncGenerator[List[Tuple[str, Any]], None]:
        floor = self._seen
        self._seen = await asyncio.to_thread(wait_group_version_above, self._ctl(), self.group, floor,
                                             self.timeout_s)
        return
        yield  # no batch: the weights are already in place
