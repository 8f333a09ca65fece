"""Handing file descriptors to the daemon: shared-memory files and CUDA VMM allocations.

Memory is never named by a worker: the worker sends the descriptors themselves over the daemon's
handle socket (`<worker socket>.handles`, a unix SOCK_SEQPACKET socket; SCM_RIGHTS), under a
random token, and then registers with that token. Each packet carries 44 bytes: b"RFH1", the
token as 32 hex characters, the number of descriptors attached (little-endian uint32, at most
250), and flags (uint32, bit 0: the delivery's last packet). The daemon answers b"OK\\0\\0" and
the total count, or b"ER\\0\\0", a length and a message. daemon/README.md has the daemon's side.
"""
import os
import secrets
import socket
import struct
from typing import Iterable, Optional

MAGIC = b"RFH1"
MAX_FDS_PER_PACKET = 250


from refit.errors import HandoverError  # noqa: E402  (re-exported)


def handle_socket_path(daemon_address: str) -> Optional[str]:
    """The handle socket of a daemon reached at "unix:/path/to.sock" (None for TCP addresses)."""
    if daemon_address.startswith("unix:"):
        path = daemon_address[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        return path + ".handles"
    return None


def deliver(path: str, fds: Iterable[int], timeout: float = 10.0) -> str:
    """Sends `fds` (ints, still owned by the caller) to the daemon's handle socket at `path`;
    returns the token to register with."""
    token = secrets.token_hex(16).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except OSError as e:
            raise HandoverError(f"cannot reach the daemon's handle socket {path}: {e} (is refitd "
                                "running, and new enough to take file descriptors?)", transient=True) from e
        fds = list(fds)
        batches = [fds[i:i + MAX_FDS_PER_PACKET] for i in range(0, len(fds), MAX_FDS_PER_PACKET)] or [[]]
        try:
            for i, batch in enumerate(batches):
                last = 1 if i == len(batches) - 1 else 0
                header = MAGIC + token + struct.pack("<II", len(batch), last)
                if batch:
                    socket.send_fds(sock, [header], batch)
                else:
                    sock.send(header)
        except OSError as e:  # refused mid-delivery: its answer, if any, says why
            try:
                reply = sock.recv(4096)
            except OSError:
                reply = b""
            if not reply:
                raise HandoverError(f"the daemon closed its handle socket {path} during the delivery: {e}",
                                    transient=True) from e
        else:
            reply = sock.recv(4096)
    except socket.timeout as e:
        raise HandoverError(f"the daemon's handle socket {path} did not answer within {timeout} s",
                            transient=True) from e
    except OSError as e:  # reset or closed by a daemon that is stopping or restarting
        raise HandoverError(f"the daemon's handle socket {path} failed: {e}", transient=True) from e
    finally:
        sock.close()
    if reply[:4] == b"OK\0\0" and len(reply) >= 8:
        (count,) = struct.unpack("<I", reply[4:8])
        if count != len(fds):
            raise HandoverError(f"the daemon received {count} of {len(fds)} file descriptors")
        return token.decode()
    if reply[:4] == b"ER\0\0" and len(reply) >= 8:
        (n,) = struct.unpack("<I", reply[4:8])
        message = reply[8:8 + n].decode(errors="replace")
        # A daemon with too many deliveries in flight or waiting says so; those clear by themselves.
        transient = message.startswith("busy") or "already waiting" in message
        raise HandoverError(f"the daemon refused the handles: {message}", transient=transient)
    raise HandoverError(f"unexpected answer from the daemon's handle socket {path}: {reply[:16]!r}")


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
