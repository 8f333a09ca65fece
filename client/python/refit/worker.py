"""A trainer or inference process, registered with its node's refitd with its live tensors.

    worker = refit.Worker("unix:/tmp/refitd-0.sock", group="policy", role=refit.Role.INFERENCE,
                          layout=my_layout, tensors=dict(model.named_parameters()),
                          on_prepare=stop_generating, on_commit=resume)
    ...
    worker.version        # the last version received completely (0: none); never a partial one

The daemon reads (trainer) or writes (inference) the tensors in place, between PREPARE and
COMMIT/ABORT of each round:
- PREPARE(version): a trainer's tensors must hold `version` and stay untouched until the round
  ends; an inference worker stops reading them. Raising from on_prepare refuses the round: the
  round aborts at once, with the exception's text as its reason.
- COMMIT(version): the round succeeded; an engine post-processes (re-derives absorbed matrices,
  flushes its prefix cache) and resumes. The daemon waits for on_commit to return.
- ABORT(reason): the round failed; an inference worker's tensors hold no complete version.

Callbacks run on the worker's own dispatch thread, one round at a time; a PREPARE whose round
has already ended (aborted while an earlier callback ran) is skipped. With blocking=True they run
instead in the caller's thread, inside `serve()`, which a training loop calls between steps and
at least once within the daemon's --prepare-timeout of a refit request.

Which round: a callback with a parameter named `round_id` (`def on_abort(reason, round_id)`)
is also passed the round's id; one without it is called as before. `round_is_open(round_id)`
says whether that round is still in flight as this worker knows it, and `on_round_end(round_id)`
is called the moment the worker learns a round ended (its ABORT or COMMIT received, a later
round's PREPARE, the session lost, the worker closed), before on_commit/on_abort run in turn
(a served round ended by a later PREPARE gets its on_abort, "never ended here"):
an on_prepare that waits for something (an engine's update window) uses them to stop waiting
for a round that is over, and an on_abort to tell a stale round's ABORT from the current one's.

The session is watched by gRPC keepalive: a daemon that dies or freezes is noticed within about
two seconds; the round in flight counts as aborted, and the worker registers again, by itself,
as soon as the daemon is back (on_disconnect / on_reconnect report both).
"""
import collections
import inspect
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Tuple

import grpc

from refit import _rpc, dtypes, export, handles, layout_io
from refit._proto import refit_pb2
from refit.errors import (HandoverError, InvalidArgument, RegistrationError, RegistrationTimeout, StateError,
                          StorageReplaced)
from refit.role import Role, RoleLike

__all__ = ["Round", "Worker", "Role"]

log = logging.getLogger("refit.worker")

_WIRE_ROLES = {Role.TRAINER: refit_pb2.TRAINER, Role.INFERENCE: refit_pb2.INFERENCE}

# The largest trainer world size the coordinator accepts (daemon/coordinator/membership.h).
MAX_TRAINER_WORLD_SIZE = 1 << 20

# A worker still waiting for its daemon after this long says so (once), then keeps waiting.
WAITING_LOG_AFTER_S = 1.0

KEEPALIVE = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    # Reconnect quickly once the daemon is back (gRPC's default backoff grows to minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# Registration failures that clear by themselves: the daemon starting, restarting or busy, or
# (while re-registering) still holding this worker's previous session.
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}
# A name still held when a worker first registers may be its own predecessor's, killed a moment
# ago: the daemon frees it once it sees that session end (keepalive: about 2 s). Retried this long.
_PREDECESSOR_GRACE_S = 5.0


