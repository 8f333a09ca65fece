"""Comparing layouts: the same tensors, workers, buffers and pieces, whatever the order or spelling.

``normalize_layout`` turns a layout dict into a canonical, hashable form: tensors, workers,
buffers and pieces sorted, every box explicit (an omitted box is the whole tensor or buffer),
pieces of no elements dropped, the ``model`` string ignored. ``diff_layouts`` lists the
differences for people. ``coverage`` forgets buffers and asks only what each worker holds: per
worker and tensor, the union of its tensor boxes (adjacent boxes merged), to compare layouts that
agree on who holds what but fuse it into different buffers (e.g. Megatron's ``linear_qkv`` against
one buffer per tensor).
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Tuple

__all__ = ["normalize_layout", "diff_layouts", "coverage"]

BoxT = Tuple[Tuple[int, ...], Tuple[int, ...]]


def _box(box: Any, whole: List[int]) -> BoxT:
    if not box:
        return (tuple(0 for _ in whole), tuple(int(s) for s in whole))
    origin = tuple(int(o) for o in box.get("origin", []))
    shape = tuple(int(s) for s in box.get("shape", []))
    return origin, shape


def _quant(t: Dict[str, Any]) -> Tuple[Any, ...]:
    """A tensor's quantization, normalised: () when it has none."""
    q = t.get("quantization")
    if not q:
        return ()
    return (q.get("format", ""), tuple(int(x) for x in q.get("block", [])), q.get("scale", ""))


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def normalize_layout(layout: Dict[str, Any]) -> Dict[str, Any]:
    """``{"tensors": {name: (shape, dtype)}, "quantization": {name: (format, block, scale)} (the
    quantized tensors), "workers": {name: (node, gpu, {buffer: (dtype, shape, sorted pieces)})}}``
    with each piece ``(tensor, tensor box, buffer box)``."""
    tensors = {t["name"]: (tuple(int(s) for s in t.get("shape", [])), t["dtype"])
               for t in layout.get("tensors", [])}
    quantization = {t["name"]: _quant(t) for t in layout.get("tensors", []) if _quant(t)}
    workers = {}
    for w in layout.get("workers", []):
        buffers = {}
        for b in w.get("buffers", []):
            shape = [int(s) for s in b.get("shape", [])]
            pieces = []
            for p in b.get("pieces", []):
                tshape = list(tensors.get(p["tensor"], ((), ""))[0])
                tb = _box(p.get("tensorBox"), tshape)
                bb = _box(p.get("bufferBox"), shape)
                if _numel(tb[1]) == 0 and tb[1]:
                    continue
                pieces.append((p["tensor"], tb, bb))
            buffers[b["name"]] = (b["dtype"], tuple(shape), tuple(sorted(pieces)))
        workers[w["name"]] = (int(w.get("node", 0)), int(w.get("gpu", 0)), buffers)
    return {"tensors": tensors, "quantization": quantization, "workers": workers}


def diff_layouts(a: Dict[str, Any], b: Dict[str, Any], limit: int = 20,
                 names: Tuple[str, str] = ("a", "b")) -> List[str]:
    """Human-readable differences between two layouts (at most ``limit``); ``[]`` when equal."""
    na, nb = normalize_layout(a), normalize_layout(b)
    out: List[str] = []

    def say(msg: str) -> bool:
        out.append(msg)
        return len(out) >= limit

    A, B = names
    for t in sorted(set(na["tensors"]) | set(nb["tensors"])):
        ta, tb = na["tensors"].get(t), nb["tensors"].get(t)
        if ta != tb and say(f"tensor {t!r}: {A} {ta} vs {B} {tb}"):
            return out
        qa, qb = na["quantization"].get(t), nb["quantization"].get(t)
        if qa != qb and say(f"tensor {t!r}: quantization {A} {qa} vs {B} {qb}"):
            return out
    for w in sorted(set(na["workers"]) | set(nb["workers"])):
        wa, wb = na["workers"].get(w), nb["workers"].get(w)
        if wa is None or wb is None:
            if say(f"worker {w!r} only in {A if wb is None else B}"):
                return out
            continue
        if wa[:2] != wb[:2] and say(f"worker {w!r}: node/gpu {A} {wa[:2]} vs {B} {wb[:2]}"):
            return out
        for buf in sorted(set(wa[2]) | set(wb[2])):
            ba, bb = wa[2].get(buf), wb[2].get(buf)
            if ba == bb:
                continue
            if ba is None or bb is None:
                if say(f"worker {w!r} buffer {buf!r} only in {A if bb is None else B}"):
                    return out
                continue
            if ba[:2] != bb[:2] and say(f"worker {w!r} buffer {buf!r}: dtype/shape {A} {ba[:2]} "
                                        f"vs {B} {bb[:2]}"):
                return out
            pa, pb = set(ba[2]), set(bb[2])
            for p in sorted(pa - pb):
                if say(f"worker {w!r} buffer {buf!r}: piece {p} only in {A}"):
                    return out
            for p in sorted(pb - pa):
                if say(f"worker {w!r} buffer {buf!r}: piece {p} only in {B}"):
                    return out
    return out


def _merge(boxes: List[BoxT]) -> FrozenSet[BoxT]:
    boxes = [b for b in boxes if _numel(b[1]) > 0 or not b[1]]
    changed = True
    while changed:
        changed = False
        boxes.sort()
        for i in range(len(boxes)):
            for j in range(len(boxes)):
                if i == j:
                    continue
                (oa, sa), (ob, sb) = boxes[i], boxes[j]
                diff = [d for d in range(len(oa)) if oa[d] != ob[d] or sa[d] != sb[d]]
                if len(diff) == 1 and oa[diff[0]] + sa[diff[0]] == ob[diff[0]]:
                    d = diff[0]
                    merged = (oa, sa[:d] + (sa[d] + sb[d],) + sa[d + 1:])
                    boxes = [b for k, b in enumerate(boxes) if k not in (i, j)] + [merged]
                    changed = True
                    break
            if changed:
                break
    return frozenset(boxes)


def coverage(layout: Dict[str, Any]) -> Dict[str, Dict[str, FrozenSet[BoxT]]]:
    """``{worker: {tensor: frozenset of boxes}}``: what each worker holds, buffers forgotten."""
    n = normalize_layout(layout)
    out: Dict[str, Dict[str, FrozenSet[BoxT]]] = {}
    for w, (_, _, buffers) in n["workers"].items():
        per: Dict[str, List[BoxT]] = {}
        for _, _, pieces in buffers.values():
            for tensor, tb, _ in pieces:
                per.setdefault(tensor, []).append(tb)
        out[w] = {t: _merge(boxes) for t, boxes in per.items()}
    return out
