"""refit as a vLLM weight transfer backend: ``--weight-transfer-config '{"backend": "refit"}'``.

Engine side, ``RefitWeightTransferEngine`` (vLLM's ``WeightTransferEngine``; vLLM builds one in
every worker with the live model):

* ``init_transfer_engine(init_info)`` registers the worker's live parameters with its node's
  refitd, under a layout derived from the model as ``refit.layouts.vllm`` does (fused
  ``qkv_proj``/``gate_up_proj``, padded vocabulary, TP/DP ranks from vLLM's parallel config).
  A draft/MTP model, pipeline parallelism, or a quantization refit does not write is refused
  with an ``UnsupportedModel`` naming it.
* ``start_weight_update()`` opens the update window (no forward pass runs on this worker while
  vLLM is inside the call) and returns once a refit round PREPAREd this worker (or at once when
  the last round here had aborted before the window opened: update_weights sorts it out).
* ``receive_weights(RefitUpdateInfo(version, round_id))`` returns once the daemons COMMITted
  that version into the live tensors; an aborted round raises ``RoundAborted`` (vLLM then keeps
  the engine from serving mixed weights until a later update succeeds). With ``round_id`` (the
  trainer engine sends it) the engine waits for that round exactly; a round that aborted while
  the window was closed never counts as a later update's.
* ``finish_weight_update()`` re-derives what vLLM derives from loaded weights (attention layers'
  ``process_weights_after_loading``, e.g. MLA's absorbed matrices) and closes the window.

Trainer side, ``RefitTrainerWeightTransferEngine`` (vLLM's ``TrainerWeightTransferEngine``):
``trainer_init`` registers the trainer's tensors (live ones from ``LiveModuleSource``; any other
``WeightSource`` is staged: copied each round into registered buffers) and initialises the
engines through the client, a ``WeightSyncClient`` (its methods are checked first, before
anything registers); ``send_weights()`` runs one refit round: pause (``keep``), start the round,
``start_weight_update``, ``update_weights({"version": v, "round_id": r})``, ``finish_weight_update``,
prefix-cache reset, resume.

``register()`` is the ``vllm.general_plugins`` entry point: it registers both classes under the
name ``"refit"``. vLLM is imported only when one of them is used, so this module imports without
vLLM; the classes subclass vLLM's own bases, built on first access.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple

from refit.integrations._common import (EngineWindow, IntegrationError, RoundAborted, StagedTrainer,
                                        UnsupportedModel, env_or, group_version, open_watch, wait_ready,
                                        wait_round_end)

log = logging.getLogger("refit.integrations.vllm")

BACKEND = "refit"

__all__ = ["BACKEND", "RefitInitInfo", "RefitUpdateInfo", "RefitTrainerInitInfo", "LiveModuleSource",
           "WeightSyncClient", "missing_client_methods", "RefitWeightTransferEngine",
           "RefitTrainerWeightTransferEngine", "register", "RoundAborted", "UnsupportedModel",
           "IntegrationError"]

# Quantization methods whose live weights refit writes as they are: unquantized, and block fp8
# (refitd quantizes the trainer's bf16 into the weights and their scales, docs/LAYOUTS.md).
_WRITABLE_QUANT = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod",
                   "Fp8LinearMethod", "Fp8MoEMethod"}
# Speculative methods that carry no weights of their own.
_WEIGHTLESS_SPECULATION = {"ngram", "suffix"}


@dataclass
class RefitInitInfo:
    """What every engine worker needs to register (``init_weight_transfer_engine``'s dict).
    Per-host values come from the environment when left empty: ``daemon`` from $REFIT_DAEMON,
    ``node`` from $REFIT_NODE."""

    group: str = "policy"
    daemon: str = ""             # the node's refitd worker socket, "unix:/run/refitd.sock"
    node: int = -1               # this host's node id in the refit cluster
    worker_name: str = "vllm-dp{dp}-tp{tp}"
    timeout_s: float = 120.0     # how long an update waits for PREPARE, then for COMMIT
    prepare_wait_s: float = 5.0  # how long a PREPARE waits for the update window (< --prepare-timeout)
    # "update": the daemon writes only inside start/finish_weight_update (vLLM's own update calls);
    # "idle": the stack guarantees no generation during its sync step and sends no update calls
    # here (verl's and NeMo-RL's checkpoint engines): PREPARE is accepted whenever it comes.
    window: str = "update"
    register_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.window not in ("update", "idle"):
            raise ValueError(f"RefitInitInfo.window must be 'update' or 'idle', not {self.window!r}")


@dataclass
class RefitUpdateInfo:
    """One update (``update_weights``' dict): the refit version the trainer's round writes, and
    that round's id (``start_refit``'s answer; 0: not known). With the id, the engine waits for
    exactly that round, even one that aborted before the engine's update window opened; without
    it, for the round that PREPAREs the engine inside the window."""

    version: int
    round_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version <= 0:
            raise ValueError(f"RefitUpdateInfo.version must be a positive integer, not {self.version!r}")
        if isinstance(self.round_id, bool) or not isinstance(self.round_id, int) or self.round_id < 0:
            raise ValueError(f"RefitUpdateInfo.round_id must be a round id (0: not known), not {self.round_id!r}")


@dataclass
class RefitTrainerInitInfo:
    """The trainer side's settings (``trainer_init``). ``engine`` is sent to every engine worker as
    its ``RefitInitInfo`` (``group`` is filled in)."""

    control: str = ""            # any refitd's control address, "127.0.0.1:7070"
    daemon: str = ""             # this host's refitd worker socket ($REFIT_DAEMON)
    group: str = "policy"
    node: int = -1               # this host's node id ($REFIT_NODE)
    engine: Dict[str, Any] = field(default_factory=dict)
    # How long one send_weights() may take, in all: on rank 0 the wait for the group to be ready
    # (both sides registered), then the round; on the other ranks the wait for rank 0's round to
    # reach them and end.
    timeout_s: float = 120.0
    pause: bool = True           # pause_generation(mode="keep") / resume_generation() around a round
    rank: int = 0                # this trainer process's rank; rank 0 is the sender
    # How many trainer ranks register (DTensor parameters: every rank); 0: torch.distributed's
    # world size where it is initialized (a `layout=` gives its own: a worker per rank). Declared
    # with `rank` at registration, so the daemons name a rank that is missing (docs/PYTHON.md,
    # "Trainer ranks").
    world_size: int = 0
    # The trainer worker's name in the refit group (format string with {rank}), as `refitctl
    # workers` and a round's culprit show it.
    worker_name: str = "trainer-rank{rank}"

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class WeightSyncClient(Protocol):
    """What the trainer engine calls on its ``client`` (``trainer_init(..., client=...)``): vLLM's
    ``VLLMWeightSyncClient`` (the first four: they fan out to every engine worker, e.g. over
    ``LLM``/``AsyncLLM``, vLLM's HTTP routes or a Ray actor) and three calls of the engine client
    itself. ``trainer_init`` checks, before it registers anything, that the client has each of
    them and raises ``IntegrationError`` naming those missing; ``pause_generation`` and
    ``resume_generation`` are needed only with ``RefitTrainerInitInfo.pause`` (the default)."""

    def init_weight_transfer_engine(self, init_info: Dict[str, Any]) -> None:
        """Once, from ``trainer_init``: every engine worker's ``init_weight_transfer_engine``
        with this dict (a ``RefitInitInfo``)."""

    def start_weight_update(self) -> None:
        """Every engine worker's ``start_weight_update`` (returns once PREPAREd, or once its
        window is open when the last round there had aborted before)."""

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        """Every engine worker's ``update_weights({"version": v, "round_id": r})`` (returns once
        round r COMMITted v)."""

    def finish_weight_update(self) -> None:
        """Every engine worker's ``finish_weight_update``."""

    def pause_generation(self, mode: str) -> None:
        """The engine client's: called with ``mode="keep"`` before a round."""

    def resume_generation(self) -> None:
        """The engine client's: after a committed round."""

    def reset_prefix_cache(self) -> Any:
        """The engine client's: after a committed round (KV of the old weights is stale)."""


