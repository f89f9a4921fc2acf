"""Optional mutual TLS on internal gRPC: each process's certificate and key, and the CA that signed
every internal peer. With it, a worker's gRPC server accepts only clients holding a certificate from
that CA, and internal clients (router, decode -> prefill, registries) verify the worker's certificate
against it (the certificate must name the address peers dial: an IP or DNS subjectAltName).

Public ports (the router's Generation API, the gateway) are not affected; health probes of a worker
then need a client certificate too. KV transfer connections do not use TLS (their handshake is
authenticated by the shared secret, see kvtransfer/protocol/handshake.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import grpc

from tandem.services.common.arg_groups import SECURITY
from tandem.services.common.flags import Flag, Owner


class TlsConfigError(ValueError):
    """The TLS files are incomplete or unreadable."""


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes                              # PEM certificate chain of this process
    key: bytes = field(repr=False)           # PEM private key
    ca: bytes = b""                          # PEM CA certificate(s) that signed every internal peer

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """All three paths, or none (None: plaintext internal gRPC)."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise TlsConfigError(f"mutual TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
        data = {}
        for flag, path in given.items():
            try:
                with open(path, "rb") as f:
                    data[flag] = f.read()
            except OSError as e:
                raise TlsConfigError(f"{flag}: cannot read {path}: {e.strerror}") from None
            if b"-----BEGIN" not in data[flag]:
                raise TlsConfigError(f"{flag}: {path} is not a PEM file")
        return cls(cert=data["--tls-cert"], key=data["--tls-key"], ca=data["--tls-ca"])

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


TLS_FLAGS = tuple(
    Flag((f"--tls-{name}",), Owner.WORKER | Owner.ROUTER, SECURITY, f"internal gRPC mutual TLS: {what}", metavar="PEM")
    for name, what in (
        ("cert", "this process's certificate (with --tls-key and --tls-ca; default: none, internal gRPC in "
                 "plaintext). Not used on public ports"),
        ("key", "this process's private key (default: none)"),
        ("ca", "the CA that signed every internal peer's certificate (default: none)")))


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    return TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca)

