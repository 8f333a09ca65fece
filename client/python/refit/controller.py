"""Driving refit from an RL loop: refit a model group to a new version, watch rounds, read the
cluster's state.

    ctl = refit.Controller("127.0.0.1:7070")     # any daemon: others forward to the coordinator
    stats = ctl.refit("policy", version=step, timeout=60)
    print(stats.seconds, stats.bytes)

Failures raise RefitError, which carries the gRPC code, the phase the round failed in and the
culprit the daemons named (a worker, a node, the coordinator): refitd sends it structured, as a
refit.v1.Culprit in the status details (grpc-status-details-bin, a google.rpc.Status); from a
daemon that sends none, it is read from the reason. refit.aio.Controller is the same for asyncio.
"""
import re
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import grpc
from google.protobuf import json_format

from refit import _rpc
from refit._proto import refit_pb2
from refit.errors import InvalidArgument, InvalidRequest, RefitError, RefitTimeout
from refit.tls import TlsFiles
from refit.tls import channel as tls_channel

__all__ = ["Controller", "RefitError", "RoundResult", "RoundWatch"]

ROUND_STATES: Dict[int, str] = {v: k for k, v in refit_pb2.RoundStats.State.items()}

_PHASES = ("PREPARE", "TRANSFER", "COMMIT")


def parse_reason(reason: str) -> Tuple[Optional[str], Optional[str]]:
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


def culprit_text(c: Any) -> Optional[str]:
    """'worker "group/name"' or 'node N' for a refit.v1.Culprit (None when it names nobody)."""
    if c is None or c.kind == refit_pb2.Culprit.KIND_UNSPECIFIED:
        return None
    if c.kind == refit_pb2.Culprit.WORKER:
        return f'worker "{c.worker_id}"'
    return f"node {c.node}"


def culprit_of(error: grpc.RpcError) -> Any:
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


def error_from(e: grpc.RpcError) -> RefitError:
    """A RefitError for a grpc.RpcError: the structured culprit if sent, else the reason's."""
    reason = e.details() or ""
    phase, culprit = parse_reason(reason)
    blamed = culprit_of(e)
    if blamed is not None and blamed.kind != refit_pb2.Culprit.KIND_UNSPECIFIED:
        culprit = culprit_text(blamed)
        phase = blamed.phase or phase
    return RefitError(e.code(), reason, phase, culprit, blamed)


# ----------------------------------------------------------------------------------------------
# Why a group is not ready, by rank. The daemon names an inference replica's missing ranks, and
# the trainer side's when its trainers declare their rank and world size (GroupStatus.trainer_ranks).
# Trainers that declare none show up in the daemon's words only as a destination piece with no
# source: for them the missing rank is guessed from the registered workers' names. These functions
# name the missing rank on either side from the group's status and its registered workers.

NO_SOURCE = "have no source in the source layout"
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def missing_trainer(names: Sequence[str]) -> Optional[str]:
    """The first trainer missing from registered trainer workers named `<prefix><rank>` ("fsdp-rank0",
    "rank2"): the lowest gap in their ranks, else the rank after the last; None when the names
    follow no such numbering."""
    numbered = [_NUMBERED.match(n) for n in names]
    prefixes = {m.group(1) for m in numbered if m}
    if not names or len(prefixes) != 1 or not all(numbered):
        return None
    prefix = prefixes.pop()
    ranks = {int(m.group(2)) for m in numbered if m}
    first_missing = next(r for r in range(len(ranks) + 1) if r not in ranks)
    return f"{prefix}{first_missing}"


def missing_trainer_named(ranks: Dict[str, Any]) -> Optional[str]:
    """The name of the first missing declared trainer rank (GroupStatus.trainer_ranks), when every
    registered rank's worker is named `<prefix><its rank>` ("trainer-rank3"); else None."""
    missing = ranks.get("missing_ranks", [])
    held = [(rank, name) for rank, name in enumerate(ranks.get("workers", [])) if name]
    numbered = [(rank, _NUMBERED.match(name)) for rank, name in held]
    prefixes = {m.group(1) for _, m in numbered if m}
    if not missing or not held or len(prefixes) != 1 or not all(m and int(m.group(2)) == r for r, m in numbered):
        return None
    return f"{prefixes.pop()}{missing[0]}"