_ALWAYS_CALLED = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                  "finish_weight_update", "reset_prefix_cache")
_PAUSE_CALLS = ("pause_generation", "resume_generation")


def missing_client_methods(client: Any, pause: bool = True) -> List[str]:
    """The ``WeightSyncClient`` methods ``client`` lacks (not callable attributes), in call order;
    ``pause``: whether the pause/resume calls are needed too."""
    wanted = _ALWAYS_CALLED + (_PAUSE_CALLS if pause else ())
    return [m for m in wanted if not callable(getattr(client, m, None))]


class LiveModuleSource:
    """A ``WeightSource`` over a module's live parameters that also hands refit the parameters
    themselves: the trainer then registers its live tensors and a round gathers nothing.

    What each trainer rank registers (``trainer_init``):

    * DTensor parameters (FSDP2, TP, HSDP): every rank registers its local shards as they are,
      placed by their placements (``refit.layouts.dtensor.trainer_worker``);
    * plain tensors: they are taken to be full tensors (every rank holding the whole model, as
      DDP or a single process does): rank 0 alone registers them, as full replicas, and the
      other ranks register nothing;
    * ``layout=``: a trainer that shards plain tensors by hand describes its sharding with a
      layout of all its ranks (``refit.layouts.dtensor.trainer_layout``, workers named as
      ``RefitTrainerInitInfo.worker_name`` names them, ``trainer-rank{rank}`` by default); every
      rank registers its own worker of it, each buffer being the parameter of the same name.

    Iterating it (what other backends do) materialises full tensors as vLLM's ``ModuleSource``
    does."""

    def __init__(self, module: Any, layout: Optional[Dict[str, Any]] = None) -> None:
        self.module = module
        self.layout = layout

    def live_tensors(self) -> Dict[str, Any]:
        return dict(self.module.named_parameters())

    def metadata(self) -> List[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        for name, p in self.module.named_parameters():
            full = getattr(p, "full_tensor", None)
            yield name, (full() if callable(full) else p)


# ------------------------------------------------------------------------------------------------
# Engine side.

def _speculative_problem(vllm_config: Any) -> Optional[str]:
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None) or "draft_model"
    if method in _WEIGHTLESS_SPECULATION:
        return None
    return (f"speculative decoding with weights of its own (speculative_config.method={method!r}): refit "
            "writes the target model only, and a draft/MTP model left at old weights would propose "
            "tokens from another policy; serve without it, or use n-gram speculation")


