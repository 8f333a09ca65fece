"""refit: fast, correct weight refit between trainer and inference processes.

    import refit
    worker = refit.Worker("unix:/tmp/refitd-0.sock", "policy", "trainer", layout, tensors)
    refit.Controller("127.0.0.1:7070").refit("policy", version=1)

docs/PYTHON.md is the guide.
"""
from refit.controller import Controller, RefitError, RoundResult
from refit.shm import SharedArena, share_module_
from refit.worker import Round, RegistrationError, Worker

__all__ = ["Controller", "RefitError", "RoundResult", "SharedArena", "share_module_", "Round",
           "RegistrationError", "Worker"]
