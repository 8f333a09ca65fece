"""Layouts as the Python side holds them: proto3 JSON dicts (as refit-layout writes them) or
refit.v1.Layout messages, and one worker's part of one."""
import json
from typing import Any, Dict, List, Optional, Tuple

from google.protobuf import json_format

from refit._proto import layout_pb2
from refit.errors import InvalidArgument

LayoutLike = Any  # a dict, JSON text, a path to a JSON file, or a refit.v1.Layout


def to_proto(layout: LayoutLike) -> Any:
    """A refit.v1.Layout from a dict, a JSON string, a path to a JSON file or a Layout message."""
    if isinstance(layout, layout_pb2.Layout):
        return layout
    if isinstance(layout, str):
        text = layout
        if not text.lstrip().startswith("{"):
            try:
                with open(layout) as f:
                    text = f.read()
            except OSError as e:
                raise InvalidArgument(f"cannot read the layout file {layout!r}: {e.strerror}") from e
        try:
            layout = json.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"the layout is not JSON: {e}") from e
    if not isinstance(layout, dict):
        raise InvalidArgument(f"a layout is a dict, JSON text, a file or a refit.v1.Layout, not {type(layout).__name__}")
    try:
        return json_format.ParseDict(layout, layout_pb2.Layout())
    except json_format.ParseError as e:
        raise InvalidArgument(f"not a refit layout: {e}") from e


def to_dict(layout: LayoutLike) -> Dict[str, Any]:
    return json_format.MessageToDict(to_proto(layout), preserving_proto_field_name=False)


def one_worker(layout: LayoutLike, name: Optional[str] = None) -> Tuple[Any, List[Any]]:
    """(worker, tensor specs) of the worker `name` (or the only worker) of `layout`: what a worker
    process registers. An unknown name is an InvalidArgument naming the layout's workers."""
    proto = to_proto(layout)
    workers = list(proto.workers)
    if name is None:
        if len(workers) != 1:
            raise InvalidArgument(f"the layout holds {len(workers)} workers "
                                  f"({', '.join(w.name for w in workers[:5])}{'...' if len(workers) > 5 else ''}): "
                                  "say which one this process is (name=...)")
        worker = workers[0]
    else:
        found = [w for w in workers if w.name == name]
        if not found:
            raise InvalidArgument(f"the layout has no worker {name!r} (it has "
                                  f"{', '.join(w.name for w in workers[:8])}{'...' if len(workers) > 8 else ''})")
        worker = found[0]
    used = {p.tensor for b in worker.buffers for p in b.pieces}
    specs = [t for t in proto.tensors if t.name in used]
    missing = used - {t.name for t in specs}
    if missing:
        raise InvalidArgument(f"worker {worker.name!r} names tensors the layout does not declare: "
                              f"{', '.join(sorted(missing)[:5])}")
    return worker, specs



def part_of_model(layout: Any, worker: Any) -> Optional[str]:
    """How `worker` of the refit.v1.Layout `layout` holds only part of the model the layout
    describes ("tensor 'w': 16 of 32 elements"), or None when it holds every tensor whole or
    when its pieces are in the compact form (not counted here)."""
    if worker.buffers_like:
        return None
    held: Dict[str, int] = {}
    whole = set()
    for b in worker.buffers:
        for p in b.pieces:
            if p.tensor_index or p.repeat or p.run_pieces:
                return None
            if not p.HasField("tensor_box"):  # an omitted box: all of it
                whole.add(p.tensor)
                continue
            n = 1
            for s in p.tensor_box.shape:
                n *= s
            held[p.tensor] = held.get(p.tensor, 0) + n
    for t in layout.tensors:
        numel = 1
        for s in t.shape:
            numel *= s
        if t.name not in whole and held.get(t.name, 0) < numel:
            return f"tensor {t.name!r}: {held.get(t.name, 0)} of {numel} elements"
    return None
