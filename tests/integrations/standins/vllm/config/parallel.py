"""Stand-in for vllm.config.parallel.ParallelConfig (the fields engines read)."""
from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_index: int = 0
    rank: int = 0  # rank within one DP replica (TP * PP)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
