"""Stand-in for the weight-transfer part of vllm/v1/worker/gpu_worker.py, as
tests/v1/worker/test_gpu_worker_weight_transfer.py (vllm-project/vllm) pins it: general plugins
load in every worker process; the engine comes from WeightTransferEngineFactory.create_engine
with the worker's live model; start/update/finish form one session (a second start, an update or
a finish outside a session raise); a failed update or finish latches the worker unhealthy
("mixed generations") until weights are reloaded; the target is reset after every session.
Forward passes run on the same thread as these calls, so none runs inside a session."""
import threading

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.plugins import load_general_plugins


class Worker:
    def __init__(self, vllm_config, model, device, rank: int = 0):
        load_general_plugins()
        self.vllm_config = vllm_config
        self.model = model
        self.device = device
        self.rank = rank
        self.weight_transfer_engine = None
        if vllm_config.weight_transfer_config is not None:
            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                vllm_config.weight_transfer_config, vllm_config, device, model)
        self._weight_update_active = False
        self._weight_update_failed = False
        # One thread runs RPCs and forward passes, as a vLLM worker process does.
        self._busy = threading.Lock()

    def _engine(self):
        if self.weight_transfer_engine is None:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config "
                               "to enable weight transfer.")
        return self.weight_transfer_engine

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        engine = self._engine()
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        engine = self._engine()
        if self._weight_update_failed:
            raise RuntimeError("weights hold mixed generations after a failed update; reload them first")
        if self._weight_update_active:
            raise RuntimeError("a weight update is already active")
        engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info: dict) -> None:
        engine = self._engine()
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights")
        try:
            engine.update_weights(update_info)
        except BaseException:
            self._fail(engine)
            raise

    def finish_weight_update(self) -> None:
        engine = self._engine()
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update without a matching start_weight_update")
        try:
            engine.finish_weight_update()
        except BaseException:
            self._fail(engine)
            raise
        self._weight_update_active = False
        engine.reset_weight_update_target()

    def _fail(self, engine) -> None:
        self._weight_update_failed = True
        self._weight_update_active = False
        engine.reset_weight_update_target()

    def reload_weights(self) -> None:
        self._weight_update_failed = False

    def check_health(self) -> None:
        if self._weight_update_active:
            raise RuntimeError("a weight update transaction is active")
        if self._weight_update_failed:
            raise RuntimeError("weights hold mixed generations after a failed update")

    def execute_model(self, token_ids, max_tokens: int):
        self.check_health()
        return self.model.greedy(token_ids, max_tokens)

    def shutdown(self) -> None:
        if self.weight_transfer_engine is not None:
            self.weight_transfer_engine.shutdown()
