"""refit's dtype names (proto/layout.proto) and their PyTorch and NumPy counterparts."""
from typing import Any, Dict

from refit.errors import InvalidArgument

ELEMENT_BYTES: Dict[str, int] = {
    "bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "int32": 4, "int64": 8,
    "e8m0": 1,  # MXFP8's block scales (docs/LAYOUTS.md, "fp8 engines")
}

# PyTorch's spellings (str(torch.bfloat16) == "torch.bfloat16"), as the daemon also accepts them.
_TORCH_NAMES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "int8": "int8", "int32": "int32",
    "int64": "int64", "float8_e8m0fnu": "e8m0",
}

# NumPy has no bf16 or fp8: those travel as same-sized unsigned integers.
_NUMPY_NAMES = {"float16": "fp16", "float32": "fp32", "int8": "int8", "int32": "int32", "int64": "int64"}
_NUMPY_STORAGE = {"bf16": "uint16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "uint8",
                  "fp8_e5m2": "uint8", "int8": "int8", "int32": "int32", "int64": "int64", "e8m0": "uint8"}


def canonical(name: Any) -> str:
    """A dtype name as refit spells it ("bf16"), from refit's, PyTorch's or NumPy's spelling."""
    s = str(name)
    if s.startswith("torch."):
        s = s[len("torch."):]
    if s in ELEMENT_BYTES:
        return s
    if s in _TORCH_NAMES:
        return _TORCH_NAMES[s]
    raise InvalidArgument(f"dtype {name!r} is not one refit moves ({', '.join(ELEMENT_BYTES)})")


def of_tensor(t: Any) -> str:
    """refit's dtype name of a torch tensor or numpy array."""
    if is_torch(t):
        return canonical(t.dtype)
    name = str(t.dtype)
    if name in _NUMPY_NAMES:
        return _NUMPY_NAMES[name]
    raise InvalidArgument(f"numpy dtype {name} has no refit equivalent (bf16 arrays are uint16 views: "
                     "say the dtype explicitly)")


def matches(t: Any, name: Any) -> bool:
    """Whether tensor or array `t` holds refit dtype `name` (NumPy arrays hold bf16 and fp8 as
    same-sized unsigned integers, so those match by storage; a torch.uint8 tensor holds fp8 as
    its bytes, as PyTorch before float8 dtypes must)."""
    want = canonical(name)
    if is_torch(t):
        if str(t.dtype) == "torch.uint8":
            return want in ("fp8_e4m3", "fp8_e5m2", "e8m0")
        return canonical(t.dtype) == want
    return str(t.dtype) == str(numpy_storage(want)) or _NUMPY_NAMES.get(str(t.dtype)) == want


def torch_dtype(name: Any) -> Any:
    """The torch dtype of refit dtype `name` (InvalidArgument when this PyTorch lacks it)."""
    import torch
    n = canonical(name)
    attr = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2", "int8": "int8", "int32": "int32", "int64": "int64",
            "e8m0": "float8_e8m0fnu"}[n]
    if not hasattr(torch, attr):
        raise InvalidArgument(f"this PyTorch ({torch.__version__}) has no {attr}")
    return getattr(torch, attr)


def numpy_storage(name: Any) -> Any:
    """The numpy dtype that holds refit dtype `name` bit for bit."""
    import numpy
    return numpy.dtype(_NUMPY_STORAGE[canonical(name)])


def is_torch(t: Any) -> bool:
    """Whether `t` is a torch tensor (checked without importing torch)."""
    return type(t).__module__.startswith("torch") and hasattr(t, "data_ptr")


def have_torch() -> bool:
    """Whether torch can be imported here."""
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False