class Round:
    """What `serve()` returns: one round as this worker saw it, and where its time went:
    `waited_seconds` for the PREPARE to come, `prepare_seconds` in on_prepare,
    `transfer_seconds` from answering PREPARE to the round's end (the daemons moving the data
    and committing), `commit_seconds` in on_commit (or on_abort); `seconds` the three together,
    how long the round held this worker."""

    def __init__(self, round_id: int, version: int, committed: bool, reason: str = "", *,
                 waited_seconds: float = 0.0, prepare_seconds: float = 0.0, transfer_seconds: float = 0.0,
                 commit_seconds: float = 0.0) -> None:
        self.round_id, self.version, self.committed, self.reason = round_id, version, committed, reason
        self.waited_seconds = waited_seconds
        self.prepare_seconds = prepare_seconds
        self.transfer_seconds = transfer_seconds
        self.commit_seconds = commit_seconds

    @property
    def seconds(self) -> float:
        return self.prepare_seconds + self.transfer_seconds + self.commit_seconds

    def __repr__(self) -> str:
        state = "committed" if self.committed else f"aborted: {self.reason}"
        return f"Round(id={self.round_id}, version={self.version}, {state}, {self.seconds:.3f} s)"


def local_tensor(t: Any) -> Any:
    """The tensor that is the buffer: a DTensor's local shard (a view, not a copy), else `t`."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local()
    return t


def check_tensors(worker: Any, specs: Any, tensors: Mapping[str, Any]) -> List[Tuple[str, Any]]:
    """Every buffer of the worker's layout has its live tensor, alike in shape, dtype and
    contiguity; all on one device. Returns [(buffer name, tensor)] in the layout's order."""
    tensors = dict(tensors)
    problems = []
    pairs = []
    for b in worker.buffers:
        t = tensors.pop(b.name, None)
        if t is None:
            problems.append(f"buffer {b.name!r} of the layout has no tensor (pass tensors={{{b.name!r}: ...}})")
            continue
        t = local_tensor(t)
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            problems.append(f"parameter {b.name!r} is a {type(t).__name__}, not a tensor")
            continue
        shape = tuple(int(s) for s in t.shape)
        want = tuple(int(s) for s in b.shape)
        if shape != want:
            problems.append(f"parameter {b.name!r} has shape {list(shape)}, but the layout's buffer has {list(want)}")
        if not dtypes.matches(t, b.dtype):
            try:
                dt = dtypes.of_tensor(t)
            except ValueError:
                dt = str(t.dtype)
            problems.append(f"parameter {b.name!r} is {dt}, but the layout's buffer is {dtypes.canonical(b.dtype)}")
        if not export.is_contiguous(t):
            problems.append(f"parameter {b.name!r} is not contiguous: a buffer is one row-major region "
                            "(use .contiguous() once, at setup, and register that tensor)")
        pairs.append((b.name, t))
    if tensors:
        extra = sorted(tensors)
        problems.append(f"{len(extra)} tensor(s) have no buffer in the layout of worker {worker.name!r}: "
                        f"{', '.join(repr(n) for n in extra[:5])}{'...' if len(extra) > 5 else ''}")
    if problems:
        raise RegistrationError(f"worker {worker.name!r}: " + "; ".join(problems[:8]) +
                                (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))
    devices = {export.describe(t)[2] for _, t in pairs}
    if len(devices) > 1:
        raise RegistrationError(f"worker {worker.name!r}: its tensors are on {sorted(map(str, devices))}: "
                                "one worker's tensors are all on one GPU, or all in host memory")
    _check_no_overlap(worker.name, pairs)
    return pairs


def _check_no_overlap(worker_name: str, pairs: List[Tuple[str, Any]]) -> None:
    """Two buffers over the same bytes would have the daemon write one through the other."""
    spans = sorted((export.describe(t)[0], export.describe(t)[0] + export.describe(t)[1], name)
                   for name, t in pairs if export.describe(t)[1] > 0)
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise RegistrationError(f"worker {worker_name!r}: buffers {an!r} and {bn!r} overlap in memory "
                                    "(register each byte once)")


