"""Probe (GPU machine): what the CUDA driver says about PyTorch's caching-allocator memory, legacy
and expandable segments, so refit/cuda.py's chunk walk is built on facts. Prints JSON lines."""
import ctypes, json, os, subprocess, sys
import torch
lib = ctypes.CDLL("libcuda.so.1"); lib.cuInit(0)
def attr(a, k, t=ctypes.c_uint64):
    v = t(); r = lib.cuPointerGetAttribute(ctypes.byref(v), ctypes.c_int(k), ctypes.c_uint64(a)); return (r, v.value)
def rng(a):
    b, s = ctypes.c_uint64(), ctypes.c_size_t(); r = lib.cuMemGetAddressRange_v2(ctypes.byref(b), ctypes.byref(s), ctypes.c_uint64(a)); return (r, b.value, s.value)
def retain(a):
    h = ctypes.c_uint64(); r = lib.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(a)); return (r, h.value)
out = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
torch.cuda.init()
x = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
y = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
for name, t in [("x", x), ("y", y)]:
    a = t.data_ptr(); n = t.numel()
    row = {"t": name, "ptr": a, "bytes": n, "type": attr(a, 2, ctypes.c_int), "legacy_ipc": attr(a, 10, ctypes.c_int),
           "range_start": attr(a, 11), "range_size": attr(a, 12), "mapped": attr(a, 13, ctypes.c_int), "handle_types": attr(a, 14),
           "addr_range": rng(a), "retain": retain(a), "retain_mid": retain(a + n // 2), "addr_range_mid": rng(a + n // 2),
           "retain_end": retain(a + n - 1), "addr_range_end": rng(a + n - 1)}
    print(json.dumps(row)); sys.stdout.flush()
print(json.dumps({"uuid0": str(torch.cuda.get_device_properties(0).uuid) if hasattr(torch.cuda.get_device_properties(0), "uuid") else None,
                  "smi": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout}))
