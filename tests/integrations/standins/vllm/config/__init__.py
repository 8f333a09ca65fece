"""Stand-in for vllm.config: the fields a weight transfer engine reads from VllmConfig."""
from dataclasses import dataclass, field
from typing import Any, Optional

from vllm.config.parallel import ParallelConfig
from vllm.config.weight_transfer import WeightTransferConfig


@dataclass
class ModelConfig:
    hf_config: Any = None
    dtype: Any = None


@dataclass
class SpeculativeConfig:
    method: Optional[str] = None
    model: Optional[str] = None


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    weight_transfer_config: Optional[WeightTransferConfig] = None
    speculative_config: Optional[SpeculativeConfig] = None
