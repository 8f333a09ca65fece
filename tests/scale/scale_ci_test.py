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
All of it again at N = 17 (9 training nodes, 8 serving) with the coordinator's calls of a phase
started from 2 threads at once (--fanout-threads=2).

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

ROUNDS = 3
PREPARE_TIMEOUT = 30.0


class ScaleCiTest(unittest.TestCase):
    NODES = 8
    ARGS = []

    @classmethod
    def setUpClass(cls):
        cls.victim = cls.NODES - 1
        out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or tempfile.mkdtemp(prefix="scale-ci-")
        cls.out_path = os.path.join(out_dir, f"scale_ci_{cls.NODES}.json")
        argv = ["--nodes", str(cls.NODES), "--model", "small", "--gpus-per-node", "2", "--rounds", str(ROUNDS),
                "--faults", "kill", "--victim-node", str(cls.victim), "--prepare-delay", "3",
                "--prepare-timeout", str(PREPARE_TIMEOUT), "--transfer-timeout", "60", "--commit-timeout", "60",
                "--peer-timeout", "10", "--register-wait", "240", "--ready-timeout", "240",
                "--round-timeout", "240", "--ctl-timeout", "120", "--status-timeout", "120",
                "--idle-cpu-window", "0.5", "--verbose-rounds", "--out", cls.out_path]
        argv += cls.ARGS
        if os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR"):
            argv.append("--keep")  # daemon logs and worker reports beside the JSON
        data = scale_bench.main(argv)
        cls.r = data["results"][0]
        print(json.dumps(cls.r, indent=1)[:6000])

    def test_no_harness_errors(self):
        self.assertEqual(self.r["errors"], [], f"the harness failed; logs in {self.r.get('run_dir')}")

    def test_group_ready_and_plan_installed_everywhere(self):
        self.assertIsNotNone(self.r.get("ready_after_last_registration_s"), "the group never became ready")
        self.assertEqual(self.r["workers"], self.NODES * 2)
        self.assertEqual(self.r["install"]["nodes_installed"], self.NODES,
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
        self.assertEqual(int(culprit.get("node") or 0), self.victim, k["round"])
        self.assertTrue(k["reason_names_victim"], k["round"]["reason"])
        # A killed daemon's connections close at once: the round ends long before PREPARE's
        # deadline (the delayed worker alone would hold it 3 s).
        self.assertLess(k["abort_s"], PREPARE_TIMEOUT / 2, k)

    def test_node_back_ready_and_commits(self):
        j = self.r.get("rejoin")
        self.assertIsNotNone(j, "the node was not brought back")
        self.assertEqual(j["round"]["state"], "COMMITTED", j["round"])
        self.assertTrue(j["round"].get("verified"), j["round"])
        self.assertEqual(j["nodes_installed"], self.NODES, "the new membership's plan was not installed everywhere")

    def test_round_cpu_is_reported_for_every_kind_of_process(self):
        c = self.r["round_cpu"]
        self.assertEqual(c["rounds"], ROUNDS)
        for key in ("coordinator_ms", "daemon_median_ms", "worker_median_ms"):
            self.assertIsNotNone(c[key], c)
        # The coordinator does work in every round (its phase calls): some CPU must show.
        self.assertGreater(c["coordinator_ms"], 0, c)


# The same at 17 daemons (9 training, 8 serving) with the coordinator's calls started from 2
# threads at once (a phase of 16 peers or more is split): concurrent call starts through the real
# gRPC client, a round killed in PREPARE, a node back.
class SpreadCallsCiTest(ScaleCiTest):
    NODES = 17
    ARGS = ["--train-nodes", "9", "--daemon-flag=--fanout-threads=2", "--keep"]

    def test_calls_started_from_two_threads(self):
        # The coordinator says so for each phase it split (its log, kept with --keep).
        with open(os.path.join(self.r["run_dir"], "daemon0.log"), errors="replace") as f:
            split = f.read().count("calls to 16 peers started from 2 threads")
        # PREPARE, TRANSFER and COMMIT of the first round and of the K after it at least.
        self.assertGreaterEqual(split, 3 * (ROUNDS + 1))


class HarnessPartsTest(unittest.TestCase):
    def test_bin_dir_without_the_binary_is_refused_not_replaced(self):
        # --bin must never fall back to the workspace's bazel-bin (other binaries than asked for).
        empty = tempfile.mkdtemp(prefix="scale-empty-bin-")
        with self.assertRaisesRegex(scale_bench.HarnessError, "--bin .*no refitd"):
            scale_bench.find_binary("refitd", empty)

    def test_bin_dir_may_be_a_bazel_output_tree(self):
        tree = tempfile.mkdtemp(prefix="scale-tree-bin-")
        os.makedirs(os.path.join(tree, "daemon"))
        path = os.path.join(tree, "daemon", "refitd")
        open(path, "w").close()
        self.assertEqual(scale_bench.find_binary("refitd", tree), path)

    def test_round_cpu_takes_the_cpu_at_rest_out(self):
        # Rest: the coordinator burns 10 ms/s, a daemon 0; then 4 rounds over 2 s, in which the
        # coordinator used 0.1 s (0.02 s of it at rest) and the daemon 0.04 s.
        rest0 = {"t": 0.0, "cpu": {("d", 0): 1.0, ("d", 1): 1.0, ("w", "a"): 0.5}, "jiffies": (0, 0)}
        rest1 = {"t": 1.0, "cpu": {("d", 0): 1.01, ("d", 1): 1.0, ("w", "a"): 0.5}, "jiffies": (0, 0)}
        cpu0 = {"t": 10.0, "cpu": {("d", 0): 2.0, ("d", 1): 1.0, ("w", "a"): 0.5}, "jiffies": (100, 200)}
        cpu1 = {"t": 12.0, "cpu": {("d", 0): 2.1, ("d", 1): 1.04, ("w", "a"): 0.504}, "jiffies": (250, 400)}
        c = scale_bench.round_cpu(rest0, rest1, cpu0, cpu1, rounds=4, n=2)
        self.assertAlmostEqual(c["coordinator_ms"], 25.0)
        self.assertAlmostEqual(c["coordinator_net_ms"], 20.0)
        self.assertAlmostEqual(c["coordinator_net_per_node_ms"], 10.0)
        self.assertAlmostEqual(c["daemon_net_median_ms"], 10.0)
        self.assertAlmostEqual(c["worker_net_median_ms"], 1.0)
        self.assertAlmostEqual(c["machine_busy"], 0.75)


if __name__ == "__main__":
    unittest.main(verbosity=2)
