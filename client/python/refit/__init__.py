"""refit: fast, correct weight refit between trainer and inference processes.

    import refit
    worker = refit.Worker("unix:/tmp/refitd-0.sock", "policy", "trainer", layout, tensors)
    refit.Controller("127.0.0.1:7070").refit("policy", version=1)

docs/PYTHON.md is the guide.
"""
# Lazy: `import refit.layouts` (pure Python) must work where gRPC or the generated protobuf
# modules are absent, e.g. in a trainer that only writes its layout to a file.
_EXPORTS = {
    "Controller": "refit.controller", "RefitError": "refit.controller", "RoundResult": "refit.controller",
    "SharedArena": "refit.shm", "share_module_": "refit.shm",
    "Round": "refit.worker", "Worker": "refit.worker",
    "TlsFiles": "refit.tls",
    "RegistrationError": "refit.errors", "ExportError": "refit.errors", "HandoverError": "refit.errors",
}


_SUBMODULES = {"controller", "cuda", "dtypes", "errors", "export", "handles", "layout_io", "layouts",
               "pattern", "shm", "tls", "worker"}


def __getattr__(name):
    import importlib
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:  # `refit.shm` without importing it first, as with eager imports
        return importlib.import_module(f"refit.{name}")
    raise AttributeError(f"module 'refit' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
