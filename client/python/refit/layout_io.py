"""Layouts as the Python side holds them: proto3 JSON dicts (as refit-layout writes them) or
refit.v1.Layout messages, and one worker's part of one."""
import json

from google.protobuf import json_format

from refit._proto import layout_pb2


def to_proto(layout):
    """A refit.v1.Layout from a dict, a JSON string, a path to a JSON file or a Layout message."""
    if isinstance(layout, layout_pb2.Layout):
        return layout
    if isinstance(layout, str):
        text = layout
        if not text.lstrip().startswith("{"):
            with open(layout) as f:
                text = f.read()
        layout = json.loads(text)
    if not isinstance(layout, dict):
        raise TypeError(f"a layout is a dict, JSON text, a file or a refit.v1.Layout, not {type(layout).__name__}")
    try:
        return json_format.ParseDict(layout, layout_pb2.Layout())
    except json_format.ParseError as e:
        raise ValueError(f"not a refit layout: {e}") from e


def to_dict(layout):
    return json_format.MessageToDict(to_proto(layout), preserving_proto_field_name=False)


def one_worker(layout, name=None):
    """(worker, tensor specs) of the worker `name` (or the only worker) of `layout`: what a worker
    process registers."""
    proto = to_proto(layout)
    workers = list(proto.workers)
    if name is None:
        if len(workers) != 1:
            raise ValueError(f"the layout holds {len(workers)} workers "
                             f"({', '.join(w.name for w in workers[:5])}{'...' if len(workers) > 5 else ''}): "
                             "say which one this process is (name=...)")
        worker = workers[0]
    else:
        found = [w for w in workers if w.name == name]
        if not found:
            raise ValueError(f"the layout has no worker {name!r} (it has "
                             f"{', '.join(w.name for w in workers[:8])}{'...' if len(workers) > 8 else ''})")
        worker = found[0]
    used = {p.tensor for b in worker.buffers for p in b.pieces}
    specs = [t for t in proto.tensors if t.name in used]
    missing = used - {t.name for t in specs}
    if missing:
        raise ValueError(f"worker {worker.name!r} names tensors the layout does not declare: "
                         f"{', '.join(sorted(missing)[:5])}")
    return worker, specs
