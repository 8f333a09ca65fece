"""pip install ./client/python: the `refit` package, its protobuf modules generated from
../../proto by protoc at build time (offline: `pip install --no-index --no-build-isolation`
with Debian's python3-setuptools; runtime needs grpcio and protobuf, numpy; torch optional)."""
import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    def run(self):
        proto_root = os.path.abspath(os.path.join(HERE, "..", ".."))
        if not os.path.exists(os.path.join(proto_root, "proto", "refit.proto")):
            sys.exit("setup.py: ../../proto/refit.proto not found: install from the refit repository "
                     "(pip install ./client/python)")
        subprocess.run([sys.executable, os.path.join(HERE, "gen_stubs.py"), "--proto-root", proto_root,
                        "--out", os.path.join(HERE, "refit", "_proto")], check=True)
        super().run()


setup(
    name="refit",
    version="0.1.0",
    description="Fast, correct weight refit between trainer and inference processes",
    packages=find_packages(include=["refit", "refit.*"]),
    python_requires=">=3.9",
    install_requires=[],  # grpcio, protobuf and numpy: from the system (Debian) or the user's env
    cmdclass={"build_py": BuildWithStubs},
)