def wants_trainer_names(reason: str, status: Optional[Dict[str, Any]]) -> bool:
    """Whether explain_not_ready needs the registered trainers' names: only to guess a missing
    trainer among trainers that declare no rank."""
    return NO_SOURCE in reason and not (status or {}).get("trainer_ranks")


def explain_not_ready(group: str, reason: str, status: Optional[Dict[str, Any]],
                      trainers: Optional[Sequence[str]]) -> Tuple[str, Optional[str]]:
    """(what is missing, culprit) for a group that is not ready: `reason` the daemon's words,
    `status` the group's status (Controller.group), `trainers` its registered trainer workers'
    names (without the group). The text names each missing rank first, then the daemon's reason."""
    found: List[str] = []
    culprit = None
    for r in (status or {}).get("replicas", []):
        for rank in r.get("missing_ranks", []):
            found.append(f'inference replica "{r.get("name", "")}" rank {rank} is not registered')
    declared = (status or {}).get("trainer_ranks")
    if declared:
        problem = declared.get("problem", "")
        if problem and problem not in reason:  # the daemon's reason may name it already
            found.append(problem)
        named = missing_trainer_named(declared)
        if named is not None:
            culprit = f'worker "{group}/{named}"'
    elif NO_SOURCE in reason and trainers is not None:
        registered = ", ".join(sorted(trainers)) or "none"
        guess = missing_trainer(trainers)
        if guess is not None:
            rank = _NUMBERED.match(guess)
            found.append(f'trainer rank {rank.group(2) if rank else "?"} ("{group}/{guess}") is not registered, or '
                         f"the trainers' layout does not cover the model (registered trainers: {registered})")
            culprit = f'worker "{group}/{guess}"'
        else:
            found.append("a trainer is not registered, or the trainers' layout does not cover the model "
                         f"(registered trainers: {registered})")
    if not found:
        return reason, culprit
    return "; ".join(found) + f". The daemon says: {reason}", culprit


NOT_READY = re.compile(r'group "[^"]*" is not ready')


class RoundResult:
    """A round's statistics (refit.v1.RoundStats) with readable fields."""

    def __init__(self, stats: Any) -> None:
        self.proto = stats
        self.group: str = stats.group
        self.round_id: int = stats.round_id
        self.version: int = stats.version
        self.state: str = ROUND_STATES.get(stats.state, str(stats.state))
        self.reason: str = stats.reason
        self.culprit: Optional[str] = culprit_text(stats.culprit) if stats.HasField("culprit") else None
        self.bytes: int = stats.bytes
        self.seconds: float = stats.seconds
        self.prepare_seconds: float = stats.prepare_seconds
        self.transfer_seconds: float = stats.transfer_seconds
        self.commit_seconds: float = stats.commit_seconds

    @property
    def committed(self) -> bool:
        return self.state == "COMMITTED"

    def as_dict(self) -> Dict[str, Any]:
        return json_format.MessageToDict(self.proto, preserving_proto_field_name=True)

    def __repr__(self) -> str:
        return (f"RoundResult(group={self.group!r}, round={self.round_id}, version={self.version}, "
                f"{self.state}, {self.bytes} bytes in {self.seconds:.3f} s)")


def refit_request(group: str, version: int) -> Any:
    if not isinstance(group, str) or not group:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"group must be a non-empty string, not {group!r}")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 < version < (1 << 63):
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"version must be an integer in [1, 2^63), not {version!r}")
    return refit_pb2.RefitRequest(group=group, version=version)


def as_dict(message: Any) -> Dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def group_of(status: Dict[str, Any], name: str) -> Optional[Dict[str, Any]]:
    for g in status.get("groups", []):
        if g.get("name") == name:
            return dict(g)
    return None


def version_of(group: str, status: Optional[Dict[str, Any]]) -> int:
    """The committed version in a group's status (0 before its first round). A group no worker
    registered is not reported, and its version (which the coordinator may still hold from
    earlier runs) cannot be read: that is a RefitError (FAILED_PRECONDITION)."""
    if status is None:
        raise RefitError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"group {group!r} has no registered worker, so the daemons report no committed "
                         "version for it: ask once its workers registered (after wait_ready)")
    return int(status.get("version", 0))


