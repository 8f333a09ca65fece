"""Each RL stack's default weight sync against refit through that stack's adapter, in one run on
one GPU: a trainer process and an engine process colocated on the device (as verl and NeMo-RL run
by default), one `refitd --backend cuda`, a transformers model built from a config with random
weights (no download).

    python3 tests/gpu/integrations/stack_sync_bench.py --out result.json \
        [--model qwen2-0.6b|qwen2-small|tiny] [--stacks sglang,verl,nemo_rl] [--rounds 5] [--warmup 1]

For each stack, every round (after an optimizer step on the trainer) runs, in alternating order:
  refit    the stack's refit adapter driven as its stand-in drives it (tests/integrations/standins):
           sglang: SGLangSession.update() against the SGLang stand-in's HTTP routes, the engine's
                   live parameters registered by refit.integrations.sglang.EngineWorker;
           verl:   RefitCheckpointEngine built by CheckpointEngineRegistry after
                   custom_backend_module imported it, send_weights(per-tensor stream) on the trainer
                   and receive_weights() on the rollout, the engine registered through the vLLM
                   adapter in "idle" window;
           nemo_rl: RefitCheckpointEngine from refit_transport "module:Class", send_weights and
                   receive_weight_batches, the engine as for verl;
  default  that stack's published colocated path, reproduced below from its source (each
           reproduction names repository, path and commit);
  ceiling  one device-to-device copy of the same bytes (two preallocated buffers, trainer side).
Before each sync every engine byte is poisoned (0xA5); after it, every engine byte is compared
with the trainer's and the engine's greedy tokens of a short prompt with the trainer's. Timings
are medians of --rounds after --warmup rounds. The JSON says what each number is.

`--model tiny` (tests/integrations/tiny_models.py, float32) with `--device cpu` runs every path
on the CPU with refitd's host backend: it checks this script's logic, not the stacks' costs
(there, CUDA IPC handles become torch's shared-memory handles of copies).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import pickle
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
for _p in (os.path.join(REPO, "tests", "integrations"), os.path.join(REPO, "tests", "integrations", "standins"),
           os.path.join(REPO, "client", "python", "tests"), os.path.join(REPO, "client", "python"), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402,F401 (registers torch's tensor reductions with ForkingPickler)
from torch.multiprocessing.reductions import reduce_tensor  # noqa: E402

STACKS = ("sglang", "verl", "nemo_rl")
PAD = 64
POISON = 0xA5

# ------------------------------------------------------------------------------------------------
# Models: the trainer holds Hugging Face names; the engine holds vLLM's (and SGLang's) fused
# layout: q/k/v stacked in qkv_proj, gate/up in gate_up_proj, vocabulary padded to 64 rows.

MODELS: Dict[str, Dict[str, Any]] = {
    # Qwen2.5-0.5B's shapes with an untied head: 0.63 B parameters, 1.26 GB of bf16.
    "qwen2-0.6b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=False),
    # rl_loop.py's small config (110.7 MB of bf16), for a quick run.
    "qwen2-small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
}


def fused_slices(shapes: Dict[str, Tuple[int, ...]], vocab: int) -> Dict[str, Tuple[str, int, int]]:
    """Hugging Face name -> (fused buffer name, first row, rows) in the engine's layout."""
    out: Dict[str, Tuple[str, int, int]] = {}
    groups = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
              "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
              "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
              "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
              "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        if part in groups:
            fused, order = groups[part]
            row = 0
            for p in order[:order.index(part)]:
                row += shapes[f"{parent}.{p}.{leaf}"][0]
            out[name] = (f"{parent}.{fused}.{leaf}", row, shape[0])
        else:
            out[name] = (name, 0, shape[0] if part not in ("embed_tokens", "lm_head") else vocab)
    return out


