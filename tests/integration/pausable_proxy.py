"""A TCP proxy for partition tests: it forwards connections and, on the test's word, holds the
bytes of one direction or both (the connection stays open, as in a network partition: nothing
arrives, nothing is refused), lets them go again, or resets the connections.

Two ways in:
- a fixed target (`PausableProxy(target="127.0.0.1:7070")`): point a client at `proxy.address`;
- HTTP CONNECT (`PausableProxy()`): a process whose environment has
  `grpc_proxy=http://<proxy.address>` sends every gRPC channel to a TCP address through it
  (gRPC's own proxy support), each connection naming its target in its CONNECT line. A daemon
  started so has its calls to every peer proxied without any flag of its own.

Rules are per target (`"host:port"`, or None for every target) and hold for the connections open
now and those opened later (gRPC reconnects). A trigger (`pause_on`) pauses when a byte pattern
passes, so that a test partitions at an exact message (a phase call of a round, say) instead of
guessing its time; the chunk that carries the pattern is the first one held.
"""
from __future__ import annotations

import collections
import enum
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Deque, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Union

CONNECT_HEADER_LIMIT = 8192
CONNECT_READ_DEADLINE_S = 5.0
# Bytes kept from the previous chunk, so that a pattern split over two reads matches (a regex must
# match within this many bytes).
PATTERN_TAIL = 256


class Direction(enum.Enum):
    TO_TARGET = "to target"   # from the connecting client to the target
    TO_CLIENT = "to client"   # the target's answers

    def __str__(self) -> str:
        return self.value


BOTH: FrozenSet[Direction] = frozenset(Direction)


class ProxyError(RuntimeError):
    pass


def _split(address: str) -> tuple:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ProxyError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


@dataclass
class _Trigger:
    pattern: "re.Pattern[bytes]"
    direction: Direction
    target: Optional[str]
    rules: Optional[List[Tuple[Optional[str], FrozenSet[Direction]]]]  # None: BOTH, the matched target
    fired_at: Optional[float] = None
    fired: threading.Event = field(default_factory=threading.Event)


class _Pipe:
    """One direction of one connection: a reader that never blocks on the writer (held bytes
    queue up), and a writer that sends while the direction is not paused."""

    def __init__(self, conn: "_Connection", direction: Direction, src: socket.socket, dst: socket.socket):
        self.conn, self.direction, self.src, self.dst = conn, direction, src, dst
        self.queue: Deque[Optional[bytes]] = collections.deque()  # None: the source closed
        self.tail = b""
        self.forwarded = 0

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name=f"proxy-read {self.direction}").start()
        threading.Thread(target=self._write, daemon=True, name=f"proxy-write {self.direction}").start()

    def _read(self) -> None:
        proxy = self.conn.proxy
        while True:
            try:
                chunk = self.src.recv(65536)
            except OSError:
                chunk = b""
            with proxy.cv:
                if chunk:
                    proxy.fire_triggers(self, self.tail + chunk)
                    self.tail = (self.tail + chunk)[-PATTERN_TAIL:]
                self.queue.append(chunk or None)
                proxy.cv.notify_all()
            if not chunk:
                return

    def _write(self) -> None:
        proxy = self.conn.proxy
        while True:
            with proxy.cv:
                proxy.cv.wait_for(lambda: self.conn.closed or (self.queue and not proxy.paused(self)))
                if self.conn.closed:
                    return
                chunk = self.queue.popleft()
            if chunk is None:
                try:
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.conn.half_closed(self)
                return
            try:
                self.dst.sendall(chunk)
                self.forwarded += len(chunk)
            except OSError:
                self.conn.close(reset=True)
                return

    def held(self) -> int:
        return sum(len(c) for c in self.queue if c)


