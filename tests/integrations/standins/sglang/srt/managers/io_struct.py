"""Stand-in for the request types of sglang/srt/managers/io_struct.py (see sglang/__init__.py)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class PauseGenerationReqInput:
    mode: Literal["abort", "retract", "in_place"] = "abort"

    def __post_init__(self):
        allowed = ["abort", "retract", "in_place"]
        if self.mode not in allowed:
            raise ValueError(f"Invalid mode: {self.mode!r}. Expected one of {allowed}.")


@dataclass
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass
class EndWeightUpdateReqInput:
    pass


@dataclass
class UpdateWeightVersionReqInput:
    new_version: str = ""
    abort_all_requests: bool = False
