"""The example docs/INTEGRATIONS.md quotes (examples/vllm_quickstart.py) runs as documented:
against the vLLM stand-in, with one real refitd, its rounds commit and the engine holds the
trainer's weights."""
import os
import subprocess
import sys
import unittest

import itest
import harness


class Quickstart(unittest.TestCase):
    def test_vllm_quickstart_runs(self):
        script = os.path.join(itest.HERE, "examples", "vllm_quickstart.py")
        with harness.Cluster(nodes=1) as cluster:
            # What the doc's PYTHONPATH gives: the refit package and the stand-ins (no vLLM).
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(harness.HERE), itest.STANDINS]
                                                              + sys.path))
            run = subprocess.run([sys.executable, script, "--control", cluster.control,
                                  "--daemon", cluster.daemons[0].worker_address, "--rounds", "3"],
                                 env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertIn("round committed: version 3", run.stdout)
        self.assertIn("engine holds the trainer's weights", run.stdout)


if __name__ == "__main__":
    unittest.main()
