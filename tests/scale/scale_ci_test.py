"""CI check of the scale harness (tests/scale/scale_bench.py) at N = 8 with a small model: 8 refitd
daemons on loopback (node 0 coordinates; nodes 0-3 train, 4-7 serve), 2 sim-workers each
(Qwen3-30B-A3B's structure on 2 layers, widths / 32: Megatron TP1 PP2 EP4 DP4 -> vLLM TP2 DP4 with
expert parallelism, one replica over all engine ranks).

Asserts:
- the group becomes ready once every worker registered (every replica complete, every node alive);
- the first round (which installs the plan on every node) and the K rounds after it commit, and
  every inference sim-worker reports "commit V ok" for each: it checked every byte it received
  (elements and padding), later rounds byte for byte against the verified first (--same-data);
- SIGKILL of an engine node's daemon (node 7) inside PREPARE (one of its workers holds PREPARE
  open for 3 s) aborts the round well before PREPARE's deadline, with RoundStats.culprit naming
  that node (kind NODE, node 7) and the reason saying "node 7";
- the node restarted on its address with fresh workers: the group is ready again and the next
  round commits, byte-exact.

Deadlines are generous (minutes; the machine has 2 cores and other builds) and every wait is a
poll. Run: bazel test //tests/scale:scale_ci_test, or with the binaries built:
python3 tests/scale/scale_ci_test.py.
"""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_bench  # noqa: E402

NODES = 8
ROUNDS = 3
VICTIM = NODES - 1
PREPARE_TIMEOUT = 30.0


class ScaleCiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or tempfile.mkdtemp(prefix="scale-ci-")
        cls.out_path = os.path.join(out_dir, "scale_ci.json")
        argv = ["--nodes", str(NODES), "--model", "small", "--gpus-per-node", "2", "--rounds", str(ROUNDS),
                "--faults", "kill", "--victim-node", str(VICTIM), "--prepare-delay", "3",
                "--prepare-timeout", str(PREPARE_TIMEOUT), "--transfer-timeout", "60", "--commit-timeout", "60",
                "--peer-timeout", "10", "--register-wait", "240", "--ready-timeout", "240",
                "--round-timeout", "240", "--ctl-timeout", "120", "--status-timeout", "120",
                "--verbose-rounds", "--out", cls.out_path]
        if os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR"):
            argv.append("--keep")  # daemon logs and worker reports beside the JSON
        data = scale_bench.main(argv)
        cls.r = data["results"][0]
        print(json.dumps(cls.r, indent=1)[:6000])

    def test_no_harness_errors(self):
        self.assertEqual(self.r["errors"], [], f"the harness failed; logs in {self.r.get('run_dir')}")

    def test_group_ready_and_plan_installed_everywhere(self):
        self.assertIsNotNone(self.r.get("ready_after_last_registration_s"), "the group never became ready")
        self.assertEqual(self.r["workers"], NODES * 2)
        self.assertEqual(self.r["install"]["nodes_installed"], NODES,
                         f"nodes that logged the plan's install: {self.r['install']['per_node_s']}")

    def test_rounds_commit_and_every_byte_checks(self):
        first = self.r["first_round"]
        self.assertEqual(first["state"], "COMMITTED", first["reason"])
        self.assertTrue(first.get("verified"), "an inference sim-worker did not report the first commit ok")
        self.assertGreater(first["bytes"], 0)
        rounds = self.r["rounds"]
        self.assertEqual(rounds["count"], ROUNDS)
        self.assertEqual(rounds["committed"], ROUNDS, rounds["each"])
        self.assertEqual(rounds["verified"], ROUNDS, rounds["each"])

    def test_sigkilled_daemon_aborts_the_round_naming_its_node(self):
        k = self.r.get("abort_sigkill")
        self.assertIsNotNone(k, "the SIGKILL case did not run")
        self.assertNotIn("error", k, k.get("error"))
        self.assertEqual(k["state"], "ABORTED", k["round"])
        culprit = k["round"]["culprit"] or {}
        self.assertEqual(culprit.get("kind"), "NODE", k["round"])
        self.assertEqual(int(culprit.get("node") or 0), VICTIM, k["round"])
        self.assertTrue(k["reason_names_victim"], k["round"]["reason"])
        # A killed daemon's connections close at once: the round ends long before PREPARE's
        # deadline (the delayed worker alone would hold it 3 s).
        self.assertLess(k["abort_s"], PREPARE_TIMEOUT / 2, k)

    def test_node_back_ready_and_commits(self):
        j = self.r.get("rejoin")
        self.assertIsNotNone(j, "the node was not brought back")
        self.assertEqual(j["round"]["state"], "COMMITTED", j["round"])
        self.assertTrue(j["round"].get("verified"), j["round"])
        self.assertEqual(j["nodes_installed"], NODES, "the new membership's plan was not installed everywhere")


if __name__ == "__main__":
    unittest.main(verbosity=2)
