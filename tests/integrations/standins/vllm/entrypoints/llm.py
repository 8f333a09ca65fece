"""Stand-in for the engine client (vllm.LLM / AsyncLLM): weight-transfer calls fan out to every
worker through collective_rpc (each worker a process of its own in vLLM: here a thread each, so
a worker that blocks inside update_weights does not block the others); pause_generation
(mode "abort" | "wait" | "keep"), resume_generation and reset_prefix_cache act on the scheduler.
Generation reuses the prefix cache: a cache computed with old weights gives old answers."""
from concurrent.futures import ThreadPoolExecutor

from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest


class LLM:
    def __init__(self, workers):
        self.workers = list(workers)
        self.paused = False
        self.prefix_cache = {}
        self.prefix_cache_resets = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.workers)))

    def collective_rpc(self, method: str, args: tuple = ()):
        futures = [self._pool.submit(getattr(w, method), *args) for w in self.workers]
        return [f.result() for f in futures]

    def init_weight_transfer_engine(self, request: WeightTransferInitRequest) -> None:
        self.collective_rpc("init_weight_transfer_engine", (request.init_info,))

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, request: WeightTransferUpdateRequest) -> None:
        self.collective_rpc("update_weights", (request.update_info,))

    def finish_weight_update(self) -> None:
        self.collective_rpc("finish_weight_update")

    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"unknown pause mode {mode!r}")
        self.paused = True

    def resume_generation(self) -> None:
        self.paused = False

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache.clear()
        self.prefix_cache_resets += 1
        return True

    def generate(self, token_ids, max_tokens: int):
        if self.paused:
            raise RuntimeError("generation is paused")
        key = (tuple(token_ids), max_tokens)
        if key not in self.prefix_cache:
            self.prefix_cache[key] = self.collective_rpc("execute_model", (list(token_ids), max_tokens))[0]
        return self.prefix_cache[key]

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")
        self._pool.shutdown()
