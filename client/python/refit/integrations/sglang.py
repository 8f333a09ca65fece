"""refit with SGLang: the engine's weights written by refit inside SGLang's weight-update session.

Controller side, ``SGLangSession(url, control)``: ``update()`` runs one update as SGLang's RL
path does, over the server's HTTP routes:

    POST /pause_generation {"mode": ...}   stop generating (default "retract": requests go back
                                           to the queue and recompute their KV afterwards)
    POST /begin_weight_update              open the session
    refit round of version v               refitd writes the live weights
    POST /end_weight_update                close it: SGLang runs post_load_weights, since
                                           load_weights was bypassed
    POST /update_weight_version            {"new_version": str(v)}: refit's version is SGLang's
    POST /continue_generation

An aborted round closes the session, leaves generation paused and the weight version unchanged,
and raises ``RoundAborted``: the weights hold no complete version until a later update commits.

Engine side, ``EngineWorker``: registers one SGLang TP rank's live parameters with its node's
refitd (SGLang names parameters as vLLM does: ``qkv_proj``, ``gate_up_proj``; the layout comes
from ``refit.layouts.vllm``). A PREPARE is accepted only while ``in_update()`` says the rank is
inside a weight-update session, so a round never writes under a running forward pass. It runs in
the process that holds the model (SGLang's scheduler/TP worker).
"""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, Mapping, Optional

from refit.integrations._common import IntegrationError, RoundAborted, env_or, group_version

log = logging.getLogger("refit.integrations.sglang")

__all__ = ["SGLangSession", "EngineWorker", "RoundAborted", "IntegrationError"]


class SGLangSession:
    """Drives SGLang's weight-update session around refit rounds (see the module's docstring)."""

    def __init__(self, url: str, control: str, *, group: str = "policy", pause_mode: str = "retract",
                 timeout_s: float = 120.0, http_timeout_s: float = 30.0) -> None:
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be 'abort', 'retract' or 'in_place', not {pause_mode!r}")
        import refit
        self.url = url.rstrip("/")
        self.group, self.pause_mode = group, pause_mode
        self.timeout_s, self.http_timeout_s = timeout_s, http_timeout_s
        self.controller = refit.Controller(control)
        self.last_version = 0
        self.last_result: Any = None

    def _call(self, route: str, body: Optional[Mapping[str, Any]] = None, method: str = "POST") -> Dict[str, Any]:
        data = None if method == "GET" else json.dumps(dict(body or {})).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.http_timeout_s) as r:
                text = r.read().decode() or "{}"
        except urllib.error.HTTPError as e:
            raise IntegrationError(f"SGLang {method} {route}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e
        except (urllib.error.URLError, OSError) as e:
            raise IntegrationError(f"SGLang {method} {route}: {e}") from e
        reply = json.loads(text)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise IntegrationError(f"SGLang {route} failed: {reply.get('message', reply)}")
        return reply if isinstance(reply, dict) else {"reply": reply}

    def weight_version(self) -> str:
        return str(self._call("/get_weight_version", method="GET").get("weight_version"))

    def update(self, version: Optional[int] = None) -> int:
        """One update; returns the refit version now served (SGLang's weight version, as text)."""
        ctl = self.controller
        ctl.wait_ready(self.group, timeout=self.timeout_s)
        v = version if version is not None else max(group_version(ctl, self.group), self.last_version) + 1
        self._call("/pause_generation", {"mode": self.pause_mode})
        self._call("/begin_weight_update", {})
        try:
            self.last_result = ctl.refit(self.group, v, timeout=self.timeout_s)
        except Exception as e:
            self._call("/end_weight_update", {})
            reason = getattr(e, "reason", str(e))
            raise RoundAborted(f"refit round of version {v} failed; SGLang stays paused at weight version "
                               f"{self.weight_version()!r}: {reason}", reason) from e
        self._call("/end_weight_update", {})
        self._call("/update_weight_version", {"new_version": str(v)})
        self._call("/continue_generation", {})
        self.last_version = v
        return v

    def close(self) -> None:
        self.controller.close()


class EngineWorker:
    """One SGLang TP rank's live parameters registered with refitd (see the module's docstring)."""

    def __init__(self, model: Any, hf_config: Any, *, in_update: Callable[[], bool], daemon: str = "",
                 group: str = "policy", node: int = -1, tp_size: int = 1, tp_rank: int = 0, dp_size: int = 1,
                 dp_rank: int = 0, worker_name: str = "sglang-dp{dp}-tp{tp}", prepare_wait_s: float = 5.0) -> None:
        import refit
        from refit.layouts.vllm import EngineConfig, engine_worker
        daemon = env_or(daemon, "REFIT_DAEMON")
        if not daemon:
            raise IntegrationError("no refitd to register with: pass daemon='unix:/path' or set $REFIT_DAEMON")
        node = int(env_or(node if node >= 0 else None, "REFIT_NODE", 0))
        cfg = EngineConfig.from_hf_config(hf_config, tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size,
                                          dp_rank=dp_rank)
        params = dict(model.named_parameters())
        layout = engine_worker(params, cfg, node=node, worker_name=worker_name)
        tensors = {b["name"]: params[b["name"]] for w in layout["workers"] for b in w["buffers"]}
        self._in_update, self._prepare_wait_s = in_update, prepare_wait_s
        self.worker = refit.Worker(daemon, group, "inference", layout, tensors, on_prepare=self._on_prepare)

    def _on_prepare(self, version: int, round_id: Optional[int] = None) -> None:
        deadline = time.monotonic() + self._prepare_wait_s
        while True:
            # A round that ended meanwhile must not be taken by the next weight-update session.
            worker = getattr(self, "worker", None)  # None while the constructor registers it
            if round_id is not None and worker is not None and not worker.round_is_open(round_id):
                raise RuntimeError(f"refit round {round_id} (version {version}) ended before SGLang's "
                                   "weight-update session began")
            if self._in_update():
                return
            if time.monotonic() >= deadline:
                raise RuntimeError("SGLang is not inside a weight-update session (begin_weight_update) "
                                   f"within {self._prepare_wait_s:g} s")
            time.sleep(0.01)

    @property
    def version(self) -> int:
        return self.worker.version

    def close(self) -> None:
        self.worker.close()