def trainer_names(workers: Sequence[Dict[str, Any]], group: str) -> List[str]:
    prefix = group + "/"
    return [w["worker_id"][len(prefix):] if w["worker_id"].startswith(prefix) else w["worker_id"]
            for w in workers if w.get("role") == "TRAINER"]


def ready_wait_error(group: str, timeout: float, last: str) -> RefitTimeout:
    return RefitTimeout(f"group {group!r} not ready after {timeout} s: {last}")


# The initial metadata a daemon sends once a WatchRounds stream is open (common/watch_protocol.h).
WATCH_OPEN = ("refit-watch", "open")


class RoundWatch:
    """A WatchRounds stream already requested (Controller.open_watch): iterating yields a
    RoundResult per round state change and stops at the stream's deadline; close() ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def wait_open(self, timeout: float) -> None:
        """Returns once the daemon has the stream open: every round state change published from
        then on is delivered. Raises RefitTimeout (and closes the stream) when it is not open
        within `timeout` seconds, or the daemon's error when it refused the stream."""
        done = threading.Event()
        metadata: List[Any] = []

        def read() -> None:  # gRPC's initial_metadata() takes no timeout
            metadata.extend(self._call.initial_metadata() or ())
            done.set()

        threading.Thread(target=read, name="refit-watch-open", daemon=True).start()
        if not done.wait(timeout):
            self.close()
            raise RefitTimeout(f"WatchRounds: the daemon did not open the stream within {timeout:g} s")
        if not any(tuple(m) == WATCH_OPEN for m in metadata):
            self._call.cancel()  # ended already, unless the daemon does not say when it opens
            if self._call.code() in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                raise RefitError(grpc.StatusCode.UNAVAILABLE, "WatchRounds: the stream ended before the daemon opened it")
            raise error_from(self._call) from None

    def __iter__(self) -> Iterator[RoundResult]:
        try:
            for stats in self._call:
                yield RoundResult(stats)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                return
            raise error_from(e) from None

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "RoundWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_T = TypeVar("_T")

MAX_RECEIVE = [("grpc.max_receive_message_length", 256 << 20)]


