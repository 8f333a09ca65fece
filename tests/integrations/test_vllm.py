"""refit.integrations.vllm against the vLLM stand-in, with real refitd daemons (CPU backend,
shared memory): the plugin loaded through the `vllm.general_plugins` entry point, the engine
created by WeightTransferEngineFactory in each of two DP workers, the trainer engine by
WeightTransferTrainerFactory; several rounds after AdamW steps with every engine byte poisoned
before and checked after, greedy tokens through the engine client, derived tensors re-derived,
the prefix cache reset. Failures: a draft/MTP model is refused; a round started while the
engines serve is refused by them; a round one worker never takes part in aborts, the others'
update raises and vLLM keeps them from serving until weights are reloaded."""
import unittest

import itest  # noqa: F401  (sys.path: stand-ins, refit)
import harness
import refit
import torch
from tiny_models import HF_CONFIG, EngineModel, TrainerModel, poison_, train_step

from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (WeightTransferInitRequest, WeightTransferUpdateRequest,
                                                   WeightTransferEngine, TrainerWeightTransferEngine)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.entrypoints.llm import LLM
from vllm.v1.worker.gpu_worker import Worker

PROMPT = [3, 14, 15, 9, 2]


class SyncClient:
    """The trainer's client (refit.integrations.vllm.WeightSyncClient): vLLM's
    VLLMWeightSyncClient over the engine client (plain dicts in, requests out), plus the engine
    client's pause/resume/prefix-cache calls."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.calls = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self) -> None:
        self.calls.append("finish")
        self.llm.finish_weight_update()

    def pause_generation(self, mode: str = "abort") -> None:
        self.calls.append(f"pause:{mode}")
        self.llm.pause_generation(mode=mode)

    def resume_generation(self) -> None:
        self.calls.append("resume")
        self.llm.resume_generation()

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")
        self.llm.reset_prefix_cache()


class OneWorkerClient(SyncClient):
    """A client whose start_weight_update reaches only the first worker: the second never opens
    its update window, so it refuses the round."""

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.llm.workers[0].start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self.llm.workers[0].update_weights(update_info)


def vllm_config(dp_rank: int, dp_size: int = 2, speculative=None) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(hf_config=dict(HF_CONFIG), dtype=torch.float32),
                      parallel_config=ParallelConfig(data_parallel_size=dp_size, data_parallel_rank=dp_rank,
                                                     data_parallel_index=dp_rank),
                      weight_transfer_config=WeightTransferConfig(backend="refit"),
                      speculative_config=speculative)


class VllmAdapter(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        itest.install_entry_point()

    def setUp(self):
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--prepare-timeout", "5"])
        self.ctl = refit.Controller(self.cluster.control)
        self.closers = []

    def tearDown(self):
        for c in reversed(self.closers):
            c()
        self.ctl.close()
        self.cluster.close()

    def engines(self, dp_size=2):
        models, workers = [], []
        for dp in range(dp_size):
            m = EngineModel(seed=10 + dp)
            refit.share_module_(m)
            models.append(m)
            workers.append(Worker(vllm_config(dp, dp_size), m, torch.device("cpu")))
        llm = LLM(workers)
        self.closers.append(llm.shutdown)
        return models, llm

    def trainer_engine(self, client, source, rank=0, **info_fields):
        from refit.integrations.vllm import RefitTrainerInitInfo
        info = RefitTrainerInitInfo(control=self.cluster.control, daemon=self.cluster.daemons[0].worker_address, node=0,
                        engine={"daemon": self.cluster.daemons[1].worker_address, "node": 1, "timeout_s": 30,
                                "prepare_wait_s": 1.5},
                        timeout_s=30, rank=rank, **info_fields)
        eng = WeightTransferTrainerFactory.trainer_init("refit", WeightTransferConfig(backend="refit"), info,
                                                        client=client, source=source)
        self.closers.append(eng.shutdown)
        return eng

    def assert_engine_holds(self, trainer, engine):
        self.assertEqual(itest.mismatches(trainer, engine), [])
        self.assertTrue(itest.still_poisoned(engine), "refit wrote the padded vocabulary rows")
        for attn in engine.attentions():
            self.assertTrue(torch.equal(attn.o_t, attn._o_proj[0].weight.detach().t()))

    def test_plugin_is_loaded_through_the_entry_point(self):
        import refit.integrations.vllm as adapter
        models, llm = self.engines(dp_size=1)
        self.assertIn("refit", WeightTransferEngineFactory._registry)
        self.assertIn("refit", WeightTransferTrainerFactory._registry)
        engine = llm.workers[0].weight_transfer_engine
        self.assertIsInstance(engine, WeightTransferEngine)
        self.assertIs(type(engine), adapter.RefitWeightTransferEngine)
        self.assertFalse(engine.supports_draft_weight_update)
        self.assertTrue(issubclass(adapter.RefitTrainerWeightTransferEngine, TrainerWeightTransferEngine))

    def test_rounds_after_optimizer_steps_reach_every_engine_byte(self):
        import refit.integrations.vllm as adapter
        models, llm = self.engines()
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)
        client = SyncClient(llm)
        eng = self.trainer_engine(client, adapter.LiveModuleSource(trainer.inner))
        opt = torch.optim.AdamW(trainer.parameters(), lr=3e-2)
        for step in (1, 2, 3):
            if step > 1:
                llm.generate(PROMPT, 4)  # fills the prefix cache with the old weights' answer
            train_step(trainer, opt, step)
            for m in models:
                poison_(m.parameters())
            resets = llm.prefix_cache_resets
            client.calls.clear()
            eng.send_weights()
            self.assertEqual(client.calls, ["pause:keep", "start", "update", "finish", "reset_prefix_cache", "resume"])
            self.assertEqual(eng.last_version, step)
            self.assertEqual(int(self.ctl.group("policy")["version"]), step)
            for w, m in zip(llm.workers, models):
                self.assertEqual(w.weight_transfer_engine.worker.version, step)
                self.assertEqual(w.weight_transfer_engine.post_processed, HF_CONFIG["num_hidden_layers"])
                self.assert_engine_holds(trainer, m)
            self.assertEqual(llm.prefix_cache_resets, resets + 1)
            tokens = llm.generate(PROMPT, 4)
            self.assertEqual(tokens, trainer.greedy(PROMPT, 4))
            self.assertEqual(tokens, models[1].greedy(PROMPT, 4))

    def test_draft_or_mtp_model_is_refused(self):
        m = EngineModel(seed=3)
        refit.share_module_(m)
        w = Worker(vllm_config(0, 1, speculative=SpeculativeConfig(method="mtp")), m, torch.device("cpu"))
        from refit.integrations.vllm import UnsupportedModel
        with self.assertRaises(UnsupportedModel) as e:
            w.init_weight_transfer_engine({"daemon": self.cluster.daemons[1].worker_address, "node": 1})
        self.assertIn("mtp", str(e.exception))
        self.assertIn("draft/MTP", str(e.exception))
        self.assertEqual(self.ctl.workers("policy"), [])  # nothing was registered
        with self.assertRaises(UnsupportedModel):
            w.weight_transfer_engine.set_weight_update_target(EngineModel(seed=4), None)

    def test_round_while_engines_serve_is_refused_then_a_real_update_commits(self):
        import refit.integrations.vllm as adapter
        models, llm = self.engines()
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)
        client = SyncClient(llm)
        eng = self.trainer_engine(client, adapter.LiveModuleSource(trainer.inner))
        self.ctl.wait_ready("policy", timeout=20)
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("policy", 1, timeout=30)  # nobody called start_weight_update
        self.assertIn("not inside a weight update", e.exception.reason)
        self.assertIn("vllm-dp", e.exception.culprit or "")
        for m in models:
            poison_(m.parameters())
        eng.send_weights()
        for m in models:
            self.assert_engine_holds(trainer, m)

    def test_round_a_worker_misses_aborts_and_vllm_stops_serving(self):
        import refit.integrations.vllm as adapter
        models, llm = self.engines()
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)
        client = OneWorkerClient(llm)
        eng = self.trainer_engine(client, adapter.LiveModuleSource(trainer.inner))
        with self.assertRaises(adapter.IntegrationError) as e:
            eng.send_weights()
        cause = e.exception.__cause__
        self.assertIsInstance(cause, adapter.RoundAborted, e.exception)
        self.assertIn("vllm-dp1-tp0", cause.reason)
        self.assertEqual(llm.workers[0].weight_transfer_engine.worker.version, 0)
        with self.assertRaises(RuntimeError) as h:
            llm.workers[0].check_health()
        self.assertIn("mixed generations", str(h.exception))
        self.assertTrue(llm.paused)  # left paused: the weights hold no complete version
        # Reloaded, the next round through a working client commits everywhere.
        llm.workers[0].reload_weights()
        eng.client = SyncClient(llm)
        train_step(trainer, torch.optim.SGD(trainer.parameters(), lr=0.1), 7)
        for m in models:
            poison_(m.parameters())
        eng.send_weights()
        for m in models:
            self.assert_engine_holds(trainer, m)
        self.assertEqual(llm.generate(PROMPT, 3), trainer.greedy(PROMPT, 3))

    def test_a_client_without_every_method_is_refused_before_anything_registers(self):
        import refit.integrations.vllm as adapter
        models, llm = self.engines(dp_size=1)
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)

        class NoFinish(SyncClient):
            finish_weight_update = None  # not callable: as if the class lacked it
            reset_prefix_cache = None

        with self.assertRaises(adapter.IntegrationError) as e:
            self.trainer_engine(NoFinish(llm), adapter.LiveModuleSource(trainer.inner))
        self.assertIn("lacks finish_weight_update, reset_prefix_cache", str(e.exception))
        self.assertIn("WeightSyncClient", str(e.exception))
        self.assertEqual(self.ctl.workers("policy"), [])  # neither the trainer nor an engine registered

        class NoPause(SyncClient):
            pause_generation = resume_generation = None

        self.assertEqual(adapter.missing_client_methods(NoPause(llm), pause=True),
                         ["pause_generation", "resume_generation"])
        eng = self.trainer_engine(NoPause(llm), adapter.LiveModuleSource(trainer.inner), pause=False)
        poison_(models[0].parameters())
        eng.send_weights()  # pause=False: a client without pause/resume is enough
        self.assert_engine_holds(trainer, models[0])

    def test_a_round_the_trainer_refuses_is_blamed_on_the_trainer(self):
        import refit.integrations.vllm as adapter
        models, llm = self.engines(dp_size=1)
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)
        eng = self.trainer_engine(SyncClient(llm), adapter.LiveModuleSource(trainer.inner))
        self.assertEqual(sorted(w["worker_id"] for w in self.ctl.workers("policy") if w["role"] == "TRAINER"),
                         ["policy/trainer-rank0"])
        param = trainer.inner.get_parameter("model.norm.weight")
        registered = param.data
        param.data = registered.clone()  # private memory: the trainer's worker refuses PREPARE
        with self.assertRaises(adapter.IntegrationError) as e:
            eng.send_weights()
        self.assertIn('failed on the trainer\'s side (worker "policy/trainer-rank0")', str(e.exception))
        self.assertNotIn("on the engines", str(e.exception))
        param.data = registered
        eng.client = SyncClient(llm)
        llm.workers[0].reload_weights()
        poison_(models[0].parameters())
        eng.send_weights()
        self.assert_engine_holds(trainer, models[0])

    def test_a_trainer_sharded_by_hand_registers_every_rank_from_its_layout(self):
        import threading
        import refit.integrations.vllm as adapter
        from refit.layouts import dtensor
        from tiny_models import _tree
        models, llm = self.engines()
        full = TrainerModel(seed=0)
        specs = {n: (tuple(p.shape), p.dtype, ["S(0)"]) for n, p in full.inner.named_parameters()}
        layout = dtensor.trainer_layout(specs, mesh=(2,), worker_name="trainer-rank{rank}")
        ranks = []
        for r in range(2):
            mine = _tree({n: torch.chunk(p.detach(), 2)[r].clone() for n, p in full.inner.named_parameters()})
            refit.share_module_(mine)
            ranks.append(mine)
        # Rank 1 first: it calls nothing on the client, and only rank 0 initialises the engines.
        follower = self.trainer_engine(None, adapter.LiveModuleSource(ranks[1], layout=layout), rank=1)
        sender = self.trainer_engine(SyncClient(llm), adapter.LiveModuleSource(ranks[0], layout=layout), rank=0)
        self.assertEqual(sorted(w["worker_id"] for w in self.ctl.workers("policy") if w["role"] == "TRAINER"),
                         ["policy/trainer-rank0", "policy/trainer-rank1"])
        for m in models:
            poison_(m.parameters())
        failures = []

        def follow():
            try:
                follower.send_weights()  # returns once the round ended on this rank
            except Exception as e:  # noqa: BLE001 (reported below)
                failures.append(e)

        t = threading.Thread(target=follow)
        t.start()
        sender.send_weights()
        t.join(30)
        self.assertFalse(t.is_alive())
        self.assertEqual(failures, [])
        for m in models:
            self.assert_engine_holds(full, m)


if __name__ == "__main__":
    unittest.main()