def fused_shapes(shapes: Dict[str, Tuple[int, ...]], vocab: int) -> Dict[str, Tuple[int, ...]]:
    """Fused buffer name -> shape (the padded vocabulary included)."""
    rows: Dict[str, int] = {}
    tail: Dict[str, Tuple[int, ...]] = {}
    for name, (fused, row, n) in fused_slices(shapes, vocab).items():
        part = name.rpartition(".")[0].rpartition(".")[2]
        total = -(-vocab // PAD) * PAD if part in ("embed_tokens", "lm_head") else row + n
        rows[fused] = max(rows.get(fused, 0), total)
        tail[fused] = tuple(shapes[name][1:])
    return {f: (rows[f],) + tail[f] for f in rows}


def views_over(buffers: Dict[str, torch.Tensor], slices: Dict[str, Tuple[str, int, int]]) -> Dict[str, torch.Tensor]:
    return {name: buffers[fused][row:row + n] for name, (fused, row, n) in slices.items()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def byte_mismatches(want: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose bytes differ (or that one side lacks)."""
    bad = sorted(set(want) ^ set(got))
    for name, t in want.items():
        u = got.get(name)
        if u is not None and (t.shape != u.shape or t.dtype != u.dtype or not torch.equal(as_bytes(t), as_bytes(u))):
            bad.append(name)
    return bad


def poison_(tensors: Iterable[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in tensors:
            t.view(torch.uint8).fill_(POISON)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ModelSpec:
    name: str          # a key of MODELS, or "tiny"
    device: str        # "cuda" or "cpu"
    seed: int = 0

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.name == "tiny" else torch.bfloat16

    def hf_config(self) -> Any:
        if self.name == "tiny":
            from tiny_models import HF_CONFIG
            return dict(HF_CONFIG)
        if self.name not in MODELS:
            raise ValueError(f"unknown --model {self.name!r}: choose one of {', '.join(sorted(MODELS))} or 'tiny'")
        from transformers import Qwen2Config
        return Qwen2Config(**MODELS[self.name], torch_dtype="bfloat16")

    def vocab(self) -> int:
        cfg = self.hf_config()
        return int(cfg["vocab_size"] if isinstance(cfg, dict) else cfg.vocab_size)


class Trainer:
    """The trainer's model (Hugging Face names), its optimizer step and greedy decoding."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec, self.device = spec, torch.device(spec.device)
        torch.manual_seed(spec.seed)
        if spec.name == "tiny":
            from tiny_models import TrainerModel
            self.module: Any = TrainerModel(seed=spec.seed)
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=3e-2)
        else:
            from transformers import AutoModelForCausalLM
            # Built on the host, then moved (as rl_loop.py, which ran on the GPU machine, does).
            self.module = AutoModelForCausalLM.from_config(spec.hf_config(), torch_dtype=spec.dtype).to(self.device)
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
        self.vocab = spec.vocab()

    def params(self) -> Dict[str, torch.Tensor]:
        """The live parameters by Hugging Face name (their storage never changes)."""
        if self.spec.name == "tiny":
            return self.module.hf()
        return dict(self.module.named_parameters())

    def stream(self) -> Iterable[Tuple[str, torch.Tensor]]:
        """What the stacks' trainers hand their sync step: (name, full tensor) per parameter."""
        return ((n, p.detach()) for n, p in self.params().items())

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params().values())

    def step(self, step: int) -> None:
        if self.spec.name == "tiny":
            from tiny_models import train_step
            train_step(self.module, self.opt, step)
            return
        g = torch.Generator().manual_seed(1000 + step)
        batch = torch.randint(0, self.vocab, (4, 64), generator=g).to(self.device)
        self.module(input_ids=batch, labels=batch).loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        synchronize(self.device)

    @torch.no_grad()
    def greedy(self, ids: List[int], n: int) -> List[int]:
        if self.spec.name == "tiny":
            return self.module.greedy(ids, n)
        out = self.module.generate(torch.tensor([ids], device=self.device), max_new_tokens=n, do_sample=False,
                                   pad_token_id=0)
        return out[0, len(ids):].tolist()


class Engine:
    """The engine's model: parameters in the fused layout (the module registered with refit),
    `views` by Hugging Face name into them, and the weight loader the default paths call."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec, self.device = spec, torch.device(spec.device)
        self.hf_config = spec.hf_config()
        vocab = spec.vocab()
        if spec.name == "tiny":
            import refit
            from tiny_models import EngineModel, hf_shapes
            self.module: Any = EngineModel(seed=spec.seed + 5)
            # CPU engines are registered live from shared memory.
            self.arena = refit.share_module_(self.module)
            shapes = {n: tuple(s) for n, s in hf_shapes().items()}
        else:
            from transformers import AutoModelForCausalLM
            import rl_loop
            hf = AutoModelForCausalLM.from_config(self.hf_config, torch_dtype=spec.dtype).to(self.device)
            if getattr(self.hf_config, "tie_word_embeddings", False):
                raise ValueError("this benchmark builds untied models only (tie_word_embeddings=False)")
            state = {n: p.detach() for n, p in hf.named_parameters()}
            buffers, views = rl_loop.fused_buffers(state, vocab)
            rl_loop.rebind_to_views(hf, views)
            self.module = EngineModule(hf, buffers)
            shapes = {n: tuple(t.shape) for n, t in state.items()}
        self.buffers = dict(self.module.named_parameters())
        self.views = views_over(self.buffers, fused_slices(shapes, vocab))
        # A fault for the CPU test only: a loader that skips this tensor, which the byte check
        # must catch.
        self.skip_load = os.environ.get("STACK_SYNC_BENCH_SKIP_LOAD", "")

    def load_weights(self, pairs: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """The engines' `model.load_weights`: each tensor copied into its slice of the fused
        parameters (vLLM's and SGLang's stacked-parameter weight loaders do this copy)."""
        with torch.no_grad():
            for name, t in pairs:
                if name == self.skip_load:
                    continue
                view = self.views.get(name)
                if view is None:
                    raise KeyError(f"the engine has no parameter for {name!r}")
                if tuple(view.shape) != tuple(t.shape):
                    raise ValueError(f"{name!r}: got {tuple(t.shape)}, the engine holds {tuple(view.shape)}")
                view.copy_(t)

    def finish(self) -> None:
        """Re-derives what the forward pass derives from the weights (the tiny model's attention
        caches a transposed o_proj, as vLLM's MLA caches absorbed matrices; the transformers
        model derives nothing)."""
        post = getattr(self.module, "post_load_weights", None)
        if post is not None:
            post()

    @torch.no_grad()
    def greedy(self, ids: List[int], n: int) -> List[int]:
        self.finish()
        return self.module.greedy(ids, n)


class EngineModule(torch.nn.Module):
    """A transformers model whose parameters are views into vLLM-named fused buffers: the
    buffers are this module's parameters (what the vLLM and SGLang adapters register)."""

    def __init__(self, hf_model: torch.nn.Module, buffers: Dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.hf_model = [hf_model]  # not a submodule: its parameters are views of the buffers
        for name, buf in buffers.items():
            *path, leaf = name.split(".")
            m: torch.nn.Module = self
            for part in path:
                if not hasattr(m, part):
                    m.add_module(part, torch.nn.Module())
                m = getattr(m, part)
            m.register_parameter(leaf, torch.nn.Parameter(buf, requires_grad=False))

    def post_load_weights(self) -> None:
        """SGLang's end_weight_update calls this; nothing is derived from this model's weights."""

    @torch.no_grad()
    def greedy(self, ids: List[int], n: int) -> List[int]:
        hf = self.hf_model[0]
        dev = next(hf.parameters()).device
        out = hf.generate(torch.tensor([ids], device=dev), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()


# ------------------------------------------------------------------------------------------------
# One process to the other: pickled messages over a socket pair (what the stacks' ZMQ
# send_pyobj/recv_pyobj do over an ipc:// socket), every receive with a deadline.

class Channel:
    def __init__(self, conn: Any, peer: str) -> None:
        self.conn, self.peer = conn, peer

    def send(self, obj: Any) -> None:
        self.conn.send_bytes(bytes(ForkingPickler.dumps(obj)))

    def recv(self, timeout: float, what: str) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no {what} from the {self.peer} within {timeout:g} s")
        return pickle.loads(self.conn.recv_bytes())


# ------------------------------------------------------------------------------------------------
# CUDA IPC handles as the stacks make and open them: torch's reduce_tensor (a CUDA tensor's
# handle, its offset and size; CPU tensors: a shared-memory handle) and the rebuild function it
# names, with the device index replaced by the receiver's own (verl's rebuild_ipc and NeMo-RL's
# rebuild_cuda_tensor_from_ipc do so; index 6 of the CUDA arguments is the device).

def tensor_handle(t: torch.Tensor) -> Tuple[Callable[..., torch.Tensor], tuple]:
    if t.device.type != "cuda":
        # Host memory: torch moves a tensor into its own shared memory to share it; the engine's
        # and trainer's CPU tensors live in refit's arenas and must stay there, so share a copy.
        t = t.clone()
    return reduce_tensor(t.detach())


def open_handle(handle: Tuple[Callable[..., torch.Tensor], tuple], device: torch.device) -> torch.Tensor:
    func, args = handle
    if device.type == "cuda":
        args = tuple(args[:6]) + (device.index or 0,) + tuple(args[7:])
    return func(*args)


def serialize_tensor(t: torch.Tensor) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize of one tensor: ForkingPickler's bytes, which
    for a CUDA tensor hold its IPC handle, not its data."""
    if t.device.type != "cuda":
        t = t.clone()  # see tensor_handle
    return bytes(ForkingPickler.dumps(t.detach()))


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # Tensor.nbytes is newer than the CPU checks' torch


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def aligned(nbytes: int, alignment: int = 512) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def release_cached_memory(device: torch.device) -> None:
    """gc.collect(), ipc_collect() and empty_cache(), as verl's and NeMo-RL's paths do after each
    sync (part of what they cost)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


# ---- SGLang: update_weights_from_tensor --------------------------------------------------------
# Reproduced from sgl-project/sglang:
#   python/sglang/srt/weight_sync/utils.py @ 105cec05def6b93d68ea396000500c5d16e00a96
#     update_weights(): each tensor serialized by MultiprocessingSerializer (ForkingPickler: a
#     CUDA IPC handle per tensor), the (name, LocalSerializedTensor(values=[bytes per TP rank]))
#     list serialized again, one copy per TP rank, sent as UpdateWeightsFromTensorReqInput;
#   python/sglang/srt/model_executor/model_runner.py, ModelRunner.update_weights_from_tensor
#     (stored version read through the index, commit not given): each LocalSerializedTensor
#     deserialized for this TP rank (the IPC handle opened), `.to(device)`, then
#     model.load_weights(named_tensors);
#   python/sglang/srt/patch_torch.py @ 014da9c1a029725a3f152cbb108a2da71d8e2e31: the device
#     index travels as the GPU's UUID (left out here: both processes see the GPU as device 0).
# One request with every tensor (TP=1); SGLang's own hops (tokenizer manager -> scheduler ->
# TP worker, ZMQ between them) are one socket here. verl's SGLang rollout additionally clones
# each tensor into buckets before this (verl/workers/rollout/sglang_rollout/utils.py).

@dataclass
class PerRankBytes:
    """SGLang's LocalSerializedTensor: the i-th value is the i-th TP rank's serialized tensor."""
    values: List[bytes]


def sglang_tensor_request(stream: Iterable[Tuple[str, torch.Tensor]], tp_size: int = 1) -> List[bytes]:
    named = [(name, PerRankBytes([serialize_tensor(t)])) for name, t in stream]
    return [bytes(ForkingPickler.dumps(named)) for _ in range(tp_size)]


def sglang_tensor_load(request: List[bytes], engine: Engine, tp_rank: int = 0) -> int:
    named = pickle.loads(request[tp_rank])
    tensors = [(name, pickle.loads(t.values[tp_rank]).to(engine.device)) for name, t in named]
    engine.load_weights(tensors)
    synchronize(engine.device)
    return len(tensors)


# ---- verl: the colocated vLLM rollout's update_weights (CUDA IPC bucket over ZMQ) ---------------
# Reproduced from volcengine/verl @ b178a3cd56f58b2d502255daba591e92833930a7:
#   verl/workers/rollout/vllm_rollout/vllm_rollout.py, ServerAdapter.update_weights (trainer):
#     a uint8 bucket of update_weights_bucket_megabytes (default 2048) allocated on the device,
#     its IPC handle sent once (send_pyobj, REQ/REP), then per bucket each tensor (cast to the
#     rollout dtype) copied in at an offset, device synchronized, {"bucket_meta", "is_last"}
#     sent and acknowledged; afterwards del buffer, gc.collect(), ipc_collect(), empty_cache();
#   verl/workers/rollout/vllm_rollout/utils.py, vLLMColocateWorkerExtension.update_weights_from_ipc
#     (engine): the bucket rebuilt from the handle, each tensor viewed at its offset and cloned,
#     device synchronized, ACK, then model_runner.model.load_weights(weights); the same cleanup.
#   verl/checkpoint_engine/base.py: the "naive" backend (the colocated default) hands the
#   trainer's per-tensor stream to that update_weights in the trainer process.

def verl_ipc_send(stream: Iterable[Tuple[str, torch.Tensor]], ch: Channel, device: torch.device, bucket_bytes: int,
                  dtype: torch.dtype, timeout: float) -> int:
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    ch.send(tensor_handle(buffer) if device.type == "cuda" else _shared_bucket(buffer))
    ch.recv(timeout, "acknowledgment of the bucket handle")
    offset, meta, buckets = 0, {}, 0
    with torch.no_grad():
        for name, weight in stream:
            weight = weight.to(dtype, non_blocking=True)
            if offset + nbytes_of(weight) > bucket_bytes:
                synchronize(device)
                ch.send({"bucket_meta": meta, "is_last": False})
                ch.recv(timeout, "acknowledgment of a bucket")
                meta, offset, buckets = {}, 0, buckets + 1
            if offset + nbytes_of(weight) > bucket_bytes:
                raise ValueError(f"{name} ({nbytes_of(weight)} bytes) does not fit a bucket of {bucket_bytes} bytes: "
                                 "raise --verl-bucket-mb")
            meta[name] = {"name": name, "shape": weight.shape, "dtype": weight.dtype, "offset": offset}
            buffer[offset:offset + nbytes_of(weight)].copy_(weight.reshape(-1).view(torch.uint8), non_blocking=True)
            offset += nbytes_of(weight)
    synchronize(device)
    ch.send({"bucket_meta": meta, "is_last": True})
    ch.recv(timeout, "acknowledgment of the last bucket")
    del buffer
    release_cached_memory(device)
    return buckets + 1


def _shared_bucket(buffer: torch.Tensor) -> Tuple[Callable[..., torch.Tensor], tuple]:
    # Host memory: the bucket itself goes to torch's shared memory (its data is written later).
    buffer.share_memory_()
    return reduce_tensor(buffer)


def verl_ipc_receive(ch: Channel, engine: Engine, timeout: float) -> int:
    buffer = open_handle(ch.recv(timeout, "bucket handle"), engine.device)
    if buffer.dtype != torch.uint8:
        raise TypeError(f"the bucket is {buffer.dtype}, not uint8")
    ch.send(b"")
    loaded = 0
    while True:
        metadata = ch.recv(timeout, "bucket metadata")
        weights = []
        for name, meta in metadata["bucket_meta"].items():
            shape, dtype, offset = meta["shape"], meta["dtype"], meta["offset"]
            size = itemsize(dtype) * shape.numel()
            weights.append((name, buffer[offset:offset + size].view(dtype=dtype).view(shape).clone()))
        synchronize(engine.device)
        ch.send(b"")
        engine.load_weights(weights)
        loaded += len(weights)
        del weights
        if metadata["is_last"]:
            break
    del buffer
    release_cached_memory(engine.device)
    return loaded


# ---- NeMo-RL: refit_policy_generation, colocated vLLM (ZMQ IPC, ping-pong buffers) -------------
# Reproduced from NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909:
#   nemo_rl/algorithms/grpo.py, refit_policy_generation (colocated_inference): buffer size =
#     free device memory x NRL_REFIT_BUFFER_MEMORY_RATIO (0.3);
#   nemo_rl/models/policy/utils.py, stream_weights_via_ipc_zmq_impl (policy): two buffers of
#     half that size each (512-byte aligned), tensors packed at 512-byte aligned offsets; per
#     full group: stream synchronized, get_handle_from_tensor(buffer) (reduce_tensor), the
#     previous group's ACK awaited, (handle, names, used_bytes) sent; buffers switched; at the
#     end the last ACK, buffers released (empty_cache), COMPLETE sent and acknowledged;
#   nemo_rl/models/generation/vllm/vllm_backend.py, update_weights_via_ipc_zmq (vLLM worker):
#     per group the buffer rebuilt (rebuild_cuda_tensor_from_ipc), each tensor viewed from
#     state_dict_info's shape and dtype, _load_weights (model.load_weights), stream synchronized,
#     ACK; on COMPLETE process_weights_after_loading, ACK; then gc.collect(), empty_cache().

def nemo_ipc_send(stream: Iterable[Tuple[str, torch.Tensor]], ch: Channel, device: torch.device, buffer_bytes: int,
                  timeout: float) -> int:
    half = buffer_bytes // 2
    buffers: List[torch.Tensor] = []
    used, names, await_recv, groups = 0, [], False, 0

    def send_group(buf: torch.Tensor) -> None:
        nonlocal await_recv
        synchronize(device)
        handle = tensor_handle(buf) if device.type == "cuda" else _shared_bucket(buf)
        if await_recv:
            ch.recv(timeout, "acknowledgment of a group")
        ch.send((handle, list(names), used))
        await_recv = True

    with torch.no_grad():
        for name, t in stream:
            if not buffers:
                buffers = [torch.empty(aligned(half), dtype=torch.uint8, device=device) for _ in range(2)]
                current = buffers[0]
            size = aligned(nbytes_of(t))
            if size > half:
                raise ValueError(f"{name} ({nbytes_of(t)} bytes) exceeds half the refit buffer ({half} bytes): raise "
                                 "--nemo-buffer-ratio (NeMo-RL would send it alone in a buffer of its own)")
            if used + size > half:
                send_group(current)
                groups += 1
                current = buffers[1] if current is buffers[0] else buffers[0]
                used, names = 0, []
            names.append(name)
            current[used:used + nbytes_of(t)].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            used += size
        if names:
            send_group(current)
            groups += 1
    if await_recv:
        ch.recv(timeout, "acknowledgment of the last group")
    synchronize(device)
    buffers.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ch.send("complete")
    ch.recv(timeout, "acknowledgment of COMPLETE")
    return groups


def nemo_ipc_receive(ch: Channel, engine: Engine, info: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
                     timeout: float) -> int:
    loaded = 0
    while True:
        payload = ch.recv(timeout, "IPC group")
        if payload == "complete":
            engine.finish()  # process_weights_after_loading
            ch.send(b"ack")
            break
        handle, keys, used = payload
        buffer = open_handle(handle, engine.device)
        weights, offset = [], 0
        for key in keys:
            shape, dtype = info[key]
            size = itemsize(dtype) * torch.Size(shape).numel()
            weights.append((key, buffer[offset:offset + size].view(dtype=dtype).view(shape)))
            offset += aligned(size)
        if offset != used:
            raise ValueError(f"a group's offsets end at {offset}, the sender used {used} bytes")
        engine.load_weights(weights)
        loaded += len(weights)
        synchronize(engine.device)
        del weights, buffer
        ch.send(b"ack")
    release_cached_memory(engine.device)
    return loaded


# ------------------------------------------------------------------------------------------------
# The engine process: builds the engine, serves the trainer's commands on the control channel,
# and for the default paths receives on the data channel.

class EngineServer:
    def __init__(self, spec: ModelSpec, ctl: Channel, data: Channel, timeout: float) -> None:
        self.spec, self.ctl, self.data, self.timeout = spec, ctl, data, timeout
        self.engine: Optional[Engine] = None
        self.sglang: Any = None            # (server, scheduler, EngineWorker)
        self.vllm_worker: Any = None
        self.rollout: Any = None           # the stack's checkpoint engine, rollout side
        self.nemo_info: Dict[str, Any] = {}

    def serve(self) -> None:
        while True:
            cmd, kwargs = self.ctl.recv(24 * 3600.0, "command")
            if cmd == "stop":
                self.close()
                self.ctl.send(("ok", None))
                return
            try:
                result = getattr(self, "cmd_" + cmd)(**kwargs)
                self.ctl.send(("ok", result))
            except Exception as e:  # noqa: BLE001 (the trainer reports it)
                self.ctl.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("the engine was not built (cmd_build)")
        return self.engine

    def cmd_build(self) -> Dict[str, Any]:
        if self.spec.device == "cuda":
            torch.cuda.set_device(0)
        self.engine = Engine(self.spec)
        return {"pid": os.getpid(), "buffers": self._share_buffers()}

    def _share_buffers(self) -> List[Tuple[str, Any]]:
        """Handles of the fused buffers, so the trainer can poison and check them in place."""
        engine = self._engine()
        if engine.device.type == "cuda":
            return [(n, reduce_tensor(b.detach())) for n, b in engine.buffers.items()]
        arena = engine.arena
        return [(n, ("memfd", os.getpid(), arena.fd, arena.nbytes, arena.locate(b.data_ptr(), nbytes_of(b)),
                     tuple(b.shape), b.dtype)) for n, b in engine.buffers.items()]

    def cmd_greedy(self, ids: List[int], n: int) -> List[int]:
        return self._engine().greedy(ids, n)

    # Default paths.
    def cmd_sglang_update_weights_from_tensor(self, request: List[bytes]) -> int:
        return sglang_tensor_load(request, self._engine())

    def cmd_verl_update_weights_from_ipc(self) -> int:
        return verl_ipc_receive(self.data, self._engine(), self.timeout)

    def cmd_nemo_prepare_refit_info(self, info: Dict[str, Any]) -> None:
        self.nemo_info = info

    def cmd_nemo_update_weights_via_ipc_zmq(self) -> int:
        return nemo_ipc_receive(self.data, self._engine(), self.nemo_info, self.timeout)

    # refit through the adapters.
    def cmd_sglang_setup(self, daemon: str, group: str) -> str:
        from refit.integrations.sglang import EngineWorker
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.managers.scheduler import Scheduler
        engine = self._engine()
        scheduler = Scheduler(engine.module)
        server, url = launch_server(scheduler)
        worker = EngineWorker(engine.module, engine.hf_config, daemon=daemon, node=0, group=group,
                              in_update=lambda: scheduler.weight_update_in_progress)
        self.sglang = (server, scheduler, worker)
        return url

    def cmd_sglang_generate_check(self) -> bool:
        server, scheduler, worker = self.sglang
        return not scheduler.paused and not scheduler.weight_update_in_progress

    def cmd_vllm_idle_setup(self, daemon: str, group: str, stack: str, control: str) -> None:
        import itest
        from vllm.config import ModelConfig, VllmConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.v1.worker.gpu_worker import Worker
        engine = self._engine()
        itest.install_entry_point_once()
        cfg = VllmConfig(model_config=ModelConfig(hf_config=engine.hf_config, dtype=self.spec.dtype),
                         weight_transfer_config=WeightTransferConfig(backend="refit"))
        self.vllm_worker = Worker(cfg, engine.module, engine.device)
        self.vllm_worker.init_weight_transfer_engine({"daemon": daemon, "node": 0, "group": group, "window": "idle",
                                                      "timeout_s": self.timeout})
        self.rollout = make_checkpoint_engine(stack, side="rollout", control=control, daemon=daemon, group=group,
                                              timeout=self.timeout)
        if stack == "nemo_rl":
            self.rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1,
                                                    metadata=[self.rollout.prepare()])

    def cmd_verl_build_process_group(self) -> Dict[str, Any]:
        meta = self.rollout.prepare()
        self.rollout.init_process_group(rank=0, side="rollout")
        return meta

    def cmd_verl_receive_weights(self) -> int:
        return asyncio.run(_count(self.rollout.receive_weights()))

    def cmd_verl_finalize(self) -> None:
        self.rollout.finalize()

    def cmd_nemo_receive_weight_batches(self) -> int:
        return asyncio.run(_count(self.rollout.receive_weight_batches()))

    def cmd_teardown(self) -> None:
        self.close()

    def close(self) -> None:
        if self.sglang is not None:
            server, _, worker = self.sglang
            worker.close()
            server.shutdown()
            self.sglang = None
        if self.rollout is not None:
            closer = getattr(self.rollout, "close", None) or self.rollout.finalize
            closer()
            self.rollout = None
        if self.vllm_worker is not None:
            self.vllm_worker.shutdown()
            self.vllm_worker = None


async def _count(items: Any) -> int:
    n = 0
    async for _ in items:
        n += 1
    return n


def make_checkpoint_engine(stack: str, *, side: str, control: str, daemon: str, group: str, timeout: float) -> Any:
    """The stack's checkpoint engine built as the stack builds it (see the stand-ins)."""
    kwargs = {"control": control, "daemon": daemon, "group": group, "node": 0, "timeout_s": timeout}
    if stack == "verl":
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs
        import_external_libs("refit.integrations.verl")  # checkpoint_engine.custom_backend_module
        return CheckpointEngineRegistry.new("refit", is_master=(side == "trainer"), bucket_size=2048 << 20, **kwargs)
    if stack == "nemo_rl":
        from nemo_rl.utils.checkpoint_engines.base import create_checkpoint_engine
        return create_checkpoint_engine("refit.integrations.nemo_rl:RefitCheckpointEngine", bucket_size_bytes=1 << 30,
                                        engine_kwargs=kwargs)
    raise ValueError(f"no checkpoint engine for stack {stack!r}")


def engine_main(spec: ModelSpec, ctl_conn: Any, data_conn: Any, timeout: float) -> None:
    EngineServer(spec, Channel(ctl_conn, "trainer"), Channel(data_conn, "trainer"), timeout).serve()


# ------------------------------------------------------------------------------------------------
# The trainer process.

class EngineProcess:
    """The engine process and its two channels, seen from the trainer."""

    def __init__(self, spec: ModelSpec, timeout: float) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        ctl_here, ctl_there = ctx.Pipe(duplex=True)
        data_here, data_there = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=engine_main, args=(spec, ctl_there, data_there, timeout), daemon=True)
        self.proc.start()
        ctl_there.close()
        data_there.close()
        self.ctl, self.data = Channel(ctl_here, "engine process"), Channel(data_here, "engine process")
        self.timeout = timeout
        self._pending: Optional[str] = None

    def start(self, cmd: str, **kwargs: Any) -> None:
        if self._pending is not None:
            raise RuntimeError(f"{cmd} while {self._pending} is still running in the engine process")
        self.ctl.send((cmd, kwargs))
        self._pending = cmd

    def result(self, timeout: Optional[float] = None) -> Any:
        cmd, self._pending = self._pending, None
        if not self.proc.is_alive() and not self.ctl.conn.poll(0):
            raise RuntimeError(f"the engine process exited (code {self.proc.exitcode}) during {cmd}")
        status, value = self.ctl.recv(timeout or self.timeout, f"reply to {cmd}")
        if status != "ok":
            raise RuntimeError(f"engine process, {cmd}: {value}")
        return value

    @contextlib.contextmanager
    def reply_even_if_this_fails(self) -> Iterator[None]:
        """When the trainer's side of a started command fails, collects the engine's reply (its
        own failure, at the latest when its receive times out) so the channel stays in step."""
        try:
            yield
        except BaseException:
            if self._pending is not None:
                try:
                    self.result()
                except Exception:  # noqa: BLE001 (the trainer's error is the one to report)
                    pass
            raise

    def call(self, cmd: str, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        self.start(cmd, **kwargs)
        return self.result(timeout)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self._pending = None
                self.call("stop", timeout=60)
        finally:
            self.proc.join(timeout=30)
            if self.proc.is_alive():
                self.proc.kill()


def open_engine_buffers(shared: List[Tuple[str, Any]],
                        device: torch.device) -> Tuple[Dict[str, torch.Tensor], List[Any]]:
    """The engine's fused buffers, mapped here (CUDA IPC, or the engine's shared-memory arena)."""
    import mmap
    out: Dict[str, torch.Tensor] = {}
    keep: List[Any] = []
    maps: Dict[Tuple[int, int], Any] = {}
    for name, h in shared:
        if isinstance(h, tuple) and h and h[0] == "memfd":
            _, pid, fd, nbytes, offset, shape, dtype = h
            if (pid, fd) not in maps:
                with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
                    maps[(pid, fd)] = mmap.mmap(f.fileno(), nbytes)
                keep.append(maps[(pid, fd)])
            count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            flat = torch.frombuffer(maps[(pid, fd)], dtype=torch.uint8, count=count, offset=offset)
            out[name] = flat.view(dtype).view(shape)
        else:
            out[name] = open_handle(h, device)
    return out, keep


class Bench:
    """One run: the engine process, the refitd cluster, and per stack its rounds."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spec = ModelSpec(args.model, args.device)
        self.device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        self.timeout = args.timeout

    def run(self) -> Dict[str, Any]:
        import harness
        args = self.args
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        t0 = time.perf_counter()
        self.trainer = Trainer(self.spec)
        self.params = self.trainer.params()
        if self.device.type == "cpu":
            import refit
            refit.share_module_(self.trainer.module)  # CPU trainers register live from shared memory
            self.params = self.trainer.params()
        self.engine = EngineProcess(self.spec, self.timeout)
        result: Dict[str, Any] = {"stacks": {}}
        try:
            built = self.engine.call("build", timeout=max(self.timeout, 600))
            engine_buffers, self._maps = open_engine_buffers(built["buffers"], self.device)
            self.engine_buffers = engine_buffers
            shapes = {n: tuple(p.shape) for n, p in self.params.items()}
            self.engine_views = views_over(engine_buffers, fused_slices(shapes, self.spec.vocab()))
            unmatched = sorted(set(self.params) ^ set(self.engine_views))
            if unmatched:
                raise RuntimeError(f"trainer and engine name different tensors: {unmatched[:5]}")
            self.engine.call("nemo_prepare_refit_info",
                             info={n: (tuple(p.shape), p.dtype) for n, p in self.params.items()})
            g = torch.Generator().manual_seed(7)
            self.prompt = torch.randint(0, self.spec.vocab(), (args.prompt_tokens,), generator=g).tolist()
            result.update({
                "model": self.describe_model(), "device": self.device_name(), "torch": torch.__version__,
                "bytes_per_sync": self.trainer.nbytes(), "rounds": args.rounds, "warmup": args.warmup,
                "setup_s": None})
            flags = ["--backend", "cuda"] if self.device.type == "cuda" else []
            with harness.Cluster(nodes=1, daemon_flags=flags + args.refitd_flag) as cluster:
                self.cluster = cluster
                result["setup_s"] = time.perf_counter() - t0
                for stack in args.stacks:
                    result["stacks"][stack] = self.run_stack(stack)
                    write_json(args.out, result)  # what finished survives a run cut short
        except Exception as e:  # noqa: BLE001 (recorded with whatever stacks finished)
            result["error"] = f"{type(e).__name__}: {e}"
            result["traceback"] = traceback.format_exc()
        finally:
            try:
                self.engine.stop()
            except Exception as e:  # noqa: BLE001
                result.setdefault("error", f"stopping the engine process: {type(e).__name__}: {e}")
        result["passed"] = "error" not in result and len(result["stacks"]) == len(args.stacks) and all(
            s.get("passed") for s in result["stacks"].values())
        return result

    def describe_model(self) -> Dict[str, Any]:
        cfg = self.spec.hf_config()
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings")
        return {"name": self.spec.name, "dtype": str(self.spec.dtype),
                "parameters": sum(p.numel() for p in self.params.values()),
                **{k: d.get(k) for k in keys}, "weights": "random (built from the config; no download)"}

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    # ---- one stack ----
    def run_stack(self, stack: str) -> Dict[str, Any]:
        refit_sync = {"sglang": SGLangRefit, "verl": VerlRefit, "nemo_rl": NemoRefit}[stack](self, stack)
        default_sync = {"sglang": self.sglang_default, "verl": self.verl_default, "nemo_rl": self.nemo_default}[stack]
        out: Dict[str, Any] = {"refit": DEFAULT_DESCRIPTIONS["refit_" + stack], "default": DEFAULT_DESCRIPTIONS[stack],
                               "rounds": []}
        try:
            refit_sync.setup()
            for r in range(self.args.warmup + self.args.rounds):
                self.trainer.step(r + 1)
                order = [("refit", refit_sync.sync), ("default", default_sync)]
                if r % 2:
                    order.reverse()
                row: Dict[str, Any] = {"warmup": r < self.args.warmup}
                for label, sync in order:
                    row[label] = self.timed_and_checked(sync)
                row["ceiling_s"] = self.ceiling()
                out["rounds"].append(row)
        except Exception as e:  # noqa: BLE001 (recorded; the other stacks still run)
            out["error"] = f"{type(e).__name__}: {e}"
            out["traceback"] = traceback.format_exc()
        finally:
            try:
                refit_sync.close()
            except Exception as e:  # noqa: BLE001
                out.setdefault("error", f"teardown: {type(e).__name__}: {e}")
        out.update(summarize(out["rounds"]))
        out["passed"] = "error" not in out and bool(out["rounds"]) and all(
            row[k]["bytes_equal"] and row[k]["tokens_equal"] for row in out["rounds"] for k in ("refit", "default"))
        return out

    def timed_and_checked(self, sync: Callable[[], Any]) -> Dict[str, Any]:
        poison_(self.engine_buffers.values())
        synchronize(self.device)
        t0 = time.perf_counter()
        detail = sync()
        seconds = time.perf_counter() - t0
        synchronize(self.device)
        bad = byte_mismatches(self.params, self.engine_views)
        tokens_engine = self.engine.call("greedy", ids=self.prompt, n=self.args.gen_tokens)
        tokens_trainer = self.trainer.greedy(self.prompt, self.args.gen_tokens)
        return {"seconds": seconds, "bytes_equal": not bad, "byte_mismatches": bad[:10],
                "tokens_equal": tokens_engine == tokens_trainer, "tokens_engine": tokens_engine,
                "tokens_trainer": tokens_trainer, "detail": detail}

    def ceiling(self) -> float:
        """One device-to-device copy of the sync's bytes between two preallocated buffers."""
        n = self.trainer.nbytes()
        if not hasattr(self, "_ceiling_bufs"):
            self._ceiling_bufs = (torch.empty(n, dtype=torch.uint8, device=self.device),
                                  torch.empty(n, dtype=torch.uint8, device=self.device))
            self._ceiling_bufs[1].copy_(self._ceiling_bufs[0])  # first touch outside the timing
        dst, src = self._ceiling_bufs
        synchronize(self.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(self.device)
        return time.perf_counter() - t0

    # ---- the default paths, trainer side (the engine side runs in the engine process) ----
    def sglang_default(self) -> Dict[str, Any]:
        request = sglang_tensor_request(self.trainer.stream())
        n = self.engine.call("sglang_update_weights_from_tensor", request=request)
        return {"tensors": n, "request_bytes": sum(len(r) for r in request)}

    def verl_default(self) -> Dict[str, Any]:
        self.engine.start("verl_update_weights_from_ipc")
        with self.engine.reply_even_if_this_fails():
            buckets = verl_ipc_send(self.trainer.stream(), self.engine.data, self.device,
                                    int(self.args.verl_bucket_mb * (1 << 20)), self.spec.dtype, self.timeout)
        return {"tensors": self.engine.result(), "buckets": buckets}

    def nemo_default(self) -> Dict[str, Any]:
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            buffer_bytes = int(free * self.args.nemo_buffer_ratio)
        else:
            buffer_bytes = int(self.args.nemo_host_buffer_mb * (1 << 20))
        self.engine.start("nemo_update_weights_via_ipc_zmq")
        with self.engine.reply_even_if_this_fails():
            groups = nemo_ipc_send(self.trainer.stream(), self.engine.data, self.device, buffer_bytes, self.timeout)
        return {"tensors": self.engine.result(), "groups": groups, "buffer_bytes": buffer_bytes}


DEFAULT_DESCRIPTIONS = {
    "sglang": "SGLang update_weights_from_tensor: one CUDA IPC handle per tensor (ForkingPickler), the list "
              "serialized and sent, every handle opened in the engine, model.load_weights",
    "verl": "verl's colocated vLLM sync: 2048 MB CUDA IPC bucket, metadata per bucket over a socket "
            "(ZMQ REQ/REP there), engine clones each tensor then model.load_weights; gc/empty_cache after",
    "nemo_rl": "NeMo-RL refit_policy_generation, colocated vLLM: two ping-pong buffers (0.3 x free memory), "
               "one CUDA IPC handle per group over a socket (ZMQ there), engine load_weights from views, "
               "process_weights_after_loading at COMPLETE; gc/empty_cache after",
    "refit_sglang": "refit.integrations.sglang: SGLangSession.update() (pause, begin, refit round, end with "
                    "post_load_weights, weight version, continue) over the SGLang stand-in's HTTP routes",
    "refit_verl": "refit.integrations.verl: RefitCheckpointEngine, build_process_group + send_weights (stage "
                  "the per-tensor stream, one refit round) with receive_weights on the rollout, finalize",
    "refit_nemo_rl": "refit.integrations.nemo_rl: RefitCheckpointEngine send_weights (stage the stream, one "
                     "refit round) with receive_weight_batches on the generation side",
}


class SGLangRefit:
    def __init__(self, bench: Bench, stack: str) -> None:
        self.bench, self.group = bench, "bench-" + stack
        self.worker: Any = None
        self.session: Any = None

    def setup(self) -> None:
        import refit
        from refit.integrations.sglang import SGLangSession
        from refit.layouts import dtensor
        b = self.bench
        daemon = b.cluster.daemons[0].worker_address
        url = b.engine.call("sglang_setup", daemon=daemon, group=self.group)
        params = b.params
        layout = dtensor.trainer_worker(params, rank=0, node=0)
        self.worker = refit.Worker(daemon, self.group, "trainer", layout, params)
        self.session = SGLangSession(url, b.cluster.control, group=self.group, timeout_s=b.timeout)

    def sync(self) -> Dict[str, Any]:
        version = self.session.update()
        return {"version": version, "engine_serving": self.bench.engine.call("sglang_generate_check")}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.worker is not None:
            self.worker.close()
        self.bench.engine.call("teardown")


class VerlRefit:
    """verl's CheckpointEngineManager.update_weights for a non-naive backend, its Ray calls made
    across the two processes: build_process_group (prepare, build_topology, init_process_group
    on both sides), trainer send_weights with rollout receive_weights, finalize on both sides.
    (The manager's abort_all_requests/resume_all_requests act on a rollout server, none here.)"""

    def __init__(self, bench: Bench, stack: str) -> None:
        self.bench, self.stack, self.group = bench, stack, "bench-" + stack
        self.engine: Any = None

    def setup(self) -> None:
        b = self.bench
        daemon = b.cluster.daemons[0].worker_address
        b.engine.call("vllm_idle_setup", daemon=daemon, group=self.group, stack=self.stack, control=b.cluster.control)
        self.engine = make_checkpoint_engine(self.stack, side="trainer", control=b.cluster.control, daemon=daemon,
                                             group=self.group, timeout=b.timeout)

    def sync(self) -> Dict[str, Any]:
        b = self.bench
        meta = [self.engine.prepare(), b.engine.call("verl_build_process_group")]
        trainer_kwargs, _ = type(self.engine).build_topology(1, 1, meta)
        self.engine.init_process_group(**{k: v[0] for k, v in trainer_kwargs.items()})
        b.engine.start("verl_receive_weights")
        t0 = time.perf_counter()
        asyncio.run(self.engine.send_weights(b.trainer.stream()))
        sent = time.perf_counter() - t0
        received = b.engine.result()
        self.engine.finalize()
        b.engine.call("verl_finalize")
        return {"send_weights_s": sent, "rollout_yielded": received, "version": self.engine.committed_version}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.bench.engine.call("teardown")


class NemoRefit(VerlRefit):
    """NeMo-RL's checkpoint-engine synchronizer: engines made once (init_policy_process_group /
    init_rollout_process_group), then per refit send_weights with receive_weight_batches."""

    def setup(self) -> None:
        super().setup()
        self.engine.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1,
                                              metadata=[self.engine.prepare()])

    def sync(self) -> Dict[str, Any]:
        b = self.bench
        b.engine.start("nemo_receive_weight_batches")
        t0 = time.perf_counter()
        asyncio.run(self.engine.send_weights(b.trainer.stream()))
        sent = time.perf_counter() - t0
        received = b.engine.result()
        return {"send_weights_s": sent, "rollout_yielded": received, "version": self.engine.committed_version}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.finalize()
        self.bench.engine.call("teardown")


def _stats(values: List[float]) -> Dict[str, float]:
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over the measured (non-warm-up) rounds."""
    measured = [r for r in rounds if not r["warmup"] and "refit" in r and "default" in r]
    refit_s = [r["refit"]["seconds"] for r in measured]
    default_s = [r["default"]["seconds"] for r in measured]
    ceiling_s = [r["ceiling_s"] for r in measured if "ceiling_s" in r]
    out: Dict[str, Any] = {"refit_s": _stats(refit_s), "default_s": _stats(default_s), "ceiling_s": _stats(ceiling_s)}
    if refit_s and default_s:
        out["default_over_refit"] = statistics.median(default_s) / statistics.median(refit_s)
    if refit_s and ceiling_s:
        out["refit_over_ceiling"] = statistics.median(refit_s) / statistics.median(ceiling_s)
    return out


def write_json(path: str, result: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--model", default="qwen2-0.6b", help=f"one of {', '.join(sorted(MODELS))}, or tiny (CPU checks)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--stacks", default=",".join(STACKS), help="comma-separated subset of " + ",".join(STACKS))
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per stack")
    ap.add_argument("--warmup", type=int, default=1, help="rounds per stack before the measured ones")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=120.0, help="deadline of every wait, seconds")
    ap.add_argument("--verl-bucket-mb", type=float, default=2048, help="verl's update_weights_bucket_megabytes")
    ap.add_argument("--nemo-buffer-ratio", type=float, default=0.3, help="NeMo-RL's NRL_REFIT_BUFFER_MEMORY_RATIO")
    ap.add_argument("--nemo-host-buffer-mb", type=float, default=64, help="NeMo-RL's buffer on the CPU (checks only)")
    ap.add_argument("--refitd-flag", action="append", default=[], help="extra refitd flag (repeatable)")
    args = ap.parse_args()
    args.stacks = [s for s in args.stacks.split(",") if s]
    unknown = [s for s in args.stacks if s not in STACKS]
    if unknown or not args.stacks:
        ap.error(f"--stacks: unknown {unknown or 'empty'}; choose from {', '.join(STACKS)}")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu --model tiny for the CPU checks)")
    try:
        result = Bench(args).run()
    except Exception as e:  # noqa: BLE001 (the JSON says what failed)
        result = {"passed": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    write_json(args.out, result)
    brief = {k: v for k, v in result.items() if k != "stacks"}
    brief["stacks"] = {s: {k: v for k, v in r.items() if k not in ("rounds", "traceback")}
                       for s, r in result.get("stacks", {}).items()}
    print(json.dumps(brief, indent=2, default=str))
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
