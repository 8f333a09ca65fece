"""Driving refit from an RL loop: refit a model group to a new version, watch rounds, read the
cluster's state.

    ctl = refit.Controller("127.0.0.1:7070")     # any daemon: others forward to the coordinator
    stats = ctl.refit("policy", version=step, timeout=60)
    print(stats.seconds, stats.bytes)

Failures raise RefitError, which carries the gRPC code, the phase the round failed in and the
culprit the daemons named (a worker, a node, the coordinator): refitd sends it structured, as a
refit.v1.Culprit in the status details (grpc-status-details-bin, a google.rpc.Status); from a
daemon that sends none, it is read from the reason.
"""
import re

import grpc
from google.protobuf import json_format

from refit import _rpc
from refit.tls import channel as tls_channel
from refit._proto import refit_pb2

ROUND_STATES = {v: k for k, v in refit_pb2.RoundStats.State.items()}


class RefitError(RuntimeError):
    """A failed control call or round: `code` (grpc.StatusCode), `phase` ("PREPARE", "TRANSFER",
    "COMMIT", "INSTALL" or None), `culprit` (e.g. 'worker "policy/engine-1"', 'node 3', or None),
    `reason`; `blamed`: the daemons' refit.v1.Culprit (kind, node, worker_id, address, phase) when
    they sent one, else None."""

    def __init__(self, code, reason, phase=None, culprit=None, blamed=None):
        self.code, self.reason, self.phase, self.culprit = code, reason, phase, culprit
        self.blamed = blamed
        where = f" in {phase}" if phase else ""
        who = f" (culprit: {culprit})" if culprit else ""
        super().__init__(f"{code.name}{where}: {reason}{who}")


_PHASES = ("PREPARE", "TRANSFER", "COMMIT")


def parse_reason(reason):
    """(phase, culprit) named in a round's reason, e.g. 'node 1: worker "policy/e0" did not
    confirm PREPARE of group ...' -> ("PREPARE", 'worker "policy/e0"')."""
    phase = None
    for p in _PHASES:
        if re.search(rf"\b{p}\b", reason):
            phase = p
            break
    m = re.search(r'worker "([^"]+)"', reason)
    if m:
        return phase, f'worker "{m.group(1)}"'
    m = re.search(r"\bnode (\d+)\b", reason)
    return phase, (f"node {m.group(1)}" if m else None)


_CULPRIT_URL = "type.googleapis.com/refit.v1.Culprit"


def culprit_text(c):
    """'worker "group/name"' or 'node N' for a refit.v1.Culprit (None when it names nobody)."""
    if c is None or c.kind == refit_pb2.Culprit.KIND_UNSPECIFIED:
        return None
    if c.kind == refit_pb2.Culprit.WORKER:
        return f'worker "{c.worker_id}"'
    return f"node {c.node}"


def culprit_of(error):
    """The refit.v1.Culprit in a grpc.RpcError's status details, or None."""
    try:
        trailers = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 (not every RpcError is a call)
        return None
    for key, value in trailers:
        if key != "grpc-status-details-bin":
            continue
        status = refit_pb2.RpcStatus()
        try:
            status.ParseFromString(value)
        except Exception:  # noqa: BLE001 (details not ours: ignored)
            return None
        for detail in status.details:
            if detail.type_url == _CULPRIT_URL:
                c = refit_pb2.Culprit()
                c.ParseFromString(detail.value)
                return c
    return None


def error_from(e):
    """A RefitError for a grpc.RpcError: the structured culprit if sent, else the reason's."""
    reason = e.details() or ""
    phase, culprit = parse_reason(reason)
    blamed = culprit_of(e)
    if blamed is not None and blamed.kind != refit_pb2.Culprit.KIND_UNSPECIFIED:
        culprit = culprit_text(blamed)
        phase = blamed.phase or phase
    return RefitError(e.code(), reason, phase, culprit, blamed)


