"""Stand-in for vllm/config/weight_transfer.py: the backend is any name registered with
WeightTransferEngineFactory (validated when the engine is created), default "nccl"."""
from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"
