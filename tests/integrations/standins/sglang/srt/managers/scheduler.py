"""Stand-in for the scheduler state the weight-update routes act on: generation paused or not,
a weight-update session (begin/end, one at a time; end runs the model's post_load_weights when
no load_weights happened in it), the weight version (server_args.weight_version), a prefix cache
that pause flushes in "abort"/"retract" mode."""
import threading


class Scheduler:
    def __init__(self, model, weight_version: str = "default"):
        self.model = model
        self.weight_version = weight_version
        self.paused = False
        self.weight_update_in_progress = False
        self._loaded_in_session = False
        self.prefix_cache = {}
        self.post_loads = 0
        self.lock = threading.Lock()

    def pause_generation(self, mode: str) -> None:
        self.paused = True
        if mode in ("abort", "retract"):
            self.prefix_cache.clear()

    def continue_generation(self) -> None:
        self.paused = False

    def begin_weight_update(self, selector: str) -> None:
        assert not self.weight_update_in_progress, "session already open"
        self.weight_update_in_progress = True
        self._loaded_in_session = False

    def load_weights(self, weights) -> None:
        assert self.weight_update_in_progress, "update_weights_from_* requires an open session"
        self._loaded_in_session = True

    def end_weight_update(self) -> None:
        assert self.weight_update_in_progress, "end without begin"
        if not self._loaded_in_session:
            self.model.post_load_weights()
            self.post_loads += 1
        self.weight_update_in_progress = False

    def flush_cache(self) -> bool:
        if not self.paused and self.weight_update_in_progress:
            return False
        self.prefix_cache.clear()
        return True

    def generate(self, ids, n):
        if self.paused or self.weight_update_in_progress:
            raise RuntimeError("generation is paused")
        key = (tuple(ids), n)
        if key not in self.prefix_cache:
            self.prefix_cache[key] = self.model.greedy(ids, n)
        return self.prefix_cache[key]