def _quantization_problems(model: Any) -> List[str]:
    bad = []
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None:
            continue
        kind = type(qm).__name__
        if kind not in _WRITABLE_QUANT:
            bad.append(f"{name or '<root>'} ({kind})")
    return bad


def _parallel_ranks(pc: Any) -> Dict[str, int]:
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise UnsupportedModel(f"pipeline_parallel_size {pp}: refit's vLLM layouts cover TP and DP ranks only")
    dp_rank = getattr(pc, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(pc, "data_parallel_rank", 0)
    return dict(tp_size=tp, tp_rank=int(getattr(pc, "rank", 0)) % tp,
                dp_size=int(getattr(pc, "data_parallel_size", 1) or 1), dp_rank=int(dp_rank or 0))


def post_process_derived(model: Any, model_config: Any) -> int:
    """Re-derives what attention layers compute from their loaded weights (vLLM's
    ``process_weights_after_loading`` on Attention / MLAAttention modules, e.g. DeepSeek's absorbed
    ``W_UK_T``/``W_UV``). Quantization methods are not re-run: refit wrote their live form.
    Returns the modules processed."""
    dtype = getattr(model_config, "dtype", None)
    n = 0
    for _, module in model.named_modules():
        fn = getattr(module, "process_weights_after_loading", None)
        if callable(fn) and type(module).__name__.endswith("Attention"):
            fn(dtype)
            n += 1
    return n


# The hf_config fields the layout cannot do without; the others have defaults
# (refit.layouts.vllm.EngineConfig.from_hf_config).
_REQUIRED_HF_FIELDS = ("num_attention_heads",)
_INTEGER_HF_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "intermediate_size",
                      "moe_intermediate_size", "q_lora_rank", "kv_lora_rank")


def _check_hf_config(hf_config: Any) -> None:
    """Raises UnsupportedModel naming the hf_config fields that are missing or not integers."""
    def get(key: str) -> Any:
        return hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)

    missing = [k for k in _REQUIRED_HF_FIELDS if get(k) is None]
    if missing:
        raise UnsupportedModel(f"vllm_config.model_config.hf_config lacks {', '.join(missing)}: refit derives the "
                               "engine's layout from a vLLM model's config (num_attention_heads, num_key_value_heads, "
                               "head_dim, vocab_size, intermediate_size, tie_word_embeddings: docs/INTEGRATIONS.md, "
                               "\"What the engine's model must look like\")")
    bad = [f"{k}={get(k)!r}" for k in _INTEGER_HF_FIELDS
           if get(k) is not None and (isinstance(get(k), bool) or not isinstance(get(k), int))]
    if bad:
        raise UnsupportedModel(f"vllm_config.model_config.hf_config has non-integer {', '.join(bad)}")


