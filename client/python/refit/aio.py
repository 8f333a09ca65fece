"""The controller for asyncio (Ray actors, async RL loops): the same calls as refit.Controller,
as coroutines, over grpc.aio, so that a round in flight holds no thread.

    async with refit.aio.Controller("127.0.0.1:7070") as ctl:
        await ctl.wait_ready("policy", timeout=30)
        stats = await ctl.refit("policy", version=step)
        async for event in ctl.watch("policy", timeout=60):
            print(event.state, event.version)

Failures raise the same exceptions as refit.Controller (RefitError, RefitTimeout, ...). The gRPC
channel is made on first use, inside the event loop that runs the calls: use one Controller
from one loop.
"""
import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import grpc

from refit import _rpc
from refit._proto import refit_pb2
from refit.controller import (MAX_RECEIVE, NOT_READY, RoundResult, as_dict, error_from,
                              explain_not_ready, group_of, ready_wait_error, refit_request, trainer_names,
                              version_of, wants_trainer_names)
from refit.errors import InvalidArgument, RefitError
from refit.tls import TlsFiles, aio_channel

__all__ = ["Controller"]


class Controller:
    def __init__(self, address: str, timeout: float = 10.0, tls: Optional[TlsFiles] = None) -> None:
        """As refit.Controller: `address` any refitd's "host:port" (or "unix:PATH"); calls other
        than refit() end within `timeout` seconds; `tls` as there."""
        self.address, self.timeout, self._tls = address, timeout, tls
        self._channel: Any = None
        self._stub_: Optional[_rpc.Stub] = None

    def _stub(self) -> _rpc.Stub:
        if self._stub_ is None:
            self._channel = aio_channel(self.address, self._tls, options=MAX_RECEIVE)
            self._stub_ = _rpc.Stub(self._channel, "RefitControl")
        return self._stub_

    async def _call(self, method: str, request: Any, timeout: Optional[float] = None) -> Any:
        try:
            return await getattr(self._stub(), method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise error_from(e) from None

    async def _explain(self, group: str, reason: str,
                       status: Optional[Dict[str, Any]]) -> Tuple[str, Optional[str]]:
        trainers = None
        if wants_trainer_names(reason, status):
            try:
                trainers = trainer_names(await self.workers(group), group)
            except RefitError:  # the explanation is a bonus: the daemon's own reason stands
                pass
        return explain_not_ready(group, reason, status, trainers)

    async def _explained(self, group: str, e: RefitError) -> RefitError:
        if e.code != grpc.StatusCode.FAILED_PRECONDITION or not NOT_READY.search(e.reason):
            return e
        try:
            status = await self.group(group)
        except RefitError:
            return e
        reason, culprit = await self._explain(group, e.reason, status)
        return e if reason == e.reason and culprit is None else RefitError(e.code, reason, None, culprit or e.culprit)

    async def refit(self, group: str, version: int, timeout: float = 120.0) -> RoundResult:
        """Runs one round of `group` to `version`; returns the committed round's RoundResult,
        raises RefitError (phase, culprit) when it aborted or was refused."""
        request = refit_request(group, version)
        try:
            stats = await self._call("Refit", request, timeout)
        except RefitError as e:
            raise await self._explained(group, e) from None
        return RoundResult(stats)

    async def start_refit(self, group: str, version: int) -> int:
        """Starts a round and returns its id at once; watch() reports how it ends."""
        request = refit_request(group, version)
        try:
            return int((await self._call("StartRefit", request)).round_id)
        except RefitError as e:
            raise await self._explained(group, e) from None

    async def watch(self, group: str = "", timeout: Optional[float] = None) -> AsyncIterator[RoundResult]:
        """`async for event in ctl.watch(...)`: a RoundResult for every round state change of
        `group` (empty: all) published once the daemon opened the stream; nothing is replayed
        (refit.Controller.watch). Ends after `timeout` seconds if given; leaving the loop early
        ends the stream."""
        call = self._stub().WatchRounds(refit_pb2.WatchRoundsRequest(group=group), timeout=timeout)
        try:
            async for stats in call:
                yield RoundResult(stats)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise error_from(e) from None
        finally:
            call.cancel()

    async def rounds(self, group: str = "", limit: int = 100) -> List[RoundResult]:
        """The most recent rounds of `group` (empty: all), oldest first (refit.Controller.rounds)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise InvalidArgument(f"limit must be a positive integer, not {limit!r}")
        r = await self._call("ListRounds", refit_pb2.ListRoundsRequest(group=group, limit=limit))
        return [RoundResult(s) for s in r.rounds]

    async def status(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        return as_dict(await self._call("Status", refit_pb2.StatusRequest(), timeout))

    async def group(self, name: str, timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
        return group_of(await self.status(timeout), name)

    async def committed_version(self, group: str) -> int:
        """The last version committed to `group` (refit.Controller.committed_version)."""
        return version_of(group, await self.group(group))

    async def next_version(self, group: str) -> int:
        """committed_version() + 1: the smallest version the next round may take
        (refit.Controller.next_version)."""
        return await self.committed_version(group) + 1

    async def workers(self, group: str = "") -> List[Dict[str, Any]]:
        r = await self._call("ListWorkers", refit_pb2.ListWorkersRequest(group=group))
        return [as_dict(w) for w in r.workers]

    async def plan(self, group: str) -> Dict[str, Any]:
        return as_dict(await self._call("GetPlan", refit_pb2.GetPlanRequest(group=group)))

    async def wait_ready(self, group: str, timeout: float = 30.0) -> Dict[str, Any]:
        """Waits until `group` is ready to refit; returns its status. RefitTimeout after
        `timeout` seconds, naming what is missing."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            g = None
            try:
                g = await self.group(group, timeout=max(0.05, min(self.timeout, left)))
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
                raise ready_wait_error(group, timeout, (await self._explain(group, last, g))[0] if g else last)
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_ = None, None

    async def __aenter__(self) -> "Controller":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
