"""TLS to refitd over TCP (docs/SECURITY.md): a client certificate (an operator's to start
refits, a viewer's to read state) signed by the cluster's CA.

    tls = refit.TlsFiles("operator.pem", "operator.key", "ca.pem")
    refit.Controller("10.0.0.1:7070", tls=tls).refit("policy", version=7)

Without `tls`, $REFIT_TLS_CERT, $REFIT_TLS_KEY and $REFIT_TLS_CA are used when set (as refitctl
does). A daemon's unix socket is always plaintext: its file mode guards it.
"""
import os
from collections import namedtuple

import grpc

# Every daemon's certificate carries this DNS name; daemons are reached by IP address, so the
# name checked is the role (daemon/tls_config.h).
SERVER_NAME = "refitd"


class TlsFiles(namedtuple("TlsFiles", "cert key ca")):
    """PEM files: this client's certificate chain, its private key, the cluster's CA bundle."""

    @classmethod
    def from_env(cls):
        """From $REFIT_TLS_CERT/KEY/CA; None when none is set. ValueError when only some are."""
        names = ("REFIT_TLS_CERT", "REFIT_TLS_KEY", "REFIT_TLS_CA")
        values = [os.environ.get(n, "") for n in names]
        if not any(values):
            return None
        if not all(values):
            missing = [n for n, v in zip(names, values) if not v]
            raise ValueError(f"TLS needs all of {', '.join(names)}; missing {', '.join(missing)}")
        return cls(*values)

    def credentials(self):
        def read(path, what):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise ValueError(f"cannot read the TLS {what} {path}: {e.strerror}") from None
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca, "CA bundle"),
                                            private_key=read(self.key, "private key"),
                                            certificate_chain=read(self.cert, "certificate"))


def channel(address, tls=None, options=()):
    """A gRPC channel to a refitd at `address` ("host:port" or "unix:PATH"). `tls`: TlsFiles, or
    None for $REFIT_TLS_* (plaintext when those are unset too)."""
    options = list(options)
    if address.startswith("unix:"):
        return grpc.insecure_channel(address, options=options)
    tls = tls if tls is not None else TlsFiles.from_env()
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    options.append(("grpc.ssl_target_name_override", SERVER_NAME))
    return grpc.secure_channel(address, tls.credentials(), options=options)
