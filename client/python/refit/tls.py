"""TLS to refitd over TCP (docs/SECURITY.md): a client certificate (an operator's to start
refits, a viewer's to read state) signed by the cluster's CA.

    tls = refit.TlsFiles("operator.pem", "operator.key", "ca.pem")
    refit.Controller("10.0.0.1:7070", tls=tls).refit("policy", version=7)

Without `tls`, $REFIT_TLS_CERT, $REFIT_TLS_KEY and $REFIT_TLS_CA are used when set (as refitctl
does). A daemon's unix socket is always plaintext: its file mode guards it.
"""
import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import grpc

from refit.errors import InvalidArgument

# Every daemon's certificate carries this DNS name; daemons are reached by IP address, so the
# name checked is the role (common/tls_config.h).
SERVER_NAME = "refitd"


class TlsFiles(NamedTuple):
    """PEM files: this client's certificate chain, its private key, the cluster's CA bundle."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_env(cls) -> Optional["TlsFiles"]:
        """From $REFIT_TLS_CERT/KEY/CA; None when none is set. InvalidArgument when only some are."""
        names = ("REFIT_TLS_CERT", "REFIT_TLS_KEY", "REFIT_TLS_CA")
        values = [os.environ.get(n, "") for n in names]
        if not any(values):
            return None
        if not all(values):
            missing = [n for n, v in zip(names, values) if not v]
            raise InvalidArgument(f"TLS needs all of {', '.join(names)}; missing {', '.join(missing)}")
        return cls(*values)

    def credentials(self) -> grpc.ChannelCredentials:
        """The gRPC credentials of these files (InvalidArgument naming a file that cannot be read)."""
        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise InvalidArgument(f"cannot read the TLS {what} {path}: {e.strerror}") from None
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca, "CA bundle"),
                                            private_key=read(self.key, "private key"),
                                            certificate_chain=read(self.cert, "certificate"))


def _secure(address: str, tls: Optional[TlsFiles]) -> Optional[TlsFiles]:
    """The TLS files to reach `address` with: None for a unix socket or when none are given."""
    if address.startswith("unix:"):
        return None
    return tls if tls is not None else TlsFiles.from_env()


def channel(address: str, tls: Optional[TlsFiles] = None,
            options: Sequence[Tuple[str, Any]] = ()) -> grpc.Channel:
    """A gRPC channel to a refitd at `address` ("host:port" or "unix:PATH"). `tls`: TlsFiles, or
    None for $REFIT_TLS_* (plaintext when those are unset too)."""
    options = list(options)
    files = _secure(address, tls)
    if files is None:
        return grpc.insecure_channel(address, options=options)
    options.append(("grpc.ssl_target_name_override", SERVER_NAME))
    return grpc.secure_channel(address, files.credentials(), options=options)


def aio_channel(address: str, tls: Optional[TlsFiles] = None,
                options: Sequence[Tuple[str, Any]] = ()) -> "grpc.aio.Channel":
    """channel() for asyncio (grpc.aio): made inside the event loop that uses it."""
    import grpc.aio
    options = list(options)
    files = _secure(address, tls)
    if files is None:
        return grpc.aio.insecure_channel(address, options=options)
    options.append(("grpc.ssl_target_name_override", SERVER_NAME))
    return grpc.aio.secure_channel(address, files.credentials(), options=options)
