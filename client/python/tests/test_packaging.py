"""`pip install ./client/python` offline, as docs/PYTHON.md says: the distribution's name, the
generated protobuf modules, the py.typed marker and vLLM's plugin entry point are in the wheel,
and the installed package imports and works from another folder."""
import configparser
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)                          # client/python
REPO = os.path.dirname(os.path.dirname(PACKAGE))         # holds proto/

DISTRIBUTION = "refitd-client"


def checkout_copy(tmp):
    """client/python and proto/ as a checkout holds them (symlinks from the runfiles resolved),
    without anything a build left behind."""
    ignore = shutil.ignore_patterns("__pycache__", "*_pb2.py", "build", "*.egg-info", ".mypy_cache")
    shutil.copytree(os.path.join(REPO, "proto"), os.path.join(tmp, "proto"), ignore=ignore)
    shutil.copytree(PACKAGE, os.path.join(tmp, "client", "python"), ignore=ignore)
    return os.path.join(tmp, "client", "python")


def pip(*args, cwd):
    env = dict(os.environ, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    out = subprocess.run([sys.executable, "-m", "pip", *args, "--no-index", "--no-build-isolation", "--no-deps"],
                         cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        raise AssertionError(f"pip {' '.join(args)} failed:\n{out.stdout[-3000:]}")


class Packaging(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="refit-pkg-", dir=os.environ.get("TEST_TMPDIR"))
        cls.source = checkout_copy(cls.tmp)
        pip("wheel", "-w", os.path.join(cls.tmp, "dist"), cls.source, cwd=cls.tmp)
        wheels = os.listdir(os.path.join(cls.tmp, "dist"))
        assert len(wheels) == 1, wheels
        cls.wheel = zipfile.ZipFile(os.path.join(cls.tmp, "dist", wheels[0]))
        cls.names = set(cls.wheel.namelist())
        cls.dist_info = next(n.split("/")[0] for n in cls.names if n.endswith(".dist-info/METADATA"))

    @classmethod
    def tearDownClass(cls):
        cls.wheel.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_metadata_names_the_distribution(self):
        metadata = self.wheel.read(f"{self.dist_info}/METADATA").decode()
        self.assertIn(f"Name: {DISTRIBUTION}\n", metadata)
        self.assertIn("Requires-Python: >=3.9", metadata)

    def test_generated_modules_and_marker_are_packaged(self):
        for name in ["refit/_proto/refit_pb2.py", "refit/_proto/layout_pb2.py", "refit/py.typed",
                     "refit/aio.py", "refit/errors.py", "refit/layouts/dtensor.py"]:
            self.assertIn(name, self.names)

    def test_vllm_finds_the_plugin(self):
        points = configparser.ConfigParser()
        points.read_string(self.wheel.read(f"{self.dist_info}/entry_points.txt").decode())
        self.assertEqual(points["vllm.general_plugins"]["refit"], "refit.integrations.vllm:register")

    def test_installed_package_imports_elsewhere(self):
        target = os.path.join(self.tmp, "site")
        pip("install", "--target", target, self.source, cwd=self.tmp)
        code = ("import refit, refit.aio, refit.controller; "
                "assert refit.__file__.startswith(%r), refit.__file__; "
                "refit.Controller('127.0.0.1:1').close(); print(refit.Role.of('engine'))" % target)
        out = subprocess.run([sys.executable, "-c", code], cwd=self.tmp, env=dict(os.environ, PYTHONPATH=target),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(out.returncode, 0, out.stdout)
        self.assertEqual(out.stdout.strip(), "inference")


if __name__ == "__main__":
    unittest.main()
