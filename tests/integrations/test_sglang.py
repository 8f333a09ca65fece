"""refit.integrations.sglang against the SGLang stand-in's HTTP routes, with real refitd daemons
(CPU backend): updates in SGLang's session order after AdamW steps (engine bytes poisoned before,
checked after; post_load_weights run by end_weight_update; refit's version is SGLang's weight
version; greedy tokens through /generate after the prefix cache was flushed by the pause).
Failures: a round the trainer refuses leaves SGLang paused at its old weight version with the
session closed, and a later update recovers; a round started while SGLang serves is refused."""
import json
import threading
import urllib.request
import unittest

import itest
import harness
import refit
import torch
from refit.layouts import dtensor
from tiny_models import HF_CONFIG, EngineModel, TrainerModel, poison_, train_step

from refit.integrations.sglang import EngineWorker, RoundAborted, SGLangSession
from sglang.srt.entrypoints.http_server import launch_server
from sglang.srt.managers.scheduler import Scheduler

PROMPT = [3, 14, 15, 9, 2]


class SGLangAdapter(unittest.TestCase):
    def setUp(self):
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--prepare-timeout", "5"])
        self.ctl = refit.Controller(self.cluster.control)
        self.model = EngineModel(seed=8)
        refit.share_module_(self.model)
        self.scheduler = Scheduler(self.model)
        self.server, self.url = launch_server(self.scheduler)
        self.engine = EngineWorker(self.model, dict(HF_CONFIG), daemon=self.cluster.daemons[1].worker_address, node=1,
                                   in_update=lambda: self.scheduler.weight_update_in_progress, prepare_wait_s=1.5)
        self.trainer = TrainerModel(seed=0)
        refit.share_module_(self.trainer)
        self.refuse = threading.Event()
        params = self.trainer.hf()
        self.trainer_worker = refit.Worker(self.cluster.daemons[0].worker_address, "policy", "trainer",
                                           dtensor.trainer_worker(params, rank=0, node=0), params,
                                           on_prepare=self._trainer_prepare)
        self.session = SGLangSession(self.url, self.cluster.control, timeout_s=30)

    def _trainer_prepare(self, version):
        if self.refuse.is_set():
            raise RuntimeError("optimizer step in flight")

    def tearDown(self):
        self.session.close()
        self.trainer_worker.close()
        self.engine.close()
        self.server.shutdown()
        self.ctl.close()
        self.cluster.close()

    def generate(self, n=4):
        req = urllib.request.Request(self.url + "/generate", method="POST",
                                     data=json.dumps({"input_ids": PROMPT, "max_new_tokens": n}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["output_ids"]

    def assert_engine_holds_trainer(self):
        self.assertEqual(itest.mismatches(self.trainer, self.model), [])
        self.assertTrue(itest.still_poisoned(self.model))
        for attn in self.model.attentions():
            self.assertTrue(torch.equal(attn.o_t, attn._o_proj[0].weight.detach().t()))

    def test_updates_after_optimizer_steps_in_the_session_order(self):
        opt = torch.optim.AdamW(self.trainer.parameters(), lr=3e-2)
        for step in (1, 2, 3):
            if step > 1:
                self.generate()  # fills the prefix cache
            train_step(self.trainer, opt, step)
            poison_(self.model.parameters())
            post_loads = self.scheduler.post_loads
            self.assertEqual(self.session.update(), step)
            self.assertEqual(self.session.weight_version(), str(step))
            self.assertEqual(self.engine.version, step)
            self.assertEqual(self.scheduler.post_loads, post_loads + 1)
            self.assertFalse(self.scheduler.paused)
            self.assert_engine_holds_trainer()
            self.assertEqual(self.generate(), self.trainer.greedy(PROMPT, 4))

    def test_refused_round_leaves_sglang_paused_at_its_version(self):
        self.assertEqual(self.session.update(), 1)
        self.refuse.set()
        with self.assertRaises(RoundAborted) as e:
            self.session.update()
        self.assertIn("optimizer step in flight", e.exception.reason)
        self.assertTrue(self.scheduler.paused)
        self.assertFalse(self.scheduler.weight_update_in_progress)
        self.assertEqual(self.session.weight_version(), "1")
        self.refuse.clear()
        train_step(self.trainer, torch.optim.SGD(self.trainer.parameters(), lr=0.1), 9)
        poison_(self.model.parameters())
        self.assertEqual(self.session.update(), 2)
        self.assert_engine_holds_trainer()
        self.assertEqual(self.generate(), self.trainer.greedy(PROMPT, 4))

    def test_round_while_sglang_serves_is_refused(self):
        self.ctl.wait_ready("policy", timeout=20)
        with self.assertRaises(refit.RefitError) as e:
            self.ctl.refit("policy", 1, timeout=30)
        self.assertIn("not inside a weight-update session", e.exception.reason)
        self.assertEqual(self.engine.version, 0)


if __name__ == "__main__":
    unittest.main()
