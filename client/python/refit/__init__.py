"""refit: fast, correct weight refit between trainer and inference processes.

    import refit
    worker = refit.Worker("unix:/tmp/refitd-0.sock", "policy", refit.Role.TRAINER, layout, tensors)
    refit.Controller("127.0.0.1:7070").refit("policy", version=1)

Everything the package raises on purpose is a `refit.Error` (refit.errors). docs/PYTHON.md is
the guide.
"""
from typing import TYPE_CHECKING, Any

# Lazy: `import refit.layouts` (pure Python) must work where gRPC or the generated protobuf
# modules are absent, e.g. in a trainer that only writes its layout to a file.
_EXPORTS = {
    "Controller": "refit.controller", "RoundResult": "refit.controller",
    "SharedArena": "refit.shm", "share_module_": "refit.shm", "arena_bytes": "refit.shm",
    "Round": "refit.worker", "Worker": "refit.worker",
    "Role": "refit.role",
    "TlsFiles": "refit.tls",
    "Error": "refit.errors", "InvalidArgument": "refit.errors", "InvalidRequest": "refit.errors",
    "RefitTimeout": "refit.errors", "StateError": "refit.errors", "ArenaFull": "refit.errors",
    "StorageReplaced": "refit.errors", "RegistrationError": "refit.errors", "ExportError": "refit.errors",
    "HandoverError": "refit.errors", "RegistrationTimeout": "refit.errors", "RefitError": "refit.errors",
}

_SUBMODULES = {"aio", "controller", "cuda", "dtypes", "errors", "export", "handles", "layout_io", "layouts",
               "pattern", "role", "shm", "tls", "worker"}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from refit.controller import Controller, RoundResult
    from refit.errors import (ArenaFull, Error, ExportError, HandoverError, InvalidArgument, InvalidRequest,
                              RefitError, RefitTimeout, RegistrationError, RegistrationTimeout, StateError,
                              StorageReplaced)
    from refit.role import Role
    from refit.shm import SharedArena, arena_bytes, share_module_
    from refit.tls import TlsFiles
    from refit.worker import Round, Worker


def __getattr__(name: str) -> Any:
    import importlib
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:  # `refit.shm` without importing it first, as with eager imports
        return importlib.import_module(f"refit.{name}")
    raise AttributeError(f"module 'refit' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
