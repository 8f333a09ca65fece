#!/usr/bin/env python3
"""The trainer and engine processes of the model tests. Each registers its live parameters with
its node's refitd through refit.Worker and then answers one JSON command a line on stdin with one
JSON line on stdout (logs go to stderr).

    procs.py engine  --daemon unix:... --config cfg.json --spec spec.json --node 1 --device cpu \
        [--fp8-block 32x48 [--fp8-storage uint8|float8]]
    procs.py trainer --daemon unix:... --config cfg.json --impl twin|hf [--fsdp2] --device cuda

Engine (refmodel.RefModel, vLLM's parameters; layout from refit.layouts.vllm.engine_worker):
on_prepare stops decoding (waits for a forward in flight, then holds every new one) or refuses
a version listed by ``refuse``; on_commit resumes; on_abort after a PREPARE it accepted marks the
weights invalid (no version served until the next commit); an abort of a round it refused leaves
the weights, untouched, serving the previous version.
Commands: eval (logits of the prompts in both modes, 32 greedy tokens, the weights in checkpoint
names, saved to a file), decode_bg / join_bg (a decode running while a round is requested),
refuse, quit.

Trainer (transformers' model with FSDP2 on CUDA, or refmodel.Twin in shared memory on the CPU;
layout from refit.layouts.dtensor.trainer_worker, blocking worker): step (AdamW steps on random
tokens), serve (takes part in one round), eval (full_tensor() of every parameter, logits and
greedy tokens of transformers' model, and its fp32 twin's logits, saved to a file), baseline
(full_tensor() per parameter copied into an engine's fused parameters in this process), quit.
"""
import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import refmodel  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def greedy(forward, prompts, steps):
    """Full recompute each step (no KV cache) on both sides: the same shapes, the same GEMMs."""
    ids = prompts
    for _ in range(steps):
        nxt = forward(ids)[:, -1, :].argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, prompts.shape[1]:]


def serve_commands(handlers):
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        try:
            reply = handlers[cmd["cmd"]](cmd)
        except Exception as e:  # reported to the driver, which fails the case with it
            import traceback
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
        if cmd["cmd"] == "quit":
            return


# ------------------------------------------------------------------------------------------------

def transformers_view(cfg, engine_model, dtype, device, spec):
    """transformers' own causal LM for ``cfg`` computing on ``engine_model``'s parameters
    (``bind_to_engine``): what refit writes into the engine is what this model computes with, in
    transformers' arithmetic."""
    import transformers
    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager",
                                                              experts_implementation="eager")
    except (TypeError, ValueError):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    inv = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    model = model.to(dtype).to(device)
    for n, b in inv.items():  # RoPE's inv_freq stays fp32, as in the trainer (procs.Trainer)
        owner = model.get_submodule(n.rsplit(".", 1)[0])
        owner.register_buffer("inv_freq", b.to(device), persistent=False)
        if hasattr(owner, "original_inv_freq"):
            owner.original_inv_freq = owner.inv_freq
    return bind_to_engine(model, engine_model, spec)


def bind_to_engine(model, engine_model, spec):
    """``model`` (transformers' module names) with every parameter replaced by a view into
    ``engine_model``'s vLLM-convention parameters, by checkpoint name (RefModel.checkpoint_views).
    transformers 5's fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]) are the engine's ``w13_weight`` / ``w2_weight`` themselves (gate rows then up rows,
    per expert); a tied head is the embedding's view."""
    views = engine_model.checkpoint_views()
    for name, p in list(model.named_parameters()):
        owner_name, leaf = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            target = getattr(engine_model.get_submodule(owner_name), "w13_weight" if leaf == "gate_up_proj"
                             else "w2_weight")
        elif name == "lm_head.weight" and spec.tied:
            continue
        elif name in views:
            target = views[name]
        else:
            raise RuntimeError(f"transformers' {name} has no counterpart in the engine")
        if name.endswith("e_score_correction_bias") and target.dtype != p.dtype:
            continue  # vLLM's fp32 copy of a bias no gradient reaches: the model keeps its own
        if tuple(target.shape) != tuple(p.shape) or target.dtype != p.dtype:
            raise RuntimeError(f"transformers' {name} {tuple(p.shape)} {p.dtype} vs the engine's "
                               f"{tuple(target.shape)} {target.dtype}")
        owner._parameters[leaf] = nn.Parameter(target, requires_grad=False)
    if spec.tied:  # the head was the old embedding Parameter object: make it the new one
        model.lm_head._parameters["weight"] = model.model.embed_tokens.weight
    model.eval()
    return model