class _EngineImpl:
    """The body of RefitWeightTransferEngine (see the module's docstring)."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    # Set by vLLM's WeightTransferEngine.__init__ (declared for the type checker only).
    config: Any
    vllm_config: Any
    parallel_config: Any
    model_config: Any
    device: Any
    model: Any
    # vLLM asks this before pointing an update at a draft model: refit registered the target's
    # tensors only.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)  # type: ignore[call-arg]
        self.worker: Any = None
        self.window: Optional[EngineWindow] = None
        self.info: Optional[RefitInitInfo] = None
        self._in_update = False               # between start_weight_update and its end
        self._prepared: Optional[int] = None  # the version of the round prepared in the window
        self._received: Optional[int] = None  # the version update_weights saw committed
        self.post_processed = 0

    # vLLM calls this to aim an update at its draft model.
    def set_weight_update_target(self, model: Any, model_config: Any) -> None:
        if model is not getattr(self, "_default_model", model):
            raise UnsupportedModel("refit cannot update a draft/MTP model: only the target model's "
                                   "parameters are registered with refitd")
        super().set_weight_update_target(model, model_config)  # type: ignore[misc]

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        import refit
        from refit.layouts.vllm import EngineConfig, engine_worker
        if self.worker is not None:
            raise IntegrationError("init_transfer_engine was already called: this worker is registered")
        problem = _speculative_problem(self.vllm_config)
        if problem:
            raise UnsupportedModel(problem)
        bad = _quantization_problems(self.model)
        if bad:
            raise UnsupportedModel(f"refit does not produce these modules' quantized weights: {', '.join(bad[:5])} "
                                   "(unquantized and block-fp8 models are written live)")
        daemon = env_or(init_info.daemon, "REFIT_DAEMON")
        if not daemon:
            raise IntegrationError("no refitd to register with: set init_info['daemon'] "
                                   "('unix:/path/refitd.sock') or $REFIT_DAEMON on every engine host")
        node = int(env_or(init_info.node if init_info.node >= 0 else None, "REFIT_NODE", 0))
        ranks = _parallel_ranks(self.parallel_config)
        hf_config = getattr(self.model_config, "hf_config", None)
        if hf_config is None:
            raise IntegrationError("vllm_config.model_config has no hf_config to derive the layout from")
        _check_hf_config(hf_config)
        cfg = EngineConfig.from_hf_config(hf_config, **ranks)
        params = dict(self.model.named_parameters())
        gpu = getattr(self.device, "index", None)
        layout = engine_worker(params, cfg, node=node, gpu=0 if gpu is None else int(gpu),
                               worker_name=init_info.worker_name)
        buffers = [b["name"] for w in layout["workers"] for b in w["buffers"]]
        tensors = {name: params[name] for name in buffers}
        self.window = EngineWindow(init_info.prepare_wait_s, always_open=init_info.window == "idle")
        on_commit: Callable[..., None] = self.window.on_commit
        if init_info.window == "idle":
            on_commit = self._commit_while_idle
        self.info = init_info
        # The window's callbacks take the round's id; on_round_end stops a PREPARE waiting for
        # the window once its round is over.
        self.worker = refit.Worker(daemon, init_info.group, "inference", layout, tensors,
                                   on_prepare=self.window.on_prepare, on_commit=on_commit,
                                   on_abort=self.window.on_abort, on_round_end=self.window.on_round_end,
                                   register_timeout=init_info.register_timeout_s)
        log.info("vLLM worker %s registered %d parameters with %s (group %s)", self.worker.name, len(tensors),
                 daemon, init_info.group)

    def _require(self) -> Tuple[Any, EngineWindow, RefitInitInfo]:
        if self.worker is None or self.window is None or self.info is None:
            raise IntegrationError("refit weight transfer is not initialised: call init_weight_transfer_engine first")
        return self.worker, self.window, self.info

    def _commit_while_idle(self, version: int, round_id: Optional[int] = None) -> None:
        # No update call reaches the engine in this mode: what finish_weight_update does runs here.
        assert self.window is not None
        self.post_processed = post_process_derived(self.model, self.model_config)
        self.window.on_commit(version, round_id=round_id)

    def start_weight_update(self) -> None:
        _, window, info = self._require()
        window.enter()
        try:
            # Returns at once (None) when the last round here had aborted before the window
            # opened: that round may be this update's (update_weights' round id tells), or an
            # older one, the update's own PREPARE still to come.
            self._prepared = window.wait_prepared(info.timeout_s, unless_last_aborted=True)
        except BaseException:
            window.leave()
            raise
        self._in_update, self._received = True, None

    def _end_update(self) -> None:
        assert self.window is not None
        self._in_update, self._prepared, self._received = False, None, None
        self.window.leave()

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        _, window, info = self._require()
        version = update_info.version
        try:
            if not self._in_update:
                raise IntegrationError("update_weights without start_weight_update: no update window is open here")
            if update_info.round_id:
                window.wait_round(update_info.round_id, version, info.timeout_s)
            else:
                if self._prepared is None:
                    self._prepared = window.wait_prepared(info.timeout_s)
                if self._prepared != version:
                    raise IntegrationError(f"the refit round prepared here writes version {self._prepared}, "
                                           f"but update_weights asked for version {version}")
                window.wait_outcome(version, info.timeout_s)
        except BaseException:
            self._end_update()
            raise
        self._received = version

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        # As vLLM's base does, less its device synchronise: the daemon's copies finished before COMMIT.
        self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]

    def finish_weight_update(self) -> None:
        self._require()
        try:
            if self._received is None:
                raise IntegrationError("finish_weight_update without a received refit round")
            self.post_processed = post_process_derived(self.model, self.model_config)
        finally:
            self._end_update()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise IntegrationError("refit has no per-tensor trainer send: use RefitTrainerWeightTransferEngine "
                               "(WeightTransferTrainerFactory.trainer_init('refit', ...)).send_weights()")


# ------------------------------------------------------------------------------------------------
# Trainer side.

def _distributed_world_size() -> Optional[int]:
    """torch.distributed's world size where it is initialized, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return None


