"""Everything the `refit` package raises on purpose is a `refit.Error`, so one `except refit.Error`
covers it. Each class also keeps the builtin base that says what kind of failure it is, so code
that catches `ValueError` or `TimeoutError` still works:

    Error
    ├── InvalidArgument (ValueError)     bad input: a role, a version, a layout, a worker name
    ├── RefitTimeout (TimeoutError)      a wait ran out of time (e.g. Controller.wait_ready)
    ├── StateError (RuntimeError)        a call this object cannot take in its state
    ├── ArenaFull (MemoryError)          a SharedArena has no room left
    ├── StorageReplaced (RuntimeError)   a registered tensor's memory was replaced (p.data = ...)
    ├── RegistrationError (ValueError)   the tensors do not match the layout, or the daemon refused
    │   ├── ExportError                  a tensor's memory cannot be handed to the daemon
    │   ├── HandoverError                the daemon's handle socket refused the descriptors
    │   └── RegistrationTimeout (RefitTimeout)  no daemon took it within register_timeout
    └── RefitError (RuntimeError)        a failed control call or round (code, phase, culprit)
        └── InvalidRequest (InvalidArgument) refused before it was sent (e.g. version 0)

This module imports nothing, so `refit.layouts` (pure Python) can raise these too.
"""
from typing import Any, Optional


class Error(Exception):
    """The root of every exception the `refit` package raises on purpose."""


class InvalidArgument(Error, ValueError):
    """An argument is wrong: the message names it and what is accepted."""


class RefitTimeout(Error, TimeoutError):
    """A wait ran past its deadline; the message says what was awaited and what was last seen."""


class StateError(Error, RuntimeError):
    """The call does not fit the object's state (e.g. serve() on a worker that is not blocking)."""


class ArenaFull(Error, MemoryError):
    """A SharedArena cannot hold another tensor of that size."""


class StorageReplaced(Error, RuntimeError):
    """A registered tensor no longer is the memory the daemon was handed (its storage was replaced,
    e.g. by `param.data = ...` or `model.to(...)`): a refit would read or write stale memory."""


class RegistrationError(Error, ValueError):
    """The worker's tensors do not match its layout, or the daemon refused the registration."""


class ExportError(RegistrationError):
    """A tensor's memory cannot be handed to the daemon (not shared, not on one device, ...)."""


class HandoverError(RegistrationError):
    """The daemon's handle socket refused or could not take the file descriptors."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # worth retrying: the daemon is busy or (re)starting


class RegistrationTimeout(RegistrationError, RefitTimeout):
    """No daemon took the registration within `register_timeout` seconds (none running at the
    socket, or busy throughout); the last attempt's error is its `__cause__`."""


class RefitError(Error, RuntimeError):
    """A failed control call or round: `code` (grpc.StatusCode), `phase` ("PREPARE", "TRANSFER",
    "COMMIT", "INSTALL" or None), `culprit` (e.g. 'worker "policy/engine-1"', 'node 3', or None),
    `reason`; `blamed`: the daemons' refit.v1.Culprit (kind, node, worker_id, address, phase) when
    they sent one, else None."""

    def __init__(self, code: Any, reason: str, phase: Optional[str] = None, culprit: Optional[str] = None,
                 blamed: Any = None) -> None:
        self.code, self.reason, self.phase, self.culprit = code, reason, phase, culprit
        self.blamed = blamed
        where = f" in {phase}" if phase else ""
        who = f" (culprit: {culprit})" if culprit else ""
        name = getattr(code, "name", str(code))
        super().__init__(f"{name}{where}: {reason}{who}")


class InvalidRequest(RefitError, InvalidArgument):
    """A control request refused here, before it was sent, for what the daemon would refuse it
    (`code` INVALID_ARGUMENT, as from the daemon): e.g. a version that is not positive."""
