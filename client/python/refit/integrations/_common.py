"""What the stack adapters share: the engine side's update window, a trainer that stages a stack's
(name, tensor) stream into registered buffers, and version bookkeeping against the controller."""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List, Mapping, Optional, Tuple

try:  # the package's exception root (older trees: plain RuntimeError)
    from refit.errors import Error as _RefitRoot
except ImportError:  # pragma: no cover
    _RefitRoot = RuntimeError  # type: ignore[misc,assignment]

log = logging.getLogger("refit.integrations")


class IntegrationError(_RefitRoot, RuntimeError):
    """An adapter could not do what its stack asked: the message says which step and why."""


class RoundAborted(IntegrationError):
    """The refit round this update waited for aborted: the engine's weights hold no complete
    version and must not serve until a later round commits. `reason` is the daemons' reason."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class UnsupportedModel(IntegrationError, ValueError):
    """The engine's model has parts refit does not write (a draft/MTP model, a quantization refit
    cannot produce): the message names them."""


def env_or(value: Optional[Any], env: str, default: Any = None) -> Any:
    """`value` when given, else $env, else `default` (how per-host settings reach every worker of a
    stack that sends one configuration to all of them)."""
    if value not in (None, ""):
        return value
    got = os.environ.get(env)
    return got if got not in (None, "") else default


class EngineWindow:
    """The engine side of one round, as the stack's update calls see it.

    The daemon may write the engine's tensors only while the engine runs no forward pass: between
    `enter()` (the stack's "start update" call, on the thread that would otherwise run the model)
    and `leave()`. PREPARE waits up to `prepare_wait_s` for the window and refuses the round
    otherwise, so a round can never write under a running forward pass. `always_open` serves
    stacks that stop generating before their sync step and have no "start update" call reaching
    the engine: the window is then open whenever no caller closed it.

    Rounds are told apart by their ids: the worker passes `round_id` to the callbacks and calls
    on_round_end as soon as it learns a round ended (`worker_callbacks()` wires all four). A
    PREPARE waiting for the window stops waiting, refusing, once its round is over, so a round
    that aborted while the window was closed is never taken by the next `enter()`. Which round
    an update is for, the engine cannot know by itself: its round may have started, and even
    aborted, before `enter()` (the trainer starts the round, then the update), or an older round
    may have aborted just before. `wait_round(round_id, ...)` is the exact answer, for callers
    that know the update's round id. Without it, the update's outcome is the end of the round
    this window prepared, or, before one prepared it, of a round not yet over at `enter()`: an
    older round's end never counts. Called without round ids (an older worker), every event
    counts, as before."""

    # How many rounds' ids and ends are remembered: their events arrive in order, within a few
    # rounds of their end.
    _REMEMBERED_ROUNDS = 64

    def __init__(self, prepare_wait_s: float, always_open: bool = False) -> None:
        self._cv = threading.Condition()
        self._open = always_open
        self._always_open = always_open
        self._prepare_wait_s = prepare_wait_s
        self._prepared: Optional[int] = None  # the version of the round prepared in this window
        self._round: Optional[int] = None     # its id (None: not known, from an older worker)
        self._outcome: Optional[Tuple[str, Any]] = None  # ("COMMIT", version) | ("ABORT", reason)
        # Rounds that can belong to no later update: over (as the worker learnt) or refused here.
        self._over: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        # Each round's end: ("COMMIT", version) | ("ABORT", reason).
        self._ends: "collections.OrderedDict[int, Tuple[str, Any]]" = collections.OrderedDict()
        self._latest: Optional[int] = None  # the round this window heard of last
        # When enter() was called: the rounds over then, and the round prepared in the window
        # before (their ends are not this update's outcome); the round heard of last, if it was
        # over (it may be this update's round, aborted before the window opened, or an older one).
        self._stale: FrozenSet[int] = frozenset()
        self._over_at_enter: Optional[int] = None
        self.committed_version = 0

    def worker_callbacks(self) -> Dict[str, Callable[..., None]]:
        """on_prepare, on_commit, on_abort and on_round_end, for refit.Worker(..., **these)."""
        return dict(on_prepare=self.on_prepare, on_commit=self.on_commit, on_abort=self.on_abort,
                    on_round_end=self.on_round_end)

    # The stack's thread.
    def enter(self) -> None:
        with self._cv:
            self._open = True
            previous = () if self._round is None else (self._round,)
            self._stale = frozenset(self._over).union(previous)
            self._over_at_enter = self._latest if self._latest in self._over else None
            self._prepared, self._round, self._outcome = None, None, None
            self._cv.notify_all()

    def leave(self) -> None:
        with self._cv:
            self._open = self._always_open
            self._cv.notify_all()

    def wait_prepared(self, timeout: float, unless_last_aborted: bool = False) -> Optional[int]:
        """The version of the round that PREPAREd this engine since `enter()`. Raises
        RoundAborted when a round not over at `enter()` aborted before it prepared this engine.
        `unless_last_aborted`: returns None instead of waiting when the round heard of last had
        already aborted at `enter()` and no other came since (whether that round was this
        update's, only the caller can tell: wait_round)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._prepared is None:
                if self._outcome is not None and self._outcome[0] == "ABORT":
                    raise RoundAborted(f"the refit round aborted before it prepared this engine: "
                                       f"{self._outcome[1]}", self._outcome[1])
                last = self._over_at_enter
                if last is not None and last == self._latest and last in self._ends:
                    if self._ends[last][0] == "ABORT" and unless_last_aborted:
                        return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise IntegrationError(f"no refit round prepared this engine within {timeout:g} s "
                                           f"(did the trainer start one? is the group ready?){self._last_abort()}")
                self._cv.wait(left)
            return self._prepared

    def wait_outcome(self, version: int, timeout: float) -> None:
        """Returns once the daemons COMMITted `version` here; raises when the round aborted."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if self._outcome is not None:
                    kind, what = self._outcome
                    if kind == "ABORT":
                        raise RoundAborted(f"refit round of version {version} aborted: {what}", what)
                    if what != version:
                        raise IntegrationError(f"refit committed version {what}, but this update "
                                               f"expected version {version}")
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise IntegrationError(f"refit round of version {version} did not end within {timeout:g} s")
                self._cv.wait(left)

    def wait_round(self, round_id: int, version: int, timeout: float) -> None:
        """Returns once round `round_id` COMMITted `version` here; raises RoundAborted when it
        aborted, before or after it prepared this engine (even before `enter()`)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                end = self._ends.get(round_id)
                if end is not None:
                    kind, what = end
                    if kind == "ABORT":
                        raise RoundAborted(f"refit round {round_id} (version {version}) aborted: {what}", what)
                    if what != version:
                        raise IntegrationError(f"refit round {round_id} committed version {what}, but this "
                                               f"update expected version {version}")
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise IntegrationError(f"refit round {round_id} (version {version}) did not end here within "
                                           f"{timeout:g} s")
                self._cv.wait(left)

    # The refit worker's callbacks.
    def on_prepare(self, version: int, round_id: Optional[int] = None) -> None:
        deadline = time.monotonic() + self._prepare_wait_s
        with self._cv:
            if round_id is not None:
                self._latest = round_id
            while True:
                if round_id is not None and round_id in self._over:
                    # Raising refuses the round (the worker answers nothing to one that is over).
                    raise RuntimeError(f"refit round {round_id} (version {version}) ended before the "
                                       "engine's update window opened")
                if self._open:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    if round_id is not None:
                        self._remember(self._over, round_id, None)
                    # Raising refuses the round: its text reaches the operator.
                    raise RuntimeError("the engine is serving, not inside a weight update "
                                       f"(no start of an update within {self._prepare_wait_s:g} s)")
                self._cv.wait(left)
            self._prepared, self._round, self._outcome = version, round_id, None
            self._cv.notify_all()

    def on_commit(self, version: int, round_id: Optional[int] = None) -> None:
        self._ended(("COMMIT", version), round_id)

    def on_abort(self, reason: str, round_id: Optional[int] = None) -> None:
        self._ended(("ABORT", reason), round_id)

    def on_round_end(self, round_id: int) -> None:
        """The worker learnt that round `round_id` ended: a PREPARE of it waiting for the window
        gives up now."""
        with self._cv:
            self._latest = round_id
            self._remember(self._over, round_id, None)
            self._cv.notify_all()

    def _ended(self, end: Tuple[str, Any], round_id: Optional[int]) -> None:
        with self._cv:
            if end[0] == "COMMIT":
                self.committed_version = end[1]
            if self._is_outcome(round_id):
                self._outcome = end
            else:
                log.debug("refit round %s ended (%s %s), but this update is not its", round_id, *end)
            if round_id is not None:
                self._remember(self._over, round_id, None)
                self._remember(self._ends, round_id, end)
            self._cv.notify_all()

    def _is_outcome(self, round_id: Optional[int]) -> bool:  # _cv held
        """Whether an end of round `round_id` ends the update in this window."""
        if round_id is None or round_id == self._round:
            return True
        # Before a round prepared this engine, one that aborted at once (before its PREPARE got
        # here) ends the update, unless it was over before the update began.
        return self._prepared is None and self._open and round_id not in self._stale

    def _last_abort(self) -> str:  # _cv held
        last = self._over_at_enter
        end = self._ends.get(last) if last is not None else None
        if end is None or end[0] != "ABORT" or last != self._latest:
            return ""
        return f"; the last round here, {last}, had aborted before this update began: {end[1]}"

    def _remember(self, table: "collections.OrderedDict[int, Any]", round_id: int, value: Any) -> None:
        table[round_id] = value
        table.move_to_end(round_id)
        while len(table) > self._REMEMBERED_ROUNDS:
            table.popitem(last=False)


def group_version(controller: Any, group: str) -> int:
    """The group's committed version (0 before the first round)."""
    g = controller.group(group)
    return int(g.get("version", 0)) if g else 0


def open_watch(controller: Any, group: str, timeout: float) -> Any:
    """A round stream requested now (Controller.open_watch); a controller without it (an older
    client, a test's fake) gets its lazy watch()."""
    opener = getattr(controller, "open_watch", None)
    if callable(opener):
        return opener(group, timeout=timeout)
    return _LazyWatch(controller.watch(group, timeout=timeout))


class _LazyWatch:
    def __init__(self, events: Iterable[Any]) -> None:
        self._events = events

    def __iter__(self) -> Iterator[Any]:
        return iter(self._events)

    def close(self) -> None:
        closer = getattr(self._events, "close", None)
        if callable(closer):
            closer()


def wait_group_version_above(controller: Any, group: str, floor: int, timeout: float,
                             recheck_s: float = 0.5) -> int:
    """Waits until `group` has committed a version above `floor`; returns it. Woken by the
    round's COMMITTED event on the coordinator's watch stream, not by polling (a 50 ms poll added
    25 ms to every sync on average). A watch replays nothing, so the stream is opened first and
    the version read after it: a commit that landed before the stream was open is seen at once.
    The version is read again every `recheck_s` all the same, since the daemon may take the
    stream after the read."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        stream = None
        try:
            stream = open_watch(controller, group, max(0.01, min(recheck_s, left)))
            v = group_version(controller, group)
            if v > floor:
                return v
            if left <= 0:
                raise IntegrationError(f"group {group!r} committed no version above {floor} within {timeout:g} s")
            for event in stream:
                if event.committed and event.version > floor:
                    return int(event.version)
        except IntegrationError:
            raise
        except _RefitRoot:
            # The daemon refused the stream (its watch slots are capped, per caller and in all):
            # read the version again shortly instead.
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        finally:
            if stream is not None:
                stream.close()


# Words of the daemons' not-ready reasons that waiting does not change: two registered workers
# that contradict each other (a tensor's shape or dtype, a declared rank or world size) stay
# so until one of them leaves and registers again.
_CONFLICT_WORDS = ("disagree on", "both claim", "declares no rank, while", "in the source layout but")
_CONFLICT_RANK = re.compile(r"declares rank -?\d+ of \d+")
# How long such a reason must last before a wait gives up on it: a worker whose process died
# still counts until its daemon notices (about two seconds), and its successor may conflict
# with it meanwhile.
CONFLICT_SETTLE_S = 5.0
WAITING_LOG_AFTER_S = 2.0


def cannot_resolve_by_waiting(reason: str) -> bool:
    """Whether a group's not-ready reason names a conflict between registered workers."""
    return any(w in reason for w in _CONFLICT_WORDS) or _CONFLICT_RANK.search(reason) is not None


def wait_ready(controller: Any, group: str, timeout: float, settle_s: float = CONFLICT_SETTLE_S) -> Any:
    """controller.wait_ready(group, timeout), except that a reason waiting cannot resolve (two
    registered workers in conflict: cannot_resolve_by_waiting) ends the wait once it lasted
    `settle_s`, with an IntegrationError quoting it, and that a wait still going after a couple
    of seconds is logged with its reason."""
    from refit.errors import RefitTimeout
    started = time.monotonic()
    deadline = started + timeout
    conflict_since: Optional[float] = None
    logged = False
    while True:
        left = deadline - time.monotonic()
        try:
            return controller.wait_ready(group, timeout=max(0.05, min(left, 0.5)))
        except RefitTimeout as e:
            now = time.monotonic()
            reason = str(e).split(" s: ", 1)[-1]  # the daemon's words, without the slice's wait
            if now >= deadline:
                raise RefitTimeout(f"group {group!r} not ready after {timeout:g} s: {reason}") from None
            if not cannot_resolve_by_waiting(reason):
                conflict_since = None
            elif conflict_since is None:
                conflict_since = now
            elif now - conflict_since >= settle_s:
                raise IntegrationError(f"group {group!r} is not ready, and waiting will not make it so: "
                                       f"{reason} (unchanged for {now - conflict_since:.0f} s; fix the "
                                       "registration named and register again)") from None
            if not logged and now - started >= WAITING_LOG_AFTER_S:
                log.warning("waiting up to %.0f s more for group %r to be ready: %s", deadline - now, group, reason)
                logged = True


_ENDED = ("COMMITTED", "ABORTED")


def _ended_in_log(controller: Any, group: str, round_id: int) -> Optional[Any]:
    """The round's RoundResult from the coordinator's round log once it ended, else None."""
    for r in controller.rounds(group, limit=16):
        if r.round_id == round_id and r.state in _ENDED:
            return r
    return None


def wait_round_end(controller: Any, group: str, round_id: int, timeout: float, stream: Any = None,
                   recheck_s: float = 0.5) -> Any:
    """Waits until round `round_id` of `group` ended (COMMITTED or ABORTED) and returns its
    RoundResult. `stream`: a watch opened (Controller.open_watch) before the round started, so
    that none of its events can be missed; the round log is read once the stream is open, for a
    round that ended before. Raises IntegrationError when it did not end within `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            if stream is None:
                stream = open_watch(controller, group, max(0.01, min(recheck_s, left)))
            ended = _ended_in_log(controller, group, round_id)
            if ended is not None:
                return ended
            if left <= 0:
                raise IntegrationError(f"round {round_id} of group {group!r} did not end within {timeout:g} s")
            for event in stream:
                if event.round_id == round_id and event.state in _ENDED:
                    return event
        except IntegrationError:
            raise
        except _RefitRoot:  # a refused stream, as in wait_group_version_above
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        finally:
            if stream is not None:
                stream.close()
                stream = None


class StagedTrainer:
    """A trainer for stacks that hand the sync step a stream of full tensors `(HF name, tensor)`
    (verl's and NeMo-RL's checkpoint engines): refit cannot reach the live shards behind that
    stream, so the first round allocates one buffer per tensor (CUDA: on the tensor's device;
    CPU: in one shared-memory arena), registers them as a trainer worker holding full replicas,
    and every round copies the stream into them and runs one refit round. The engines still
    receive straight into their live weights; what this replaces is the stack's broadcast."""

    def __init__(self, daemon: str, group: str, control: str, *, node: int = 0,
                 worker_name: str = "staged-trainer", timeout_s: float = 120.0,
                 register_timeout_s: float = 30.0) -> None:
        self.daemon, self.group, self.control, self.node = daemon, group, control, node
        self.worker_name, self.timeout_s, self.register_timeout_s = worker_name, timeout_s, register_timeout_s
        self._buffers: Optional[Dict[str, Any]] = None
        self._arena: Any = None
        self._worker: Any = None
        self._controller: Any = None
        self.last_version = 0
        self.last_result: Any = None

    @property
    def controller(self) -> Any:
        if self._controller is None:
            import refit
            self._controller = refit.Controller(self.control)
        return self._controller

    def _allocate(self, tensors: List[Tuple[str, Any]]) -> Dict[str, Any]:
        import refit
        import torch
        buffers: Dict[str, Any] = {}
        cpu = [(n, t) for n, t in tensors if t.device.type == "cpu"]
        if cpu:
            nbytes = sum(t.numel() * t.element_size() + 256 for _, t in cpu)
            self._arena = refit.SharedArena(max(nbytes, 1), name="refit-staging")
        for name, t in tensors:
            if name in buffers:
                raise IntegrationError(f"the weight stream names {name!r} twice")
            if t.device.type == "cpu":
                buffers[name] = self._arena.empty(tuple(t.shape), t.dtype)
            else:
                buffers[name] = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
        return buffers

    def _register(self) -> None:
        import refit
        from refit.layouts import dtensor
        assert self._buffers is not None
        layout = dtensor.trainer_worker(self._buffers, rank=0, node=self.node, worker_name=self.worker_name)
        # The trainer side is this one worker: declared so, a stray second trainer is named.
        self._worker = refit.Worker(self.daemon, self.group, "trainer", layout, self._buffers,
                                    register_timeout=self.register_timeout_s, rank=0, world_size=1)

    def stage(self, weights: Iterable[Tuple[str, Any]]) -> int:
        """Copies the stream into the staging buffers (allocating and registering them the first
        time); returns the bytes staged."""
        import torch
        with torch.no_grad():
            if self._buffers is None:
                held = [(name, t.detach()) for name, t in weights]
                self._buffers = self._allocate(held)
                pairs: Iterable[Tuple[str, Any]] = held
            else:
                pairs = weights
            seen = set()
            nbytes = 0
            for name, t in pairs:
                buf = self._buffers.get(name)
                if buf is None:
                    raise IntegrationError(f"the weight stream has {name!r}, which the first round did not "
                                           "have (the tensors a trainer sends must not change between rounds)")
                if tuple(buf.shape) != tuple(t.shape) or buf.dtype != t.dtype:
                    raise IntegrationError(f"{name!r} is {tuple(t.shape)} {t.dtype} now, but was "
                                           f"{tuple(buf.shape)} {buf.dtype} in the first round")
                buf.copy_(t)
                seen.add(name)
                nbytes += t.numel() * t.element_size()
            missing = sorted(set(self._buffers) - seen)
            if missing:
                raise IntegrationError(f"the weight stream lacks {len(missing)} tensor(s) it had in the first "
                                       f"round: {', '.join(missing[:5])}")
            if any(b.device.type == "cuda" for b in self._buffers.values()):
                torch.cuda.synchronize()
        if self._worker is None:
            self._register()
        return nbytes

    def round(self, version: Optional[int] = None) -> int:
        """One refit round of the staged tensors; returns its version."""
        ctl = self.controller
        ctl.wait_ready(self.group, timeout=self.timeout_s)
        v = version if version is not None else max(group_version(ctl, self.group), self.last_version) + 1
        self.last_result = ctl.refit(self.group, v, timeout=self.timeout_s)
        self.last_version = v
        return v

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._controller is not None:
            self._controller.close()
            self._controller = None


class StagedSync:
    """What verl's and NeMo-RL's checkpoint engines share: a controller made at first use, the
    sending rank's StagedTrainer, and a rollout rank's wait for the next committed version.
    `config` names where the user sets control and daemon, for errors (e.g. "engine_kwargs.refit")."""

    def __init__(self, *, control: str, daemon: str, group: str, node: int, timeout_s: float,
                 config: str) -> None:
        self.control, self.daemon, self.group, self.node = control, daemon, group, node
        self.timeout_s, self.config = timeout_s, config
        self.staged: Optional[StagedTrainer] = None
        self._controller: Any = None
        self.seen = 0  # rollout side: the last version this rank saw committed

    @property
    def committed_version(self) -> int:
        """The version the sending rank's last sync committed (0: none yet, or not the sending rank)."""
        return self.staged.last_version if self.staged is not None else 0

    def controller(self) -> Any:
        if self._controller is None:
            import refit
            if not self.control:
                raise IntegrationError(f"{self.config}.control is empty: give a refitd control address "
                                       "('host:port') or set $REFIT_CONTROL")
            self._controller = refit.Controller(self.control)
        return self._controller

    def start_sender(self) -> None:
        """The sending rank: its staged trainer, made once (kept across syncs: its buffers are the
        next sync's too)."""
        if self.staged is not None:
            return
        if not self.daemon:
            raise IntegrationError(f"{self.config}.daemon is empty: give this host's refitd worker socket "
                                   "('unix:/path') or set $REFIT_DAEMON")
        self.controller()
        self.staged = StagedTrainer(self.daemon, self.group, self.control, node=self.node,
                                    timeout_s=self.timeout_s)

    def start_receiver(self) -> None:
        self.seen = group_version(self.controller(), self.group)

    async def send(self, weights: Iterable[Tuple[str, Any]], *, sending: bool, not_started: str) -> None:
        """Every trainer rank's weight stream: the sending rank stages it and runs one round; the
        others only consume it (its collectives run on every rank)."""
        if not sending:
            drain(weights)
            return
        if self.staged is None:
            raise IntegrationError(not_started)
        self.staged.stage(weights)
        await asyncio.to_thread(self.staged.round)

    async def wait_next(self) -> None:
        """A rollout rank: returns once a version above the last one it saw is committed."""
        floor = self.seen
        self.seen = await asyncio.to_thread(wait_group_version_above, self.controller(), self.group, floor,
                                            self.timeout_s)

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
            self.staged = None
        if self._controller is not None:
            self._controller.close()
            self._controller = None


def drain(weights: Iterable[Any]) -> int:
    """Consumes a weight stream (its collectives run on every rank); returns the items seen."""
    n = 0
    for _ in weights:
        n += 1
    return n


def named(params: Any) -> List[Tuple[str, Any]]:
    """(name, tensor) pairs of a module, a mapping or an iterable of pairs."""
    if hasattr(params, "named_parameters"):
        return list(params.named_parameters())
    if isinstance(params, Mapping):
        return list(params.items())
    return list(params)


def call_quietly(fn: Optional[Callable[[], Any]]) -> None:
    if fn is None:
        return
    try:
        fn()
    except Exception:  # noqa: BLE001 (cleanup on a path that already raises)
        log.exception("cleanup step failed")