# How long trainer_init waits for an answer from the control address before blaming it.
CONTROL_CHECK_S = 5.0


class _TrainerImpl:
    init_info_cls = RefitTrainerInitInfo
    # Set by vLLM's TrainerWeightTransferEngine.__init__ (declared for the type checker only).
    config: Any
    client: Any
    source: Any
    is_sender: bool

    def __init__(self, config: Any, *, client: Any, source: Any, is_sender: bool = True) -> None:
        super().__init__(config, client=client, source=source, is_sender=is_sender)  # type: ignore[call-arg]
        self.info: Optional[RefitTrainerInitInfo] = None
        self.worker: Any = None
        self.staged: Optional[StagedTrainer] = None
        self.controller: Any = None
        # The version of the last round this rank took part in (rank 0: the last it sent).
        self.last_version = 0
        self.last_seconds = 0.0

    @classmethod
    def trainer_init(cls, config: Any, init_info: RefitTrainerInitInfo, *, client: Any, source: Any) -> Any:
        import refit
        if init_info.is_sender:  # only the sender calls the client: check it before registering
            missing = missing_client_methods(client, pause=init_info.pause)
            if missing:
                raise IntegrationError(
                    f"the trainer's client ({type(client).__name__}) lacks {', '.join(missing)}: the refit "
                    "trainer engine calls refit.integrations.vllm.WeightSyncClient's methods on it "
                    "(vLLM's VLLMWeightSyncClient plus pause_generation, resume_generation and "
                    "reset_prefix_cache of the engine client; pause/resume only with pause=True)")
        engine = cls(config, client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        control = init_info.control
        if engine.is_sender:
            if not control:
                raise IntegrationError("RefitTrainerInitInfo.control is empty: the sender needs a refitd control address")
            engine.controller = _reach_control(control)
        try:
            daemon = env_or(init_info.daemon, "REFIT_DAEMON")
            node = int(env_or(init_info.node if init_info.node >= 0 else None, "REFIT_NODE", 0))
            live = source.live_tensors() if hasattr(source, "live_tensors") else None
            if live is not None:
                engine._register_live(live, daemon, node)
            elif engine.is_sender:
                engine.staged = StagedTrainer(daemon, init_info.group, control, node=node,
                                              timeout_s=init_info.timeout_s)
            if engine.is_sender:
                engine_info = dict(init_info.engine)
                engine_info.setdefault("group", init_info.group)
                client.init_weight_transfer_engine(engine_info)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _register_live(self, params: Dict[str, Any], daemon: Optional[str], node: int) -> None:
        import refit
        from refit import layout_io
        from refit.layouts import dtensor
        assert self.info is not None
        given = getattr(self.source, "layout", None)
        sharded = given is not None or any(hasattr(p, "placements") for p in params.values())
        if not sharded and not self.is_sender:
            return  # plain tensors: rank 0's full replicas are the trainer side
        if not daemon:
            raise IntegrationError("no refitd to register with: set RefitTrainerInitInfo.daemon or $REFIT_DAEMON")
        name = self.info.worker_name.format(rank=self.info.rank)
        if given is not None:
            layout = given
            mine, _ = layout_io.one_worker(given, name)
            missing = [b.name for b in mine.buffers if b.name not in params]
            if missing:
                raise IntegrationError(f"worker {name!r} of the trainer layout has buffers that name no parameter "
                                       f"of the module: {', '.join(missing[:5])}")
            tensors = {b.name: params[b.name] for b in mine.buffers}
            world_size: Optional[int] = len(layout_io.to_proto(given).workers)  # a worker per rank
        elif sharded:
            layout = dtensor.trainer_worker(params, rank=self.info.rank, node=node, worker_name=self.info.worker_name)
            tensors = dtensor.local_buffers(params)
            world_size = self.info.world_size or _distributed_world_size()
        else:  # rank 0's full replicas: the trainer side is this one worker
            layout = dtensor.trainer_worker(params, rank=self.info.rank, node=node, worker_name=self.info.worker_name)
            tensors = dtensor.local_buffers(params)
            world_size = 1
        # With the world size known, the daemons name a trainer rank that is not registered.
        declared: Dict[str, Any] = dict(rank=self.info.rank, world_size=world_size) if world_size else {}
        # Blocking: the worker answers a round only inside this rank's send_weights(), so no round
        # reads a rank whose optimizer step has not finished; a rank that never gets there fails
        # the round at the daemons' PREPARE deadline, named.
        self.worker = refit.Worker(daemon, self.info.group, "trainer", layout, tensors, name=name,
                                   blocking=True, **declared)

    def send_weights(self) -> None:
        assert self.info is not None
        if self.staged is not None:
            self.staged.stage(iter(self.source))
        elif self.worker is None and not self.is_sender:
            _drain_source(self.source)  # the source's collectives run on every rank
        if not self.is_sender:
            if self.worker is not None:
                self._take_part()
            return
        self._run_round()

    def _serve_until(self, deadline: float, first_round: int = 0) -> Any:
        """This rank's worker serves the next round (from `first_round` on: earlier ones are
        over) until it ends; returns its refit.Round, or None when none came by `deadline`."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r = self.worker.serve(timeout=left, round_timeout=max(left, 1.0))
            if r is None or r.round_id >= first_round:
                return r

    def _take_part(self) -> None:
        """A rank other than 0: its part of the round rank 0 starts."""
        info = self.info
        assert info is not None
        r = self._serve_until(time.monotonic() + info.timeout_s)
        if r is None:
            raise IntegrationError(f"no refit round reached trainer rank {info.rank} within {info.timeout_s:g} s "
                                   "(rank 0 starts it in its send_weights(): did it get there? "
                                   "RefitTrainerInitInfo.timeout_s sets this wait)")
        if not r.committed:
            raise RoundAborted(f"refit round of version {r.version} aborted: {r.reason}", r.reason)
        self.last_version = r.version

    def _run_round(self) -> None:
        info, ctl, client = self.info, self.controller, self.client
        assert info is not None and ctl is not None
        deadline = time.monotonic() + info.timeout_s
        wait_ready(ctl, info.group, info.timeout_s)
        version = max(group_version(ctl, info.group), self.last_version) + 1
        t0 = time.monotonic()
        if info.pause:
            client.pause_generation(mode="keep")
        # Opened before the round starts, so that none of its events is missed.
        stream = open_watch(ctl, info.group, max(0.01, deadline - time.monotonic()))
        try:
            try:
                round_id = self._start(version, deadline)
            except BaseException:
                if info.pause:  # no round started: the engines' weights are whole, let them serve
                    client.resume_generation()
                raise
            own = _OwnPart(self, round_id, deadline) if self.worker is not None else None
            step = "start_weight_update"
            try:
                client.start_weight_update()
                step = "update_weights"
                # The round's id: the engines then wait for this round exactly, even where it
                # aborted before their update window opened.
                client.update_weights(dataclasses.asdict(RefitUpdateInfo(version, round_id=round_id)))
                step = "finish_weight_update"
                client.finish_weight_update()
            except Exception as e:
                # The round this call started must end before the next send_weights() can start one:
                # waited out here (the engines' prepare_wait_s and the daemons' deadlines bound
                # it). Refusing it from this rank would end it sooner, but could leave an engine
                # worker's PREPARE of it pending into the next round. The engines keep vLLM from
                # serving the partial weights.
                ended = self._wait_out(round_id, stream, own, deadline)
                raise IntegrationError(f"refit round of version {version} failed "
                                       f"{self._where(round_id, e, ended)}; the engine client's {step} raised: {e}") from e
            # The engines return at their COMMIT; the round ends once every worker acknowledged it.
            result = wait_round_end(ctl, info.group, round_id, max(0.0, deadline - time.monotonic()), stream)
            stream = None
            mine = own.join(deadline) if own is not None else None
        finally:
            if stream is not None:
                stream.close()
        if not result.committed or (mine is not None and not mine.committed):
            reason = result.reason or getattr(mine, "reason", "")
            raise IntegrationError(f"refit round of version {version} aborted after the engines' update calls "
                                   f"returned: {reason}")
        self._await_status_version(version, deadline)
        client.reset_prefix_cache()  # KV computed with the old weights must not be reused
        if info.pause:
            client.resume_generation()
        self.last_version = version
        self.last_seconds = time.monotonic() - t0

    def _start(self, version: int, deadline: float) -> int:
        """start_refit, after the round still running in the group (e.g. one a failed call
        started, or one whose end the coordinator is recording) ended."""
        from refit.errors import RefitError
        assert self.info is not None
        ctl, group = self.controller, self.info.group
        while True:
            try:
                return int(ctl.start_refit(group, version))
            except RefitError as e:
                if "already running a round" not in e.reason or time.monotonic() >= deadline:
                    raise
                running = [r for r in ctl.rounds(group, limit=16) if r.state not in ("COMMITTED", "ABORTED")]
                log.info("group %r is still running round %s; starting version %d after it", group,
                         running[-1].round_id if running else "?", version)
                if running:
                    try:
                        wait_round_end(ctl, group, running[-1].round_id, max(0.0, deadline - time.monotonic()))
                    except IntegrationError:
                        raise e from None
                else:  # logged as ended, not yet released: a matter of microseconds
                    time.sleep(0.005)

    def _wait_out(self, round_id: int, stream: Any, own: Optional["_OwnPart"], deadline: float) -> Any:
        """The failed round's end (its RoundResult), or None when it did not end by `deadline`."""
        assert self.info is not None
        try:
            ended = wait_round_end(self.controller, self.info.group, round_id,
                                   max(0.0, deadline - time.monotonic()), stream)
        except Exception as e:  # noqa: BLE001 (the caller raises the client's error anyway)
            log.warning("round %d did not end after the engine client's calls failed: %s", round_id, e)
            ended = None
        if own is not None:
            own.join(deadline)
        return ended

    def _await_status_version(self, version: int, deadline: float) -> None:
        """The group's status shows `version` a moment after the round's end is published."""
        assert self.info is not None
        while group_version(self.controller, self.info.group) < version and time.monotonic() < deadline:
            time.sleep(0.005)

    def _where(self, round_id: int, error: Exception, ended: Any = None) -> str:
        """Where a failed round failed, for its message: on the trainer's or the engines' side
        when the daemons named a worker (the round log's culprit, else the one the error's reason
        names), at a node, or in the engine client's calls when no culprit was named."""
        from refit.controller import parse_reason
        assert self.info is not None and self.controller is not None
        culprit = getattr(error, "culprit", None)
        if ended is not None and ended.culprit:
            culprit = ended.culprit
        else:
            try:
                for r in self.controller.rounds(self.info.group, limit=16):
                    if r.round_id == round_id and r.culprit:
                        culprit = r.culprit
            except Exception:  # noqa: BLE001 (a better message only, on a path that raises anyway)
                pass
        reason = getattr(error, "reason", None)
        if culprit is None and reason:
            culprit = parse_reason(reason)[1]
        if culprit is None:
            return "in the engine client's calls (the daemons named no culprit)"
        mine = self.worker is not None and culprit == f'worker "{self.info.group}/{self.worker.name}"'
        if not culprit.startswith('worker "'):
            return f"at {culprit}"
        worker_id = culprit[len('worker "'):-1]
        try:
            roles = {w.get("worker_id"): w.get("role") for w in self.controller.workers(self.info.group)}
        except Exception:  # noqa: BLE001
            roles = {}
        if mine or roles.get(worker_id) == "TRAINER":
            return f"on the trainer's side ({culprit})"
        if roles.get(worker_id) == "INFERENCE":
            return f"on the engines' side ({culprit})"
        return f"at {culprit}"

    def shutdown(self) -> None:
        for closer in (self.worker, self.staged, self.controller):
            if closer is not None:
                closer.close()
        self.worker = self.staged = self.controller = None


class _OwnPart:
    """Rank 0's own trainer worker serving the round it started, on a thread of its own while
    rank 0 drives the engine client's calls."""

    def __init__(self, trainer: _TrainerImpl, round_id: int, deadline: float) -> None:
        self.round: Any = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, args=(trainer, round_id, deadline),
                                        name=f"refit-trainer-round-{round_id}", daemon=True)
        self._thread.start()

    def _serve(self, trainer: _TrainerImpl, round_id: int, deadline: float) -> None:
        try:
            self.round = trainer._serve_until(deadline, first_round=round_id)
        except BaseException as e:  # noqa: BLE001 (reported by join)
            self.error = e

    def join(self, deadline: float) -> Any:
        """The refit.Round this rank served (None: none came by `deadline`)."""
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if self.error is not None:
            raise IntegrationError(f"the trainer's worker failed while serving the round: {self.error}") from self.error
        return self.round