def trainer_rank(role: Role, rank: Optional[int], world_size: Optional[int]) -> Optional[Tuple[int, int]]:
    """(rank, world_size) a trainer declares, checked; None when it declares neither. Raises
    InvalidArgument naming the field that is wrong."""
    if rank is None and world_size is None:
        return None
    if role is not Role.TRAINER:
        raise InvalidArgument("rank= and world_size= are a trainer's; an inference worker declares its engine "
                              "replica's ranks in its layout (replica, replicaRank, replicaSize)")
    if rank is None or world_size is None:
        given, absent = ("rank", "world_size") if world_size is None else ("world_size", "rank")
        raise InvalidArgument(f"{given}= was given without {absent}=: a trainer declares both "
                              "(e.g. torch.distributed's get_rank() and get_world_size()), or neither")
    for field, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{field} must be an int, not {value!r}")
    if not 1 <= world_size <= MAX_TRAINER_WORLD_SIZE:
        raise InvalidArgument(f"world_size must be between 1 and {MAX_TRAINER_WORLD_SIZE}, not {world_size}")
    if not 0 <= rank < world_size:
        raise InvalidArgument(f"rank must be in [0, world_size) = [0, {world_size}), not {rank}")
    return rank, world_size


def _warn_if_a_rank_without_replica(layout: Any, worker: Any) -> None:
    """An engine worker that holds part of the model and declares no replica is a replica of its
    own to the daemons: a round may commit to it while its peers (the other TP ranks) are not
    registered yet, and the engine then serves mixed versions. Legal, so a warning, not an error."""
    if worker.replica_size > 0 or len(layout.workers) < 2:
        return
    part = layout_io.part_of_model(layout, worker)
    if part is None:
        return
    log.warning("inference worker %r holds part of the model (%s) but its layout declares no replica: "
                "the daemons refit it as an engine of its own, even while the engine's other ranks are "
                "not registered. Declare replica, replicaRank and replicaSize on every rank "
                "(refit.layouts.dtensor.trainer_layout(..., replica=\"dp0\"), refit-layout and "
                "refit.layouts.vllm write them)", worker.name, part)


class _Registered:
    """A registered buffer: the object the caller passed, and the memory handed to the daemon."""

    def __init__(self, name: str, given: Any, tensor: Any) -> None:
        self.name, self.given = name, given
        self.address, self.nbytes, _ = export.describe(tensor)

    def replaced(self) -> Optional[str]:
        """How the given object's memory differs from what was handed over, or None."""
        address, nbytes, _ = export.describe(local_tensor(self.given))
        if (address, nbytes) == (self.address, self.nbytes):
            return None
        return (f"parameter {self.name!r} now lives at {address:#x} ({nbytes} bytes), not in the memory "
                f"registered ({self.address:#x}, {self.nbytes} bytes)")


Callback = Optional[Callable[..., Any]]