class RoundResult:
    """A round's statistics (refit.v1.RoundStats) with readable fields."""

    def __init__(self, stats):
        self.proto = stats
        self.group, self.round_id, self.version = stats.group, stats.round_id, stats.version
        self.state = ROUND_STATES.get(stats.state, str(stats.state))
        self.reason = stats.reason
        self.culprit = culprit_text(stats.culprit) if stats.HasField("culprit") else None
        self.bytes, self.seconds = stats.bytes, stats.seconds
        self.prepare_seconds = stats.prepare_seconds
        self.transfer_seconds = stats.transfer_seconds
        self.commit_seconds = stats.commit_seconds

    @property
    def committed(self):
        return self.state == "COMMITTED"

    def as_dict(self):
        return json_format.MessageToDict(self.proto, preserving_proto_field_name=True)

    def __repr__(self):
        return (f"RoundResult(group={self.group!r}, round={self.round_id}, version={self.version}, "
                f"{self.state}, {self.bytes} bytes in {self.seconds:.3f} s)")


class Controller:
    def __init__(self, address, timeout=10.0, tls=None):
        """`address`: any refitd's "host:port" (or "unix:PATH"); calls other than refit() end
        within `timeout` seconds. `tls`: refit.TlsFiles of an operator's or viewer's certificate
        (default: $REFIT_TLS_CERT/KEY/CA when set; refit.tls)."""
        self.address, self.timeout = address, timeout
        self._channel = tls_channel(address, tls, options=[("grpc.max_receive_message_length", 256 << 20)])
        self._stub = _rpc.Stub(self._channel, "RefitControl")

    def _call(self, method, request, timeout=None):
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise error_from(e) from None

    @staticmethod
    def _request(group, version):
        if not isinstance(version, int) or not 0 < version < (1 << 63):
            raise RefitError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"version must be an integer in [1, 2^63), not {version!r}")
        return refit_pb2.RefitRequest(group=group, version=version)

    def refit(self, group, version, timeout=120.0):
        """Runs one round of `group` to `version` and waits for its end. Returns a RoundResult
        of a committed round; raises RefitError (phase, culprit) when it aborted or was refused."""
        stats = self._call(self._stub.Refit, self._request(group, version), timeout)
        return RoundResult(stats)

    def start_refit(self, group, version):
        """Starts a round and returns its id at once; watch() reports how it ends."""
        return self._call(self._stub.StartRefit, self._request(group, version)).round_id

    def watch(self, group="", timeout=None):
        """Yields a RoundResult for every round event from now on (PREPARING, TRANSFERRING,
        COMMITTED, ABORTED) of `group` (empty: all). Ends after `timeout` seconds if given."""
        call = self._stub.WatchRounds(refit_pb2.WatchRoundsRequest(group=group), timeout=timeout)
        try:
            for stats in call:
                yield RoundResult(stats)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise RefitError(e.code(), e.details() or "") from None
        finally:
            call.cancel()

    def status(self, timeout=None):
        """The cluster: coordinator, nodes, groups (readiness, versions, plans), as a dict."""
        r = self._call(self._stub.Status, refit_pb2.StatusRequest(), timeout)
        return json_format.MessageToDict(r, preserving_proto_field_name=True)

    def group(self, name, timeout=None):
        for g in self.status(timeout).get("groups", []):
            if g.get("name") == name:
                return g
        return None

    def workers(self, group=""):
        r = self._call(self._stub.ListWorkers, refit_pb2.ListWorkersRequest(group=group))
        return [json_format.MessageToDict(w, preserving_proto_field_name=True) for w in r.workers]

    def plan(self, group):
        r = self._call(self._stub.GetPlan, refit_pb2.GetPlanRequest(group=group))
        return json_format.MessageToDict(r, preserving_proto_field_name=True)

    def wait_ready(self, group, timeout=30.0):
        """Blocks until `group` is ready to refit (both sides complete); returns its status."""
        import time
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:  # each poll within what is left of `timeout`
                g = self.group(group, timeout=max(0.05, min(self.timeout, deadline - time.monotonic())))
            except RefitError as e:
                last = str(e)
                g = None
            if g and g.get("ready"):
                return g
            if g:
                last = g.get("not_ready_reason", "not ready")
            time.sleep(0.1)
        raise TimeoutError(f"group {group!r} not ready after {timeout} s: {last}")

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