def _reach_control(control: str) -> Any:
    """A Controller of `control`, once it answered (within CONTROL_CHECK_S); an IntegrationError
    naming the address when it does not."""
    import refit
    from refit.errors import Error
    ctl = refit.Controller(control)
    try:
        ctl.status(timeout=CONTROL_CHECK_S)
    except Error as e:
        ctl.close()
        raise IntegrationError(f"no refitd answers at the control address {control!r} (RefitTrainerInitInfo.control) "
                               f"within {CONTROL_CHECK_S:g} s: {e}. Is refitd running there, listening on that "
                               "address (its --listen)?") from None
    return ctl


def _drain_source(source: Any) -> None:
    for _ in source:
        pass


# ------------------------------------------------------------------------------------------------
# The classes vLLM loads, built on first access over vLLM's own bases.

_built: Dict[str, type] = {}
_build_lock = threading.Lock()


def _build(name: str) -> type:
    with _build_lock:
        if name in _built:
            return _built[name]
        try:
            from vllm.distributed.weight_transfer import base
        except ImportError as e:
            raise ImportError(f"refit.integrations.vllm.{name} needs vLLM (vllm.distributed.weight_transfer): {e}") from e
        if name == "RefitWeightTransferEngine":
            cls = type(name, (_EngineImpl, base.WeightTransferEngine), {"__module__": __name__,
                                                                        "__doc__": _EngineImpl.__doc__})
        else:
            from vllm.config.weight_transfer import WeightTransferConfig
            cls = type(name, (_TrainerImpl, base.TrainerWeightTransferEngine),
                       {"__module__": __name__, "config_cls": WeightTransferConfig,
                        "__doc__": "refit's TrainerWeightTransferEngine: send_weights() runs one refit round."})
        _built[name] = cls
        return cls


def __getattr__(name: str) -> Any:
    if name in ("RefitWeightTransferEngine", "RefitTrainerWeightTransferEngine"):
        return _build(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point (run in every vLLM process, possibly more than
    once): registers the engine and the trainer engine as backend ``"refit"``, lazily."""
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)
    for factory, cls_name in ((WeightTransferEngineFactory, "RefitWeightTransferEngine"),
                              (WeightTransferTrainerFactory, "RefitTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, cls_name)
        except ValueError:
            log.debug("%s: backend %r already registered", factory.__name__, BACKEND)
