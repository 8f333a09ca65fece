"""What the adapter tests share: the stand-in packages first on sys.path (each test imports the
stack as `vllm`, `verl`, `nemo_rl` or `sglang`, as the adapter does), refit's entry point
installed as distribution metadata (so vLLM's plugin loader finds it through importlib.metadata,
as it finds an installed package's), and the byte-for-byte comparison of engine and trainer."""
import os
import sys
import tempfile

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
STANDINS = os.path.join(HERE, "standins")
sys.path.insert(0, STANDINS)
sys.path.insert(0, os.path.dirname(harness.HERE))  # client/python: the refit package

import torch  # noqa: E402

ENTRY_POINTS = "[vllm.general_plugins]\nrefit = refit.integrations.vllm:register\n"


def install_entry_point() -> str:
    """A dist-info folder on sys.path declaring refit's vllm.general_plugins entry point (what
    `pip install` of the package writes); returns its parent folder."""
    base = tempfile.mkdtemp(prefix="refit-ep-", dir=os.environ.get("TEST_TMPDIR"))
    info = os.path.join(base, "refit_integration_test-0.0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: refit-integration-test\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(ENTRY_POINTS)
    sys.path.append(base)
    return base


def byte_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def mismatches(trainer, engine) -> list:
    """The Hugging Face tensors whose bytes differ between a TrainerModel and an EngineModel."""
    return [name for name, t in trainer.hf().items() if not byte_equal(t.detach(), engine.hf_view(name).detach())]


def still_poisoned(engine) -> bool:
    return all(bool((t.detach().contiguous().view(torch.uint8) == 0xA5).all()) for t in engine.padding().values())


def vllm_idle_engine(daemon: str, node: int, seed: int, group: str = "policy"):
    """A vLLM stand-in worker whose model registered through refit's vLLM engine in "idle" mode
    (what a verl or NeMo-RL rollout runs): (EngineModel, Worker)."""
    import refit
    from tiny_models import HF_CONFIG, EngineModel
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.v1.worker.gpu_worker import Worker
    install_entry_point_once()
    model = EngineModel(seed=seed)
    refit.share_module_(model)
    cfg = VllmConfig(model_config=ModelConfig(hf_config=dict(HF_CONFIG), dtype=torch.float32),
                     weight_transfer_config=WeightTransferConfig(backend="refit"))
    worker = Worker(cfg, model, torch.device("cpu"))
    worker.init_weight_transfer_engine({"daemon": daemon, "node": node, "group": group, "window": "idle"})
    return model, worker


_installed = []


def install_entry_point_once() -> None:
    if not _installed:
        _installed.append(install_entry_point())
