"""The vLLM adapter's trainer side against the vLLM stand-in, with real refitd daemons: a trainer
sharded over two ranks, each calling send_weights(), never has a rank's old slice reported
committed (a lagging rank's new values reach the engine; a rank that never gets there fails
the round, named); a send_weights() after a failed one works; a wrong control address is named
in trainer_init; a not-ready reason that waiting cannot fix ends the wait early; an engine
config without the fields refit needs is refused by name."""
import threading
import time
import unittest

import itest  # noqa: F401  (sys.path: stand-ins, refit)
import harness
import refit
import torch
from tiny_models import HF_CONFIG, EngineModel, TrainerModel, _tree, poison_, train_step

import refit.integrations.vllm as adapter
from refit.layouts import dtensor
from vllm.config import ModelConfig, VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.entrypoints.llm import LLM
from vllm.v1.worker.gpu_worker import Worker

PREPARE_TIMEOUT_S = 4


class Client:
    """refit.integrations.vllm.WeightSyncClient over the stand-in LLM; `on_start` runs once
    start_weight_update returned (the engines are PREPAREd, the round is under way)."""

    def __init__(self, llm: LLM, on_start=None, fail_start: bool = False) -> None:
        self.llm, self.on_start, self.fail_start = llm, on_start, fail_start

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        if self.fail_start:
            raise RuntimeError("the engine client lost its engines")
        self.llm.start_weight_update()
        if self.on_start is not None:
            self.on_start()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()

    def pause_generation(self, mode: str) -> None:
        self.llm.pause_generation(mode=mode)

    def resume_generation(self) -> None:
        self.llm.resume_generation()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class VllmTrainer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        itest.install_entry_point()

    def setUp(self):
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--prepare-timeout", str(PREPARE_TIMEOUT_S)])
        self.ctl = refit.Controller(self.cluster.control)
        self.closers = []

    def tearDown(self):
        for c in reversed(self.closers):
            c()
        self.ctl.close()
        self.cluster.close()

    def engine(self, hf_config=None):
        model = EngineModel(seed=10)
        refit.share_module_(model)
        cfg = VllmConfig(model_config=ModelConfig(hf_config=dict(HF_CONFIG) if hf_config is None else hf_config,
                                                  dtype=torch.float32),
                         weight_transfer_config=WeightTransferConfig(backend="refit"))
        llm = LLM([Worker(cfg, model, torch.device("cpu"))])
        self.closers.append(llm.shutdown)
        return model, llm

    def trainer(self, client, source, rank=0, control=None, **fields):
        info = adapter.RefitTrainerInitInfo(
            control=control or self.cluster.control, daemon=self.cluster.daemons[0].worker_address, node=0,
            engine={"daemon": self.cluster.daemons[1].worker_address, "node": 1, "timeout_s": 30,
                    "prepare_wait_s": 1.5},
            rank=rank, **{"timeout_s": 30, **fields})
        eng = WeightTransferTrainerFactory.trainer_init("refit", WeightTransferConfig(backend="refit"), info,
                                                        client=client, source=source)
        self.closers.append(eng.shutdown)
        return eng

    def sharded(self, full: TrainerModel):
        """Two ranks' row slices of `full` in shared memory, and the layout of both."""
        specs = {n: (tuple(p.shape), p.dtype, ["S(0)"]) for n, p in full.inner.named_parameters()}
        layout = dtensor.trainer_layout(specs, mesh=(2,), worker_name="trainer-rank{rank}")
        ranks = []
        for r in range(2):
            mine = _tree({n: torch.chunk(p.detach(), 2)[r].clone() for n, p in full.inner.named_parameters()})
            refit.share_module_(mine)
            ranks.append(mine)
        return ranks, layout

    @staticmethod
    def copy_slices(full: TrainerModel, rank_module, rank: int) -> None:
        shards = dict(rank_module.named_parameters())
        with torch.no_grad():
            for n, p in full.inner.named_parameters():
                shards[n].copy_(torch.chunk(p.detach(), 2)[rank])

    def in_thread(self, fn):
        """Runs fn on a thread; returns (thread, the exceptions it raised)."""
        failures = []

        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 (reported by the test)
                failures.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, failures

    def test_a_lagging_rank_s_new_slice_reaches_the_engine(self):
        model, llm = self.engine()
        full = TrainerModel(seed=0)
        ranks, layout = self.sharded(full)
        opt = torch.optim.AdamW(full.parameters(), lr=3e-2)
        started = threading.Event()
        sender = self.trainer(Client(llm, on_start=started.set), adapter.LiveModuleSource(ranks[0], layout=layout))
        follower = self.trainer(None, adapter.LiveModuleSource(ranks[1], layout=layout), rank=1)
        for step in (1, 2):
            train_step(full, opt, step)
            poison_(model.parameters())
            started.clear()
            self.copy_slices(full, ranks[0], 0)
            t, failures = self.in_thread(sender.send_weights)
            # Rank 1 finishes its step only once rank 0's round is under way (the engines
            # PREPAREd): a round that read rank 1's memory without it would hold the old slice.
            self.assertTrue(started.wait(20), "rank 0's round did not reach the engines")
            self.copy_slices(full, ranks[1], 1)
            follower.send_weights()
            t.join(30)
            self.assertFalse(t.is_alive())
            self.assertEqual(failures, [])
            self.assertEqual(itest.mismatches(full, model), [])
            self.assertEqual(sender.last_version, step)
            self.assertEqual(follower.last_version, step)  # the version of the round it took part in

    def test_a_rank_that_never_sends_fails_the_round_naming_it(self):
        model, llm = self.engine()
        full = TrainerModel(seed=0)
        ranks, layout = self.sharded(full)
        sender = self.trainer(Client(llm), adapter.LiveModuleSource(ranks[0], layout=layout))
        self.trainer(None, adapter.LiveModuleSource(ranks[1], layout=layout), rank=1)  # never sends
        t0 = time.monotonic()
        with self.assertRaises(adapter.IntegrationError) as e:
            sender.send_weights()
        self.assertIn('worker "policy/trainer-rank1"', str(e.exception))
        self.assertIn("PREPARE", str(e.exception))
        self.assertLess(time.monotonic() - t0, 25)  # the daemons' PREPARE deadline, not the 30 s wait
        self.assertEqual(int(self.ctl.group("policy").get("version", 0)), 0)  # nothing committed

    def test_send_weights_after_a_failed_one_works(self):
        model, llm = self.engine()
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)
        client = Client(llm, fail_start=True)
        eng = self.trainer(client, adapter.LiveModuleSource(trainer.inner))
        with self.assertRaises(adapter.IntegrationError) as e:
            eng.send_weights()
        self.assertIn("the engine client lost its engines", str(e.exception))
        # Its round ended before send_weights() raised: the next one starts a round at once.
        self.assertIn(self.ctl.rounds("policy")[-1].state, ("COMMITTED", "ABORTED"))
        client.fail_start = False
        poison_(model.parameters())
        eng.send_weights()
        self.assertEqual(itest.mismatches(trainer, model), [])

    def test_a_wrong_control_address_is_named_in_trainer_init(self):
        model, llm = self.engine()
        trainer = TrainerModel(seed=0)
        refit.share_module_(trainer)
        wrong = f"127.0.0.1:{harness.free_port()}" if hasattr(harness, "free_port") else "127.0.0.1:1"
        t0 = time.monotonic()
        with self.assertRaises(adapter.IntegrationError) as e:
            self.trainer(Client(llm), adapter.LiveModuleSource(trainer.inner), control=wrong)
        self.assertIn(f"no refitd answers at the control address {wrong!r}", str(e.exception))
        self.assertLess(time.monotonic() - t0, adapter.CONTROL_CHECK_S + 3)
        self.assertEqual(self.ctl.workers("policy"), [])  # nothing registered

    def test_conflicting_trainer_ranks_end_the_wait_early(self):
        model, llm = self.engine()
        full = TrainerModel(seed=0)
        ranks, layout = self.sharded(full)
        sender = self.trainer(Client(llm), adapter.LiveModuleSource(ranks[0], layout=layout), timeout_s=60)
        # Rank 1 declares another world size: the group cannot become ready by waiting.
        stray = refit.Worker(self.cluster.daemons[0].worker_address, "policy", "trainer", layout,
                             dict(ranks[1].named_parameters()), name="trainer-rank1", rank=1, world_size=3)
        self.closers.append(stray.close)
        t0 = time.monotonic()
        with self.assertRaises(adapter.IntegrationError) as e:
            sender.send_weights()
        self.assertIn("waiting will not make it so", str(e.exception))
        self.assertIn("disagree on the trainer world size", str(e.exception))
        self.assertLess(time.monotonic() - t0, 30)  # well before timeout_s (60 s)

    def test_an_engine_config_without_heads_is_refused_by_name(self):
        with self.assertRaises(adapter.UnsupportedModel) as e:
            _, llm = self.engine(hf_config={})
            llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={
                "daemon": self.cluster.daemons[1].worker_address, "node": 1}))
        self.assertIn("hf_config lacks num_attention_heads", str(e.exception))


if __name__ == "__main__":
    unittest.main()