class _Connection:
    def __init__(self, proxy: "PausableProxy", client: socket.socket, upstream: socket.socket, target: str):
        self.proxy, self.client, self.upstream, self.target = proxy, client, upstream, target
        self.closed = False
        self._ended: Set[Direction] = set()
        self.pipes = {Direction.TO_TARGET: _Pipe(self, Direction.TO_TARGET, client, upstream),
                      Direction.TO_CLIENT: _Pipe(self, Direction.TO_CLIENT, upstream, client)}

    def start(self) -> None:
        for p in self.pipes.values():
            p.start()

    def half_closed(self, pipe: _Pipe) -> None:
        with self.proxy.cv:
            self._ended.add(pipe.direction)
            done = self._ended == set(Direction)
        if done:
            self.close()

    def close(self, reset: bool = False) -> None:
        with self.proxy.cv:
            if self.closed:
                return
            self.closed = True
            self.proxy.cv.notify_all()
        for s in (self.client, self.upstream):
            try:
                if reset:  # an RST, not a FIN: the peer sees the connection fail
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # Wakes this connection's reader blocked in recv() (close() alone would not), and
                # sends nothing: the RST or FIN goes when the socket is released.
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            s.close()


class PausableProxy:
    """See the module's docstring. Every method is safe to call from any thread."""

    def __init__(self, target: Optional[str] = None, listen: str = "127.0.0.1:0"):
        self.fixed_target = target
        if target is not None:
            _split(target)
        self.cv = threading.Condition()
        self._paused: Dict[Optional[str], Set[Direction]] = {}  # target (None: all) -> directions
        self._triggers: List[_Trigger] = []
        self._connections: List[_Connection] = []
        self._listener = socket.create_server(_split(listen))
        self.address = "%s:%d" % self._listener.getsockname()[:2]
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    # -- control -------------------------------------------------------------------------------

    def pause(self, directions=BOTH, target: Optional[str] = None) -> None:
        """Holds the bytes of `directions` (a Direction or a set) on connections to `target`
        (None: every target), those open now and those opened later, until resume()."""
        with self.cv:
            self._paused.setdefault(target, set()).update(self._as_set(directions))
            self.cv.notify_all()

    def resume(self, directions=BOTH, target: Optional[str] = None) -> None:
        """Lets the held bytes of `directions` go, in order, and forwards them again, on
        connections to `target` (None: every target, whatever rule held them)."""
        lifted = self._as_set(directions)
        with self.cv:
            for key, paused in self._paused.items():
                if target is None or key == target:
                    paused.difference_update(lifted)
            self.cv.notify_all()

    def pause_on(self, pattern: Union[bytes, "re.Pattern[bytes]"], direction: Direction = Direction.TO_TARGET, target: Optional[str] = None,
                 rules: Optional[Sequence[Tuple[Optional[str], object]]] = None) -> _Trigger:
        """Once: when `pattern` (bytes, or a compiled bytes regex) passes in `direction` on a connection to `target` (None: any),
        applies `rules`, each (target, directions) as pause() takes them, all at once and before
        the chunk carrying the pattern is queued (default: both directions of the connection's
        target). Returns the trigger: `fired` (an Event), `fired_at` (time.monotonic())."""
        if isinstance(pattern, bytes):
            if not pattern or len(pattern) > PATTERN_TAIL:
                raise ProxyError(f"pause_on takes a pattern of 1 to {PATTERN_TAIL} bytes, not {len(pattern)}")
            pattern = re.compile(re.escape(pattern))
        if not isinstance(pattern, re.Pattern) or not isinstance(pattern.pattern, bytes):
            raise ProxyError(f"pause_on takes bytes or a compiled bytes regex, not {pattern!r}")
        checked = None if rules is None else [(t, frozenset(self._as_set(d))) for t, d in rules]
        trigger = _Trigger(pattern, direction, target, checked)
        with self.cv:
            self._triggers.append(trigger)
        return trigger

    def cancel_triggers(self) -> None:
        with self.cv:
            self._triggers.clear()

    def cut(self, target: Optional[str] = None) -> int:
        """Resets the connections to `target` (None: all), their held bytes dropped. Returns how
        many it reset. Rules stay: resume() separately."""
        with self.cv:
            victims = [c for c in self._connections if not c.closed and target in (None, c.target)]
        for c in victims:
            c.close(reset=True)
        return len(victims)

    def connections(self, target: Optional[str] = None) -> List[_Connection]:
        with self.cv:
            return [c for c in self._connections if not c.closed and target in (None, c.target)]

    def held_bytes(self, target: Optional[str] = None) -> int:
        with self.cv:
            return sum(p.held() for c in self._connections if target in (None, c.target) for p in c.pipes.values())

    def close(self) -> None:
        self._stopped = True
        try:
            self._listener.close()
        except OSError:
            pass
        self.cut()

    def __enter__(self) -> "PausableProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _as_set(directions) -> Set[Direction]:
        if isinstance(directions, Direction):
            return {directions}
        out = set(directions)
        if not out or not all(isinstance(d, Direction) for d in out):
            raise ProxyError(f"directions must be Direction values, not {directions!r}")
        return out

    def paused(self, pipe: _Pipe) -> bool:
        """Under self.cv."""
        return pipe.direction in self._paused.get(pipe.conn.target, ()) or pipe.direction in self._paused.get(None, ())

    def fire_triggers(self, pipe: _Pipe, window: bytes) -> None:
        """Under self.cv: before `pipe` queues the chunk that ends `window`."""
        for t in list(self._triggers):
            if t.direction == pipe.direction and t.target in (None, pipe.conn.target) and t.pattern.search(window):
                for target, directions in t.rules if t.rules is not None else [(pipe.conn.target, BOTH)]:
                    self._paused.setdefault(target, set()).update(directions)
                t.fired_at = time.monotonic()
                t.fired.set()
                self._triggers.remove(t)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._open, args=(client,), daemon=True, name="proxy-open").start()

    def _open(self, client: socket.socket) -> None:
        try:
            early = b""
            target = self.fixed_target
            if target is None:
                target, early = self._read_connect(client)
            upstream = socket.create_connection(_split(target), timeout=CONNECT_READ_DEADLINE_S)
            upstream.settimeout(None)
            if self.fixed_target is None:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        except (OSError, ProxyError) as e:
            if self.fixed_target is None:
                try:
                    client.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n" + str(e).encode()[:200])
                except OSError:
                    pass
            client.close()
            return
        conn = _Connection(self, client, upstream, target)
        with self.cv:
            if self._stopped:
                conn.close(reset=True)
                return
            self._connections = [c for c in self._connections if not c.closed] + [conn]
            if early:
                pipe = conn.pipes[Direction.TO_TARGET]
                self.fire_triggers(pipe, early)
                pipe.tail = early[-PATTERN_TAIL:]
                pipe.queue.append(early)
        conn.start()

    @staticmethod
    def _read_connect(client: socket.socket) -> tuple:
        """The CONNECT request's target, and any bytes the client sent after its header."""
        client.settimeout(CONNECT_READ_DEADLINE_S)
        data = b""
        while b"\r\n\r\n" not in data:
            if len(data) > CONNECT_HEADER_LIMIT:
                raise ProxyError(f"a CONNECT header longer than {CONNECT_HEADER_LIMIT} bytes")
            chunk = client.recv(4096)
            if not chunk:
                raise ProxyError("the client closed before its CONNECT header ended")
            data += chunk
        client.settimeout(None)
        header, _, rest = data.partition(b"\r\n\r\n")
        words = header.split(b"\r\n", 1)[0].split()
        if len(words) != 3 or words[0] != b"CONNECT":
            raise ProxyError(f"not a CONNECT request: {header[:80]!r}")
        target = words[1].decode("ascii", "replace")
        _split(target)
        return target, rest