class Engine:
    def __init__(self, args):
        import refit
        from refit.layouts import vllm
        self.args = args
        cfg = json.load(open(args.config))
        self.spec = refmodel.ModelSpec(cfg, **json.load(open(args.spec)))
        self.device = torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        if args.fp8_block:  # block fp8 linear weights (fp8ref.Fp8RefModel), quantized by the daemons
            import fp8ref
            block = [int(x) for x in args.fp8_block.split("x")]
            self.model = fp8ref.Fp8RefModel(self.spec, dtype=dtype, device=self.device, block=block,
                                            storage=args.fp8_storage)
            cfg = dict(cfg, quantization_config={"quant_method": "fp8", "weight_block_size": block})
            if self.device.type == "cpu":
                fp8ref.share_module_(self.model)
        else:
            self.model = refmodel.RefModel(self.spec, dtype=dtype, device=self.device)
            if self.device.type == "cpu":
                refit.share_module_(self.model)
        self.cv = threading.Condition()
        self.paused = False
        self.busy = 0
        self.serving = 0      # the version the weights hold (0: none, or possibly partial)
        self.refuse = set()
        self.events = []
        self.bg = None
        # The harness names tensors as its trainer does: transformers 5 (and refmodel.Twin) call
        # Mixtral's MoE block "mlp" and split its fused experts into gate_proj/up_proj/down_proj
        # (refmodel.to_checkpoint_names), where the checkpoint and vLLM's loader say
        # block_sparse_moe.experts.<e>.w1/w3/w2: the engine's layout follows the trainer's names.
        naming = {"expert_modules": dict(vllm.VLLM_EXPERT_MODULES), "sharding": dict(vllm.VLLM_SHARDING)} \
            if cfg.get("model_type") == "mixtral" else {}
        ecfg = vllm.EngineConfig.from_hf_config(cfg, **naming)
        # A router bias the trainer holds as a module buffer is not refit (nothing sends it): the
        # engine keeps its own, zero like the trainer's.
        skip = None if self.spec.router_bias_in_trainer else (lambda n: n.endswith("e_score_correction_bias"))
        params = {n: p for n, p in self.model.named_parameters() if skip is None or not skip(n)}
        described = self.model.layout_params() if args.fp8_block else params  # uint8 codes: "fp8_e4m3"
        if args.fp8_block and skip is not None:
            described = {n: p for n, p in described.items() if not skip(n)}
        self.layout = vllm.engine_worker(described, ecfg, node=args.node, gpu=args.gpu, model=args.group)
        self.hf_model = None
        if args.impl == "hf" and not args.fp8_block:
            self.hf_model = transformers_view(cfg, self.model, dtype, self.device, self.spec)
        self.reference = None  # a second engine loaded the ordinary way (load_weights), built on use
        self.worker = refit.Worker(args.daemon, args.group, "inference", self.layout, params,
                                   name=self.layout["workers"][0]["name"],
                                   on_prepare=self.on_prepare, on_commit=self.on_commit,
                                   on_abort=self.on_abort)
        log(f"engine registered {self.worker.worker_id}: {len(params)} parameters")

    # callbacks (the worker's session thread)
    def on_prepare(self, version):
        if version in self.refuse:
            self.events.append(("refused", version))
            raise RuntimeError(f"engine refuses version {version} (test)")
        t = time.monotonic()
        with self.cv:
            self.paused = True
            while self.busy:
                self.cv.wait()
        self.events.append(("prepared", version, time.monotonic() - t))

    def on_commit(self, version):
        with self.cv:
            self.serving = version
            self.paused = False
            self.cv.notify_all()
        self.events.append(("committed", version))

    def on_abort(self, reason):
        with self.cv:
            if self.paused:       # it accepted the round: the weights may be partial
                self.serving = 0
            self.paused = False
            self.cv.notify_all()
        self.events.append(("aborted", reason))

    def reading(self):
        engine = self

        class Gate:
            def __enter__(self):
                with engine.cv:
                    while engine.paused:
                        engine.cv.wait()
                    engine.busy += 1
                    return engine.serving

            def __exit__(self, *exc):
                with engine.cv:
                    engine.busy -= 1
                    engine.cv.notify_all()
        return Gate()

    def _evaluate(self, cmd, started=None):
        prompts = torch.tensor(cmd["prompts"], dtype=torch.long, device=self.device)
        with self.reading() as version:
            if started is not None:
                started.set()
            if version == 0:
                return {"version": 0, "worker_version": self.worker.version, "served": False}
            res = {}
            for mode, forward in self.forwards(self.model, self.hf_model).items():
                res[f"logits_{mode}"] = forward(prompts).float().cpu()
                res[f"tokens_{mode}"] = greedy(forward, prompts, cmd["steps"]).cpu()
            if cmd.get("weights", True):
                res["weights"] = {k: v.detach().cpu().clone() for k, v in self.model.checkpoint_views().items()}
            if cmd.get("reference"):
                res.update(self._reference_engine(cmd))
            sync(self.device)
            after = self.serving
        torch.save(res, cmd["path"])
        return {"version": version, "version_after": after, "worker_version": self.worker.version,
                "served": True, "path": cmd["path"]}

    def forwards(self, model, hf_model):
        """{mode: ids -> logits}: "vllm" (RefModel's fused GEMMs), "hf" (transformers' own modules
        on views of the same parameters, where the engine runs with --impl hf; else RefModel's
        reproduction of transformers' arithmetic) and, beside transformers' own, "refhf" (that
        reproduction), so that a reproduction differing from transformers shows."""
        out = {"vllm": lambda x: model(x, mode="vllm")}
        if hf_model is not None:
            vocab = self.spec.vocab
            out["hf"] = lambda x: hf_model(input_ids=x, use_cache=False).logits[..., :vocab]
            out["refhf"] = lambda x: model(x, mode="hf")
        else:
            out["hf"] = lambda x: model(x, mode="hf")
        return out

    def _reference_engine(self, cmd):
        """The same engine code with the trainer's weights loaded the ordinary way (checkpoint
        tensor by checkpoint tensor, as vLLM's load_weights), not through refit: its logits and
        tokens, every mode. Bit-equal weights must give bit-equal results."""
        weights = torch.load(cmd["reference"])["weights"]
        if self.reference is None:
            self.reference = refmodel.RefModel(self.spec, dtype=self.model.model.norm.weight.dtype,
                                               device=self.device)
            self.reference_hf = None
            if self.hf_model is not None:
                self.reference_hf = transformers_view(json.load(open(self.args.config)), self.reference,
                                                      self.reference.model.norm.weight.dtype, self.device,
                                                      self.spec)
        views = self.reference.checkpoint_views()
        missing = sorted(set(views) - set(weights))
        if missing:
            raise RuntimeError(f"reference engine: the trainer has no {missing[:4]}")
        for name, view in views.items():
            self.reference.load_checkpoint_tensor(name, weights[name].to(self.device), views)
        prompts = torch.tensor(cmd["prompts"], dtype=torch.long, device=self.device)
        out = {}
        for mode, forward in self.forwards(self.reference, self.reference_hf).items():
            out[f"reference_logits_{mode}"] = forward(prompts).float().cpu()
            out[f"reference_tokens_{mode}"] = greedy(forward, prompts, cmd["steps"]).cpu()
        return out

    def eval(self, cmd):
        return self._evaluate(cmd)

    def decode_bg(self, cmd):
        started = threading.Event()
        out = {}
        self.bg = threading.Thread(target=lambda: out.update(self._evaluate(cmd, started)))
        self.bg.out = out
        self.bg.start()
        started.wait(30)
        return {"started": started.is_set()}

    def join_bg(self, cmd):
        self.bg.join(cmd.get("timeout", 60))
        return dict(self.bg.out, alive=self.bg.is_alive())

    def refuse_cmd(self, cmd):
        self.refuse.add(int(cmd["version"]))
        return {"ok": True}

    def status(self, cmd):
        return {"serving": self.serving, "worker_version": self.worker.version,
                "events": [list(map(str, e)) for e in self.events[-8:]]}

    def quit(self, cmd):
        self.worker.close()
        return {"ok": True}

    def run(self):
        print(json.dumps({"ready": True, "worker": self.worker.name,
                          "bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}),
              flush=True)
        serve_commands({"eval": self.eval, "decode_bg": self.decode_bg, "join_bg": self.join_bg,
                        "refuse": self.refuse_cmd, "status": self.status, "quit": self.quit})


# ------------------------------------------------------------------------------------------------

def _spec_overrides(names, cfg_spec):
    """What the live trainer model says about itself (biases, norms, experts' naming)."""
    return {
        "qkv_bias": any(n.endswith("self_attn.q_proj.bias") for n in names),
        "o_bias": any(n.endswith("self_attn.o_proj.bias") for n in names),
        "qk_norm": any(n.endswith("self_attn.q_norm.weight") for n in names),
        "experts_style": "fused" if any(n.endswith("experts.gate_up_proj") for n in names) else "per_expert",
        "router_bias_in_trainer": any(n.endswith("gate.e_score_correction_bias") for n in names),
    }


def router_weights_fp32(model, dtype, device):
    """Whether the model's MoE router hands the experts fp32 top-k weights: asked of the live
    module (transformers 5's routers return (logits, weights, indices); Mixtral's keeps the
    weights fp32, Qwen-MoE's casts them; transformers 4's gate is a Linear and its block casts).
    None for a dense model or a router of another form (DeepSeek's)."""
    for name, module in model.named_modules():
        if not name.endswith("mlp.gate") and not name.endswith("block_sparse_moe.gate"):
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            continue
        x = torch.randn(3, weight.shape[1], dtype=dtype, device=device)
        with torch.no_grad():
            out = module(x)
        if isinstance(out, torch.Tensor):
            return False
        if isinstance(out, tuple) and len(out) == 3:
            return out[1].dtype == torch.float32
        return None
    return None


class Trainer:
    def __init__(self, args):
        import refit
        from refit.layouts import dtensor
        self.args = args
        cfg = json.load(open(args.config))
        self.cfg = cfg
        self.device = torch.device(args.device)
        self.rank, self.world = 0, 1
        self.info = {}
        if args.impl == "twin":
            spec = refmodel.ModelSpec(cfg, experts_style=args.experts_style)
            self.model = refmodel.Twin(spec, dtype=getattr(torch, args.dtype), seed=args.seed)
            self.fp32 = None  # fp32 on the CPU: the reference below is fp64
            self.ref = refmodel.Twin(spec, dtype=torch.float64, seed=args.seed)
            self.rope_theta = spec.rope_theta
            refit.share_module_(self.model)
            self.forward = lambda ids: self.model(ids)
            self.ref_forward = lambda ids: self.ref(ids)
        else:
            self._build_hf(cfg)
        names = [n for n, _ in self.model.named_parameters()]
        self.spec_overrides = _spec_overrides(names, cfg)
        self.spec_overrides["rope_theta"] = self.rope_theta
        if self.info.get("router_weights_fp32") is not None:
            self.spec_overrides["router_weights_fp32"] = self.info["router_weights_fp32"]
        self.spec = refmodel.ModelSpec(cfg, **self.spec_overrides)
        for n, p in self.model.named_parameters():  # transformers 5's fused experts: [E, 2I, H], [E, H, I]
            if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"):
                s = self.spec
                want = (s.experts, 2 * s.moe_intermediate, s.hidden) if n.endswith("gate_up_proj") \
                    else (s.experts, s.hidden, s.moe_intermediate)
                if tuple(p.shape) != want:
                    raise RuntimeError(f"{n}: shape {tuple(p.shape)}, expected {want} (a transposed "
                                       "layout cannot be described by boxes of checkpoint tensors)")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        params = dict(self.model.named_parameters())
        layout = dtensor.trainer_worker(params, rank=self.rank, node=args.node,
                                        gpu=args.gpu if args.gpu >= 0 else self.rank, model=args.group)
        if self.spec.experts_style == "fused":
            layout = refmodel.fused_experts_to_checkpoint(layout)
        self.layout = layout
        self.worker = refit.Worker(args.daemon, args.group, "trainer", layout, dtensor.local_buffers(params),
                                   name=layout["workers"][0]["name"], blocking=True)
        self.gen = torch.Generator(device="cpu").manual_seed(1234 + self.rank)
        log(f"trainer rank {self.rank}/{self.world} registered {self.worker.worker_id}: {len(params)} parameters")

    def _build_hf(self, cfg):
        import torch.distributed as dist
        import transformers
        args = self.args
        if args.fsdp2:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            if self.device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)))
                self.device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(args.seed)
        # The trainer holds the weights unquantized: an fp8 checkpoint's quantization_config is the
        # engine's (driver.py gives the engine --fp8-block from it).
        hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
        kw = {"attn_implementation": "eager"}
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, experts_implementation="eager", **kw)
            self.info["experts_implementation"] = "eager (asked)"
        except (TypeError, ValueError) as e:
            log("from_config without experts_implementation:", e)
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, **kw)
        self.info["transformers"] = transformers.__version__
        self.info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        self.info["experts_implementation_seen"] = getattr(model.config, "_experts_implementation", None)
        self.info["class"] = type(model).__name__
        rope = getattr(model.config, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta") if isinstance(rope, dict) and rope.get("rope_theta")
                                else getattr(model.config, "rope_theta", 10000.0))
        inv = refmodel.rope_inv_freq(refmodel.ModelSpec(cfg, rope_theta=self.rope_theta))
        live = [b for n, b in model.named_buffers() if n.endswith("inv_freq")]
        self.info["inv_freq_matches"] = bool(live) and all(refmodel.bits_equal(inv, b.float().cpu()) for b in live)
        import copy
        # RoPE's inv_freq stays fp32 (as transformers builds it; vLLM computes its cos/sin cache in
        # fp32 too): a model.to(bf16) would round it, so it is put back after the casts.
        saved = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}

        def restore(m):
            for n, b in saved.items():
                owner = m.get_submodule(n.rsplit(".", 1)[0]) if "." in n else m
                owner.register_buffer("inv_freq", b.clone().to(self.device), persistent=False)
                if hasattr(owner, "original_inv_freq"):
                    owner.original_inv_freq = owner.inv_freq
        ref = copy.deepcopy(model).float().to(self.device)   # fp32, unsharded: the rounding reference
        restore(ref)
        ref.eval()
        model = model.to(getattr(torch, args.dtype)).to(self.device)
        restore(model)
        self.info["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        self.info["router_weights_fp32"] = router_weights_fp32(model, getattr(torch, args.dtype), self.device)
        if args.fsdp2:
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                from torch.distributed._composable.fsdp import fully_shard
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(self.device.type, (self.world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model, self.ref = model, ref
        self.forward = lambda ids: self.model(input_ids=ids, use_cache=False).logits
        self.ref_forward = lambda ids: self.ref(input_ids=ids, use_cache=False).logits

    def full_state(self):
        out = {}
        for n, p in self.model.named_parameters():
            out[n] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        return out

    def step(self, cmd):
        vocab = self.spec.vocab
        t_fb = t_opt = 0.0
        self.model.train()
        for _ in range(cmd.get("n", 1)):
            ids = torch.randint(0, vocab, (cmd.get("batch", 4), cmd.get("seq", 64)), generator=self.gen).to(self.device)
            sync(self.device)
            t0 = time.perf_counter()
            logits = self.forward(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1))
            loss.backward()
            sync(self.device)
            t1 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            sync(self.device)
            t2 = time.perf_counter()
            t_fb += t1 - t0
            t_opt += t2 - t1
        return {"loss": float(loss), "fwd_bwd_s": t_fb, "opt_step_s": t_opt}

    def serve(self, cmd):
        r = self.worker.serve(timeout=cmd.get("timeout", 60))
        if r is None:
            return {"round": None}
        return {"round": r.round_id, "version": r.version, "committed": r.committed, "reason": r.reason}

    @torch.no_grad()
    def eval(self, cmd):
        self.model.eval()
        prompts = torch.tensor(cmd["prompts"], dtype=torch.long, device=self.device)
        full = self.full_state()
        res = {}
        res["logits"] = self.forward(prompts).float().cpu()
        res["tokens"] = greedy(self.forward, prompts, cmd["steps"]).cpu()
        # The same weights one precision up: the rounding error of this model itself.
        ref_params = dict(self.ref.named_parameters())
        for n, t in full.items():
            ref_params[n].copy_(t.to(ref_params[n].dtype))
        res["logits_ref"] = self.ref_forward(prompts).double().cpu()
        if self.rank == 0:
            res["weights"] = {k: v.detach().cpu().clone()
                              for k, v in refmodel.to_checkpoint_names(full, self.spec).items()}
            torch.save(res, cmd["path"])
        sync(self.device)
        return {"path": cmd["path"], "rank": self.rank}

    @torch.no_grad()
    def baseline(self, cmd):
        """What users do today, in this process on this GPU: full_tensor() per parameter, then a
        copy into an engine's fused parameters (vLLM's load_weights), timed per round."""
        if not hasattr(self, "base_engine"):
            self.base_engine = refmodel.RefModel(self.spec, dtype=next(self.model.parameters()).dtype,
                                                 device=self.device)
            self.base_views = self.base_engine.checkpoint_views()
        times = []
        for _ in range(cmd.get("repeat", 5)):
            sync(self.device)
            t0 = time.perf_counter()
            for n, p in self.model.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                for k, v in refmodel.to_checkpoint_names({n: full}, self.spec).items():
                    self.base_views[k].copy_(v)
            sync(self.device)
            times.append(time.perf_counter() - t0)
        ok = True
        if self.rank == 0 and cmd.get("check", True):
            full = refmodel.to_checkpoint_names(self.full_state(), self.spec)
            ok = all(refmodel.bits_equal(self.base_views[k], v) for k, v in full.items())
        return {"seconds": times, "ok": ok}

    def quit(self, cmd):
        self.worker.close()
        return {"ok": True}

    def run(self):
        print(json.dumps({"ready": True, "worker": self.worker.name, "rank": self.rank, "world": self.world,
                          "spec": self.spec_overrides, "info": self.info,
                          "bytes": sum(t.numel() * t.element_size() for t in self.full_state().values())}),
              flush=True)
        serve_commands({"step": self.step, "serve": self.serve, "eval": self.eval,
                        "baseline": self.baseline, "quit": self.quit})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=["engine", "trainer"])
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--group", default="policy")
    ap.add_argument("--config", required=True)
    ap.add_argument("--spec", help="engine: the trainer's ModelSpec overrides (JSON file)")
    ap.add_argument("--impl", default="twin", choices=["twin", "hf"])
    ap.add_argument("--experts-style", default="per_expert", choices=["per_expert", "fused"])
    ap.add_argument("--fsdp2", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--node", type=int, default=0)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8-block", default="", help="engine: block fp8 linear weights, blocks RxC (e.g. 32x48)")
    ap.add_argument("--fp8-storage", default=None, choices=["uint8", "float8"],
                    help="engine: the codes' torch dtype (default float8_e4m3fn where torch has it)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("REFIT_TORCH_THREADS", "1")))
    (Engine if args.side == "engine" else Trainer)(args).run()


if __name__ == "__main__":
    main()
