"""A copy of the package without its generated protobuf modules (a checkout's client/python on
PYTHONPATH, never installed or built) says what to do when a module needs them, instead of a
bare "No module named 'refit._proto.layout_pb2'"."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import refit


class MissingProtoModules(unittest.TestCase):
    def test_the_import_error_says_to_install_the_package(self):
        with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
            package = os.path.join(tmp, "src", "refit")
            shutil.copytree(os.path.dirname(refit.__file__), package,
                            ignore=shutil.ignore_patterns("*_pb2.py", "__pycache__"))
            env = {k: v for k, v in os.environ.items() if k not in ("TEST_SRCDIR", "RUNFILES_DIR", "PYTHONPATH")}
            env["PYTHONPATH"] = os.path.join(tmp, "src")
            run = subprocess.run([sys.executable, "-c", "import refit.layout_io"], env=env, cwd=tmp,
                                 capture_output=True, text=True, timeout=60)
        self.assertNotEqual(run.returncode, 0, run.stdout)
        self.assertIn("ImportError: refit's generated protobuf module layout_pb2 is missing", run.stderr)
        self.assertIn('install the package (docs/PYTHON.md, "Install")', run.stderr)


if __name__ == "__main__":
    unittest.main()