class Controller:
    def __init__(self, address: str, timeout: float = 10.0, tls: Optional[TlsFiles] = None) -> None:
        """`address`: any refitd's "host:port" (or "unix:PATH"); calls other than refit() end
        within `timeout` seconds. `tls`: refit.TlsFiles of an operator's or viewer's certificate
        (default: $REFIT_TLS_CERT/KEY/CA when set; refit.tls)."""
        self.address, self.timeout = address, timeout
        self._channel = tls_channel(address, tls, options=MAX_RECEIVE)
        self._stub = _rpc.Stub(self._channel, "RefitControl")

    def _call(self, method: Callable[..., _T], request: Any, timeout: Optional[float] = None) -> _T:
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise error_from(e) from None

    def _explain(self, group: str, reason: str, status: Optional[Dict[str, Any]]) -> Tuple[str, Optional[str]]:
        """explain_not_ready with the group's registered trainers, when a missing trainer may be why."""
        trainers = None
        if wants_trainer_names(reason, status):
            try:
                trainers = trainer_names(self.workers(group), group)
            except RefitError:  # the explanation is a bonus: the daemon's own reason stands
                pass
        return explain_not_ready(group, reason, status, trainers)

    def _explained(self, group: str, e: RefitError) -> RefitError:
        """`e`, or for a group that is not ready, the same error naming the missing ranks."""
        if e.code != grpc.StatusCode.FAILED_PRECONDITION or not NOT_READY.search(e.reason):
            return e
        try:
            status = self.group(group)
        except RefitError:
            return e
        reason, culprit = self._explain(group, e.reason, status)
        if reason == e.reason and culprit is None:
            return e
        return RefitError(e.code, reason, None, culprit or e.culprit)

    def refit(self, group: str, version: int, timeout: float = 120.0) -> RoundResult:
        """Runs one round of `group` to `version` and waits for its end. Returns a RoundResult
        of a committed round; raises RefitError (phase, culprit) when it aborted or was refused."""
        request = refit_request(group, version)
        try:
            stats = self._call(self._stub.Refit, request, timeout)
        except RefitError as e:
            raise self._explained(group, e) from None
        return RoundResult(stats)

    def start_refit(self, group: str, version: int) -> int:
        """Starts a round and returns its id at once; watch() reports how it ends."""
        request = refit_request(group, version)
        try:
            return int(self._call(self._stub.StartRefit, request).round_id)
        except RefitError as e:
            raise self._explained(group, e) from None

    def watch(self, group: str = "", timeout: Optional[float] = None) -> Iterator[RoundResult]:
        """Yields a RoundResult for every round state change (PREPARING, TRANSFERRING, COMMITTED,
        ABORTED) of `group` (empty: all) published once the daemon opened the stream: nothing is
        replayed, so a round that ended before is not reported, and one already running shows
        only its later states. The stream is opened at the first iteration; open_watch() opens it
        at once. Ends after `timeout` seconds if given."""
        with self.open_watch(group, timeout) as stream:
            yield from stream

    def open_watch(self, group: str = "", timeout: Optional[float] = None) -> "RoundWatch":
        """watch(), with the stream opened now rather than at the first iteration: returns once
        the daemon has it open (within the controller's timeout, else RefitTimeout), so every
        round started after this call returns is seen; rounds() tells what ended before. Iterate
        it, and close it (or use it as a context manager) when done."""
        watch = RoundWatch(self._stub.WatchRounds(refit_pb2.WatchRoundsRequest(group=group), timeout=timeout))
        watch.wait_open(self.timeout if timeout is None else min(timeout, self.timeout))
        return watch

    def rounds(self, group: str = "", limit: int = 100) -> List[RoundResult]:
        """The most recent rounds of `group` (empty: all), oldest first, each in its last state
        (committed, aborted, or still running), as the coordinator's round log holds them (its
        last 1,024 state changes). `limit`: how many, at most."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise InvalidArgument(f"limit must be a positive integer, not {limit!r}")
        r = self._call(self._stub.ListRounds, refit_pb2.ListRoundsRequest(group=group, limit=limit))
        return [RoundResult(s) for s in r.rounds]

    def status(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The cluster: coordinator, nodes, groups (readiness, versions, plans), as a dict."""
        return as_dict(self._call(self._stub.Status, refit_pb2.StatusRequest(), timeout))

    def group(self, name: str, timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
        """The status of group `name` (see status()), or None when no worker registered it."""
        return group_of(self.status(timeout), name)

    def committed_version(self, group: str) -> int:
        """The last version committed to `group` (0: none yet). Versions outlive processes: the
        coordinator records them in its state file, so a job run again finds them here."""
        return version_of(group, self.group(group))

    def next_version(self, group: str) -> int:
        """The smallest version the next round of `group` may take: committed_version() + 1. A
        loop that numbers rounds by its step refits `max(step, ctl.next_version(group))`, or
        counts from here, so that a run restarted (or run again) is not refused as not newer."""
        return self.committed_version(group) + 1

    def workers(self, group: str = "") -> List[Dict[str, Any]]:
        r = self._call(self._stub.ListWorkers, refit_pb2.ListWorkersRequest(group=group))
        return [as_dict(w) for w in r.workers]

    def plan(self, group: str) -> Dict[str, Any]:
        return as_dict(self._call(self._stub.GetPlan, refit_pb2.GetPlanRequest(group=group)))

    def wait_ready(self, group: str, timeout: float = 30.0) -> Dict[str, Any]:
        """Blocks until `group` is ready to refit (both sides complete); returns its status.
        Raises RefitTimeout after `timeout` seconds, naming what is missing (a trainer or
        inference rank that is not registered, when that is why)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            g = None
            try:  # each poll within what is left of `timeout`
                g = self.group(group, timeout=max(0.05, min(self.timeout, left)))
            except RefitError as e:
                last = str(e)
            else:
                if g is None:
                    last = f"no worker of group {group!r} is registered"
                elif g.get("ready"):
                    return g
                else:
                    last = g.get("not_ready_reason", "not ready")
            if time.monotonic() + 0.1 >= deadline:
                raise ready_wait_error(group, timeout, self._explain(group, last, g)[0] if g else last)
            time.sleep(0.1)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
