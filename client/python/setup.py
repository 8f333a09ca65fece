"""pip install ./client/python: the package's metadata is in pyproject.toml; this file adds the
build step that generates the protobuf modules from ../../proto with protoc (offline:
`pip install --no-index --no-build-isolation` with Debian's python3-setuptools; runtime needs
grpcio, protobuf and numpy; torch optional)."""
import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    def run(self) -> None:
        proto_root = os.path.abspath(os.path.join(HERE, "..", ".."))
        if not os.path.exists(os.path.join(proto_root, "proto", "refit.proto")):
            sys.exit("setup.py: ../../proto/refit.proto not found: install from the refit repository "
                     "(pip install ./client/python)")
        subprocess.run([sys.executable, os.path.join(HERE, "gen_stubs.py"), "--proto-root", proto_root,
                        "--out", os.path.join(HERE, "refit", "_proto")], check=True)
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