def takes_round_id(fn: Callback) -> bool:
    """Whether callback `fn` has a parameter named `round_id` (passed by keyword). A bare
    **kwargs does not count: a callback that forwards its keywords elsewhere must not start
    receiving one it never asked for."""
    if fn is None:
        return False
    try:
        p = inspect.signature(fn).parameters.get("round_id")
    except (TypeError, ValueError):  # a builtin or extension callable without a signature
        return False
    return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class Worker:
    def __init__(self, daemon: str, group: str, role: RoleLike, layout: Any, tensors: Mapping[str, Any], *,
                 name: Optional[str] = None, on_prepare: Callback = None, on_commit: Callback = None,
                 on_abort: Callback = None, on_disconnect: Callback = None, on_reconnect: Callback = None,
                 blocking: bool = False, register_timeout: float = 30.0, reconnect: bool = True,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 on_round_end: Callback = None) -> None:
        """Registers `tensors` (buffer name -> live tensor, e.g. dict(model.named_parameters()))
        as worker `name` of `layout` (a dict, JSON or refit.v1.Layout; `name` may be omitted when
        it holds one worker) in model group `group` with the daemon at `daemon`
        ("unix:/tmp/refitd-0.sock"). `role`: refit.Role.TRAINER or refit.Role.INFERENCE (or
        "trainer", "inference", "engine"). Waits up to `register_timeout` seconds for a daemon
        that is starting or busy, logging a warning after a second of waiting; raises
        RegistrationError (naming every mismatched parameter), or RegistrationTimeout when no
        daemon took the registration in time.

        A trainer whose ranks each register (e.g. FSDP shards) declares `rank` and `world_size`
        (torch.distributed's get_rank() and get_world_size()): the group is then not ready while
        any rank 0..world_size-1 is missing, and the error names it ("trainer rank 3 of 4 is not
        registered"). Every trainer rank of the group declares the same world size, or none does;
        the daemons name ranks that disagree. InvalidArgument for a bad value, or for an
        inference worker (its ranks are its engine replica's, declared in its layout).

        on_prepare(version), on_commit(version) and on_abort(reason) are also passed
        `round_id=` when they have a parameter of that name. `on_round_end(round_id)` runs on the
        session thread (at close: the closing thread) as soon as the worker learns that a round
        ended, before that round's on_commit/on_abort; it must return quickly (wake a waiter, note
        the id), since the worker reads no further event until it returns."""
        self.role: Role = Role.of(role)
        declared = trainer_rank(self.role, rank, world_size)
        self.rank: Optional[int] = declared[0] if declared else None
        self.world_size: Optional[int] = declared[1] if declared else None
        self.daemon, self.group = daemon, group
        self._role = _WIRE_ROLES[self.role]
        self._inference = self.role is Role.INFERENCE
        layout = layout_io.to_proto(layout)
        self._worker, self._specs = layout_io.one_worker(layout, name)
        self.name: str = self._worker.name
        if self._inference:
            _warn_if_a_rank_without_replica(layout, self._worker)
        self._pairs = check_tensors(self._worker, self._specs, tensors)
        given = dict(tensors)
        self._registered = [_Registered(n, given[n], t) for n, t in self._pairs]
        self._on_prepare, self._on_commit, self._on_abort = on_prepare, on_commit, on_abort
        self._on_disconnect, self._on_reconnect = on_disconnect, on_reconnect
        self._on_round_end = on_round_end
        # The callbacks that asked for the round's id (a parameter named round_id).
        self._round_kw = {"prepare": takes_round_id(on_prepare), "commit": takes_round_id(on_commit),
                          "abort": takes_round_id(on_abort)}
        self._blocking = blocking
        self._reconnect = reconnect
        self._mu = threading.Condition()
        self._version = 0          # guarded by _mu
        self._connected = False
        self._closed = False
        self._in_round: Optional[int] = None  # round id between PREPARE and its end
        # The round whose PREPARE came and whose end did not, as the session saw them: what
        # round_is_open() answers (set and cleared on the session thread, unlike _in_round).
        self._open_round: Optional[int] = None
        # (kind, round id, version, reason) for the dispatcher / serve()
        self._events: Deque[Tuple[str, int, int, str]] = collections.deque()
        self._outgoing: Optional["queue.Queue[Any]"] = None  # the live session's queue of WorkerMessages
        self._call: Any = None
        self.worker_id: Optional[str] = None
        self._session_key = ""     # the last registration's (RegisterWorkerResponse.session_key)
        self.registrations = 0
        self._channel = grpc.insecure_channel(daemon, options=KEEPALIVE)
        self._stub = _rpc.Stub(self._channel, "RefitWorker")
        try:
            self._register_until(time.monotonic() + register_timeout, first=True)
        except BaseException:
            self._channel.close()
            raise
        self._thread = threading.Thread(target=self._session_loop, name=f"refit-session-{self.name}",
                                        daemon=True)
        self._thread.start()
        self._dispatcher: Optional[threading.Thread] = None
        if not blocking:
            self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"refit-worker-{self.name}",
                                                daemon=True)
            self._dispatcher.start()

    # ------------------------------------------------------------------------------------------
    # Public state.

    @property
    def version(self) -> int:
        """Inference: the last version received completely (0: none, e.g. while a round writes
        the tensors, or after an aborted one). Trainer: the last version a round committed."""
        with self._mu:
            return self._version

    @property
    def connected(self) -> bool:
        with self._mu:
            return self._connected

    def round_is_open(self, round_id: int) -> bool:
        """Whether round `round_id` is in flight as this worker knows it: its PREPARE came, and
        neither its ABORT or COMMIT, nor a later round's PREPARE, nor the loss of the session, nor
        close() followed. A callback waiting on something of its own polls it to give up on a
        round that is over (or takes on_round_end)."""
        with self._mu:
            return not self._closed and self._open_round == round_id

    def wait_version(self, version: int, timeout: float) -> bool:
        """Blocks until this worker holds `version` or a later one, committed; True then, False
        after `timeout` seconds (or once the worker is closed)."""
        return self._wait(lambda: self._version >= version, timeout)

    def wait_connected(self, timeout: float) -> bool:
        """Blocks until the worker's session with its daemon is up; False after `timeout` s."""
        return self._wait(lambda: self._connected, timeout)

    def check_storage(self) -> None:
        """Raises StorageReplaced, naming each parameter, when a registered tensor's memory was
        replaced since registration (`param.data = ...`, `model.to(...)`): a refit would read or
        write the old memory. Every PREPARE runs this check, and refuses the round if it fails."""
        problems = [p for p in (r.replaced() for r in self._registered) if p]
        if problems:
            more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
            raise StorageReplaced(f"worker {self.name!r}: " + "; ".join(problems[:4]) + more +
                                  ": its storage was replaced after registration (param.data = ..., "
                                  "model.to(...)); update weights in place (param.copy_) or register again")

    def _wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._mu:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._mu.wait(left)
            return True

    # ------------------------------------------------------------------------------------------
    # Registration.

    def _register_until(self, deadline: float, first: bool) -> None:
        backoff = 0.05
        started = time.monotonic()
        grace = started + _PREDECESSOR_GRACE_S
        warn_at = started + WAITING_LOG_AFTER_S
        warned = False
        while True:
            try:
                return self._register(timeout=max(0.5, min(10.0, deadline - time.monotonic())))
            except RegistrationError as e:
                cause = e.__cause__
                transient = getattr(e, "transient", False) or (
                    isinstance(cause, grpc.RpcError) and (cause.code() in _TRANSIENT or (
                        (not first or time.monotonic() < grace) and
                        cause.code() == grpc.StatusCode.ALREADY_EXISTS)))
                with self._mu:
                    closed = self._closed
                if not transient or closed:
                    raise
                now = time.monotonic()
                if now >= deadline:
                    raise RegistrationTimeout(f"worker {self.name!r}: not registered with refitd at "
                                              f"{self._socket_path()} within {deadline - started:.1f} s: {e}") from e
                if not warned and now >= warn_at:
                    warned = True
                    until = "until it is back" if deadline == float("inf") else f"for {deadline - now:.0f} s more"
                    log.warning("worker %s: waiting for refitd at %s (%s); retrying %s", self.name,
                                self._socket_path(), e, until)
                log.debug("worker %s: registration not taken yet (%s); retrying", self.name, e)
                # The first retry after `warn_at` comes on time, so the warning does too; the last
                # comes at the deadline.
                pause = backoff if warned else min(backoff, max(0.01, warn_at - now))
                time.sleep(min(pause, deadline - now))
                backoff = min(1.0, backoff * 2)

    def _socket_path(self) -> str:
        return self.daemon[len("unix:"):] if self.daemon.startswith("unix:") else self.daemon

    def _register(self, timeout: float) -> None:
        exported = export.export_buffers(self._pairs)
        try:
            request = refit_pb2.RegisterWorkerRequest(group=self.group, role=self._role)
            # Encoded: the daemon then receives one string, not a message per piece (10x its
            # size in the daemon's memory).
            request.worker_encoded = self._worker.SerializeToString()
            request.tensors.extend(self._specs)
            request.memory.extend(exported.memory)
            request.vmm_ranges.extend(exported.vmm_ranges)
            request.gpu_uuid = exported.gpu_uuid
            if self.world_size is not None:
                request.trainer_rank, request.trainer_world_size = self.rank, self.world_size
            # Always, even with no descriptor (CUDA IPC memory): the delivery is how the daemon
            # learns which process (uid) registers; it refuses registrations without one.
            path = handles.handle_socket_path(self.daemon)
            if path is None:
                raise RegistrationError(
                    f"worker {self.name!r}: a worker registers through the daemon's handle socket, "
                    f"which needs the daemon's unix socket, not {self.daemon!r}")
            if not os.path.exists(path):
                raise HandoverError(f"no handle socket at {path} (is refitd running there?)", transient=True)
            request.fd_token = handles.deliver(path, exported.fds, timeout=timeout)
            try:
                response = self._stub.Register(request, timeout=timeout)
            except grpc.RpcError as e:
                raise RegistrationError(f"worker {self.name!r}: the daemon at {self.daemon} refused the "
                                        f"registration: {e.code().name}: {e.details()}") from e
        finally:
            exported.close()  # the daemon holds its own mappings now
        with self._mu:
            self.worker_id = response.worker_id
            # This registration's secret: the session's hello and Unregister present it.
            self._session_key = response.session_key
            self.registrations += 1
        log.info("registered %s with %s (%d buffers)", response.worker_id, self.daemon, len(self._pairs))

    # ------------------------------------------------------------------------------------------
    # The session: reads the daemon's events and queues them; registers again after a loss.

    def _session_loop(self) -> None:
        while True:
            with self._mu:
                if self._closed:
                    return
            reason = self._run_session()
            with self._mu:
                if self._closed:
                    return
                lost_open, self._open_round = self._open_round, None
            if lost_open is not None:
                self._round_ended(lost_open)
            with self._mu:
                if self._closed:
                    return
                self._connected = False
                lost_round = self._in_round
                self._in_round = None
                if self._inference and lost_round is not None:
                    self._version = 0  # the round never ended here: the tensors may be partial
                if lost_round is not None:
                    self._drop_pending_prepare(lost_round)
                    self._events.append(("LOST", lost_round, 0, f"lost the daemon: {reason}"))
                self._mu.notify_all()
            log.warning("worker %s lost its session with %s: %s", self.name, self.daemon, reason)
            if self._on_disconnect:
                self._call_safely(self._on_disconnect, reason)
            if not self._reconnect:
                return
            while True:  # as soon as the daemon is back
                try:
                    self._register_until(float("inf"), first=False)
                    break
                except RegistrationError as e:
                    with self._mu:
                        if self._closed:
                            return
                    log.error("worker %s cannot register again: %s", self.name, e)
                    if self._on_disconnect:
                        self._call_safely(self._on_disconnect, f"cannot register again: {e}")
                    return
                except Exception:  # whatever else went wrong, this thread must go on trying
                    log.exception("worker %s: registering again failed; retrying", self.name)
                    time.sleep(1.0)
            if self._on_reconnect:
                self._call_safely(self._on_reconnect)

    def _run_session(self) -> str:
        outgoing: "queue.Queue[Any]" = queue.Queue()
        with self._mu:
            key = self._session_key
        outgoing.put(refit_pb2.WorkerMessage(hello=self.worker_id, session_key=key))

        def messages() -> Iterator[Any]:
            while True:
                m = outgoing.get()
                if m is None:
                    return
                yield m

        call = self._stub.Session(messages())
        with self._mu:
            self._outgoing, self._call = outgoing, call
            self._connected = True
            self._mu.notify_all()
        try:
            for event in call:
                self._enqueue(event)
            return "the daemon ended the session"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
        finally:
            outgoing.put(None)
            with self._mu:
                self._outgoing = None

    def _enqueue(self, e: Any) -> None:
        kinds = refit_pb2.RoundEvent
        # The end of a round is known (round_is_open, on_round_end) before the event is queued, so
        # that no callback of it, nor of a later round, can run before on_round_end told of it.
        ended = None
        with self._mu:
            if e.kind == kinds.PREPARE:
                if self._open_round not in (None, e.round_id):
                    ended = self._open_round  # superseded by this round
                self._open_round = e.round_id
            elif e.kind in (kinds.COMMIT, kinds.ABORT):
                ended = e.round_id
                if self._open_round == e.round_id:
                    self._open_round = None
            if ended is not None:
                self._mu.notify_all()
        if ended is not None:
            self._round_ended(ended)
        with self._mu:
            if e.kind == kinds.PREPARE:
                # A round still open here when the next begins never ended for this worker (its end
                # was lost, or its PREPARE overtook its own ABORT): the daemon is past it, and so
                # is whoever serves it, or else it is dropped unserved.
                if ended is not None and not self._drop_pending_prepare(ended):
                    self._events.append(("SUPERSEDED", ended, 0,
                                         f"round {ended} never ended here: round {e.round_id} began"))
                self._in_round = e.round_id
                if self._inference:
                    self._version = 0  # the tensors are about to change
                self._events.append(("PREPARE", e.round_id, e.version, ""))
            elif e.kind == kinds.COMMIT:
                self._events.append(("COMMIT", e.round_id, e.version, ""))
            elif e.kind == kinds.ABORT:
                # Only a round it was prepared for can have left its tensors partial.
                if self._in_round == e.round_id:
                    self._in_round = None
                    if self._inference:
                        self._version = 0
                # A PREPARE not served yet is dropped: the round is over; the abort alone is reported.
                self._drop_pending_prepare(e.round_id)
                self._events.append(("ABORT", e.round_id, e.version, e.reason))
            self._mu.notify_all()

    def _round_ended(self, round_id: int) -> None:
        if self._on_round_end:
            self._call_safely(self._on_round_end, round_id)

    def _drop_pending_prepare(self, round_id: int) -> bool:  # _mu held; whether one was dropped
        kept = [x for x in self._events if not (x[0] == "PREPARE" and x[1] == round_id)]
        dropped = len(kept) != len(self._events)
        self._events.clear()
        self._events.extend(kept)
        return dropped

    def _send(self, message: Any) -> None:
        with self._mu:
            q = self._outgoing
        if q is not None:
            q.put(message)

    # ------------------------------------------------------------------------------------------
    # Rounds, one at a time: on the dispatch thread, or in serve() (blocking=True).

    def _dispatch_loop(self) -> None:
        while True:
            with self._mu:
                if self._closed:
                    return
            try:
                self._serve_one(None, 600.0)
            except BaseException:  # never lose the dispatcher: the next round must still be served
                log.exception("worker %s: a round's callbacks failed", self.name)

    def serve(self, timeout: Optional[float] = None, round_timeout: float = 600.0) -> Optional[Round]:
        """blocking=True: takes part in the next round, in the caller's thread. Waits up to
        `timeout` seconds (None: forever, 0: only a round already pending) for a PREPARE; runs
        on_prepare, then waits for the round's end (the daemons' phase deadlines bound it; this
        worker gives up after `round_timeout` seconds all the same and counts the round as
        aborted) and runs on_commit or on_abort. Returns a Round (with where its time went), or
        None when no round came. Call it within the daemon's --prepare-timeout of every refit
        request, or the round aborts naming this worker."""
        if not self._blocking:
            raise StateError("serve() is for Worker(..., blocking=True); this worker runs its "
                             "callbacks on its own thread")
        return self._serve_one(timeout, round_timeout)

    def _serve_one(self, timeout: Optional[float], round_timeout: float) -> Optional[Round]:
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        event = self._next_event(deadline, lambda x: x[0] in ("PREPARE", "ABORT", "LOST"))
        if event is None:
            return None
        kind, round_id, version, reason = event
        taken = time.monotonic()
        if kind != "PREPARE":  # a round that ended before this worker served it
            self._finish_abort(round_id, reason, kind == "ABORT")
            return Round(round_id, version, False, reason, waited_seconds=taken - started,
                         commit_seconds=time.monotonic() - taken)
        self._prepare(round_id, version)  # a refusal is answered by the round's ABORT
        answered = time.monotonic()
        event = self._next_event(answered + round_timeout, lambda x: x[1] == round_id and x[0] != "PREPARE")
        if event is None:
            with self._mu:
                closed = self._closed
            event = ("LOST", round_id, version, "worker closed" if closed else
                     f"no COMMIT or ABORT of round {round_id} within {round_timeout} s")
        kind, _, version2, reason = event
        ended = time.monotonic()
        if kind == "COMMIT":
            self._commit(round_id, version2)
        else:  # ABORT; LOST or SUPERSEDED: nobody waits for an acknowledgement
            self._finish_abort(round_id, reason, kind == "ABORT")
        committed = kind == "COMMIT"
        return Round(round_id, version2 if committed else version, committed, "" if committed else reason,
                     waited_seconds=taken - started, prepare_seconds=answered - taken,
                     transfer_seconds=ended - answered, commit_seconds=time.monotonic() - ended)

    def _next_event(self, deadline: Optional[float],
                    wanted: Callable[[Tuple[str, int, int, str]], bool]) -> Optional[Tuple[str, int, int, str]]:
        with self._mu:
            while True:
                for i, x in enumerate(self._events):
                    if wanted(x) or x[0] == "LOST":  # a lost session ends whatever round we wait for
                        del self._events[i]
                        return x
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._mu.wait(min(left, 1.0) if left is not None else 1.0)

    def _round_kwargs(self, callback: str, round_id: int) -> Dict[str, int]:
        return {"round_id": round_id} if self._round_kw[callback] else {}

    def _prepare(self, round_id: int, version: int) -> bool:
        if not self.round_is_open(round_id):  # ended since it was queued: its end event follows
            log.debug("worker %s skips the PREPARE of round %d: the round is over", self.name, round_id)
            return False
        try:
            self.check_storage()  # a round over replaced memory would move stale weights
            if self._on_prepare:
                self._on_prepare(version, **self._round_kwargs("prepare", round_id))
        except BaseException as ex:  # the worker refuses the round; its reason reaches the operator
            reason = f"{type(ex).__name__}: {ex}" if str(ex) else type(ex).__name__
            if not self.round_is_open(round_id):  # nobody waits for the answer to a round that is over
                log.info("worker %s: round %d (version %d) ended while on_prepare ran: %s", self.name,
                         round_id, version, reason)
                return False
            log.warning("worker %s refuses round %d (version %d): %s", self.name, round_id, version, reason)
            self._send(refit_pb2.WorkerMessage(refused=refit_pb2.Refusal(round_id=round_id, reason=reason)))
            return False
        if not self.round_is_open(round_id):
            log.info("worker %s: round %d (version %d) ended while on_prepare ran; not answering it",
                     self.name, round_id, version)
            return False
        self._send(refit_pb2.WorkerMessage(prepared=round_id))
        return True

    def _commit(self, round_id: int, version: int) -> None:
        with self._mu:
            self._version = version
            self._in_round = None
            self._mu.notify_all()
        if self._on_commit:
            self._call_safely(self._on_commit, version, **self._round_kwargs("commit", round_id))
        self._send(refit_pb2.WorkerMessage(resumed=round_id))

    def _finish_abort(self, round_id: int, reason: str, acknowledge: bool) -> None:
        with self._mu:
            # The version was dropped at the round's PREPARE (or at the session's loss); a round
            # this worker was never prepared for wrote nothing of it.
            if self._in_round == round_id:
                self._in_round = None
            self._mu.notify_all()
        if self._on_abort:
            self._call_safely(self._on_abort, reason, **self._round_kwargs("abort", round_id))
        if acknowledge:  # a lost session has nobody to acknowledge to
            self._send(refit_pb2.WorkerMessage(resumed=round_id))

    def _call_safely(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException:
            log.exception("worker %s: callback %s raised", self.name, getattr(fn, "__name__", fn))

    # ------------------------------------------------------------------------------------------
    # Ending.

    def close(self, unregister: bool = True) -> None:
        """Unregisters (the daemon forgets the worker) and ends the session. Safe from a callback."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            call, worker_id, key = self._call, self.worker_id, self._session_key
            open_round, self._open_round = self._open_round, None
            self._mu.notify_all()
        if open_round is not None:  # wakes an on_prepare still waiting for it
            self._round_ended(open_round)
        if unregister and worker_id:
            try:
                self._stub.Unregister(refit_pb2.UnregisterWorkerRequest(worker_id=worker_id, session_key=key),
                                      timeout=5)
            except grpc.RpcError as e:
                log.info("worker %s: unregister: %s", self.name, e.details())
        self._send(None)
        if call is not None:
            call.cancel()
        me = threading.current_thread()
        for t in (self._thread, self._dispatcher):
            if t is not None and t is not me:
                t.join(timeout=5)
        self._channel.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
