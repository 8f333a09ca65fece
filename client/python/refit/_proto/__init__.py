"""refit's protobuf modules, generated from proto/ at build time (gen_stubs.py).

They sit beside this file after `pip install` or `gen_stubs.py --out refit/_proto`. Under Bazel
they are build outputs, so this package also looks where Bazel puts them: in the runfiles of the
test or program running now (first: the freshest build wins over stubs left in a checkout), and
in the checkout's bazel-bin (a program run from the source tree after `bazel build`).
"""
import os
from typing import Any

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

_STUBS = ("layout_pb2", "refit_pb2")


def __getattr__(name: str) -> Any:
    # `from refit._proto import refit_pb2` lands here only when no such module was found: a
    # checkout on the path that was never installed or built.
    if name in _STUBS:
        import importlib
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise ImportError(
                f"refit's generated protobuf module {name} is missing (looked in {', '.join(__path__)}): "  # noqa: F821
                "install the package (docs/PYTHON.md, \"Install\"), or build it with Bazel; a checkout's "
                "client/python put on PYTHONPATH has no generated modules, and comes before an installed "
                "package") from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
