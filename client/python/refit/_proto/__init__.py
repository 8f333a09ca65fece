"""refit's protobuf modules, generated from proto/ at build time (gen_stubs.py).

They sit beside this file after `pip install` or `gen_stubs.py --out refit/_proto`. Under Bazel
they are build outputs, so this package also looks where Bazel puts them: in the runfiles of the
test or program running now (first: the freshest build wins over stubs left in a checkout), and
in the checkout's bazel-bin (a program run from the source tree after `bazel build`).
"""
import os

_here = os.path.dirname(os.path.abspath(__file__))
_generated = os.path.join("refit", "client", "python", "refit", "_proto")
for _root in (os.environ.get("TEST_SRCDIR"), os.environ.get("RUNFILES_DIR")):
    if _root and os.path.exists(os.path.join(_root, _generated, "refit_pb2.py")):
        __path__.insert(0, os.path.join(_root, _generated))  # noqa: F821 (the package's own)
        break
else:
    _bazel_bin = os.path.join(_here, "..", "..", "..", "..", "bazel-bin", "client", "python", "refit", "_proto")
    if not os.path.exists(os.path.join(_here, "refit_pb2.py")) and os.path.exists(os.path.join(_bazel_bin, "refit_pb2.py")):
        __path__.append(os.path.normpath(_bazel_bin))  # noqa: F821
