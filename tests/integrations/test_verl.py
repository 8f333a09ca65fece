"""refit.integrations.verl against the verl stand-in, with real refitd daemons (CPU backend):
the backend module imported through checkpoint_engine.custom_backend_module and built by
CheckpointEngineRegistry.new on both sides, syncs in CheckpointEngineManager's order after AdamW
steps (engine bytes poisoned before, checked after, greedy tokens compared); a weight stream that
changes its tensors between syncs is refused by name and no round starts."""
import asyncio
import sys
import unittest

import itest
import harness
import refit
import torch
from tiny_models import HF_CONFIG, TrainerModel, poison_, train_step

from verl.checkpoint_engine.base import (CheckpointEngineConfig, CheckpointEngineManager, CheckpointEngineRegistry,
                                         CheckpointEngineWorker, TrainerWorker)

PROMPT = [3, 14, 15, 9, 2]


class ServerAdapter:
    """The rollout server adapter: loads whatever the checkpoint engine yields."""

    def __init__(self, model):
        self.model, self.loaded, self.aborts, self.resumes = model, [], 0, 0

    async def update_weights(self, weights):
        async for name, tensor in weights:
            self.loaded.append(name)

    async def abort_all_requests(self):
        self.aborts += 1

    async def resume_all_requests(self):
        self.resumes += 1


class VerlAdapter(unittest.TestCase):
    def setUp(self):
        self.cluster = harness.Cluster(nodes=2, daemon_flags=["--prepare-timeout", "5"])
        self.ctl = refit.Controller(self.cluster.control)
        self.engine_model, self.vllm_worker = itest.vllm_idle_engine(self.cluster.daemons[1].worker_address, 1, 5)
        self.trainer = TrainerModel(seed=0)
        self.config = CheckpointEngineConfig(
            backend="refit", custom_backend_module="refit.integrations.verl",
            engine_kwargs={"refit": {"control": self.cluster.control, "daemon": self.cluster.daemons[0].worker_address,
                                     "node": 0, "timeout_s": 20}})
        self.adapter = ServerAdapter(self.engine_model)
        self.trainer_worker = TrainerWorker(self.config, 0, lambda: ((n, p.detach()) for n, p in self.trainer.hf().items()))
        self.rollout_worker = CheckpointEngineWorker(self.config, self.adapter)
        self.manager = CheckpointEngineManager("refit", [self.trainer_worker], [self.rollout_worker], [self.adapter])

    def tearDown(self):
        self.trainer_worker.checkpoint_engine.close()
        self.rollout_worker.checkpoint_engine.close()
        self.vllm_worker.shutdown()
        self.ctl.close()
        self.cluster.close()

    def test_custom_backend_module_registers_refit(self):
        self.assertIn("refit.integrations.verl", sys.modules)
        from refit.integrations.verl import RefitCheckpointEngine
        self.assertIs(CheckpointEngineRegistry.get("refit"), RefitCheckpointEngine)
        self.assertTrue(self.trainer_worker.checkpoint_engine.is_master)
        self.assertFalse(self.rollout_worker.checkpoint_engine.is_master)

    def test_syncs_after_optimizer_steps_write_every_engine_byte(self):
        opt = torch.optim.AdamW(self.trainer.parameters(), lr=3e-2)
        for step in (1, 2, 3):
            train_step(self.trainer, opt, step)
            poison_(self.engine_model.parameters())
            asyncio.run(self.manager.update_weights())
            self.assertEqual(int(self.ctl.group("policy")["version"]), step)
            self.assertEqual(itest.mismatches(self.trainer, self.engine_model), [])
            self.assertTrue(itest.still_poisoned(self.engine_model))
            self.assertEqual(self.vllm_worker.weight_transfer_engine.worker.version, step)
            self.assertEqual(self.adapter.loaded, [])  # nothing went through load_weights
            self.assertEqual((self.adapter.aborts, self.adapter.resumes), (step, step))
            self.assertEqual(self.vllm_worker.execute_model(PROMPT, 4), self.trainer.greedy(PROMPT, 4))

    def test_a_stream_that_changes_its_tensors_is_refused_by_name(self):
        asyncio.run(self.manager.update_weights())
        self.trainer_worker.per_tensor_param = lambda: ((n, p.detach()) for n, p in self.trainer.hf().items()
                                                        if n != "model.norm.weight")
        poison_(self.engine_model.parameters())
        engine = self.trainer_worker.checkpoint_engine
        with self.assertRaises(refit.integrations.verl.IntegrationError) as e:
            asyncio.run(engine.send_weights(self.trainer_worker.per_tensor_param()))
        self.assertIn("model.norm.weight", str(e.exception))
        self.assertEqual(int(self.ctl.group("policy")["version"]), 1)  # no round ran
        self.assertEqual(len(itest.mismatches(self.trainer, self.engine_model)), len(self.trainer.hf()))


if __name__ == "__main__":
    unittest.main()
