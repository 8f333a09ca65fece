"""refit.integrations.nemo_rl against the NeMo-RL stand-in, with real refitd daemons (CPU
backend): the engine built from refit_transport "module:Class" with its refit_cfg, refits in the
synchronizer's order after AdamW steps (engine bytes poisoned before, checked after, greedy
tokens compared); with the engine gone, the policy's refit fails naming the group that is not
ready, and the generation side's wait fails at its deadline."""
import time
import unittest

import itest
import harness
import refit
import torch
from tiny_models import TrainerModel, poison_, train_step

from nemo_rl.utils.checkpoint_engines.base import Synchronizer, create_checkpoint_engine

PROMPT = [3, 14, 15, 9, 2]
TRANSPORT = "refit.integrations.nemo_rl:RefitCheckpointEngine"


class NemoRLAdapter(unittest.TestCase):
    def setUp(self):
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--prepare-timeout", "5"])
        self.ctl = refit.Controller(self.cluster.control)
        self.engine_model, self.vllm_worker = itest.vllm_idle_engine(self.cluster.daemons[1].worker_address, 1, 6)
        self.trainer = TrainerModel(seed=0)
        self.loaded = []
        self.sync = self.synchronizer(timeout_s=20)

    def synchronizer(self, timeout_s):
        refit_cfg = {TRANSPORT: {"control": self.cluster.control, "daemon": self.cluster.daemons[0].worker_address,
                                 "node": 0, "timeout_s": timeout_s, "update_weights_bucket_memory_ratio": 0.05}}
        stream = lambda: ((n, p.detach()) for n, p in self.trainer.hf().items())
        # Two policy ranks: rank 1 only drains its stream.
        return Synchronizer(TRANSPORT, refit_cfg, [stream, stream], [self.loaded.extend])

    def tearDown(self):
        self.sync.shutdown()
        self.vllm_worker.shutdown()
        self.ctl.close()
        self.cluster.close()

    def test_refit_transport_class_path_builds_the_engine(self):
        from refit.integrations.nemo_rl import RefitCheckpointEngine
        e = create_checkpoint_engine(TRANSPORT, bucket_size_bytes=1 << 20, engine_kwargs={"control": "x:1"})
        self.assertIsInstance(e, RefitCheckpointEngine)
        with self.assertRaises(refit.integrations.nemo_rl.IntegrationError) as err:
            create_checkpoint_engine(TRANSPORT, bucket_size_bytes=1, engine_kwargs={"contrl": "x:1"})
        self.assertIn("contrl", str(err.exception))

    def test_refits_after_optimizer_steps_write_every_engine_byte(self):
        opt = torch.optim.AdamW(self.trainer.parameters(), lr=3e-2)
        for step in (1, 2, 3):
            train_step(self.trainer, opt, step)
            poison_(self.engine_model.parameters())
            self.sync.sync_weights()
            self.assertEqual(int(self.ctl.group("policy")["version"]), step)
            self.assertEqual(itest.mismatches(self.trainer, self.engine_model), [])
            self.assertTrue(itest.still_poisoned(self.engine_model))
            self.assertEqual(self.loaded, [])
            self.assertEqual(self.vllm_worker.execute_model(PROMPT, 4), self.trainer.greedy(PROMPT, 4))

    def test_refit_without_the_engine_fails_naming_the_group(self):
        self.sync = self.synchronizer(timeout_s=3)
        self.sync.sync_weights()
        self.vllm_worker.shutdown()  # the engine unregisters: the group is no longer ready
        t = time.monotonic()
        with self.assertRaises(refit.errors.Error) as err:
            self.sync.sync_weights()
        self.assertLess(time.monotonic() - t, 10)
        self.assertIn("policy", str(err.exception))
        self.assertEqual(int(self.ctl.group("policy")["version"]), 1)


if __name__ == "__main__":
    unittest.main()
