"""A worker's role in its model group: the trainer side (a refit reads its tensors) or the
inference side (a refit writes them). `Role.ENGINE` is the same member as `Role.INFERENCE`."""
import enum
from typing import Union

from refit.errors import InvalidArgument


class Role(str, enum.Enum):
    TRAINER = "trainer"
    INFERENCE = "inference"
    ENGINE = "inference"  # another name of INFERENCE (an enum alias: the same member)

    @classmethod
    def of(cls, value: Union["Role", str]) -> "Role":
        """The role `value` names: a Role, or one of the strings "trainer", "inference" and
        "engine" (the same as "inference"). Anything else is an InvalidArgument naming these."""
        if isinstance(value, Role):
            return value
        if isinstance(value, str):
            spelled = _SPELLINGS.get(value)
            if spelled is not None:
                return spelled
        raise InvalidArgument(f"role must be refit.Role.TRAINER ('trainer') or refit.Role.INFERENCE "
                              f"('inference', also spelled 'engine'), not {value!r}")

    def __str__(self) -> str:
        return self.value


RoleLike = Union[Role, str]

_SPELLINGS = {"trainer": Role.TRAINER, "inference": Role.INFERENCE, "engine": Role.INFERENCE}
