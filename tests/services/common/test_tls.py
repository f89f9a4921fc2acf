"""Internal gRPC over mutual TLS: a real grpc.aio server on 127.0.0.1 with a throwaway CA; a client
without a certificate, or with one from another CA, cannot even complete the handshake."""

from __future__ import annotations

import grpc
import pytest

from tandem.services.common.auth import InternalAuth
from tandem.services.common.tls import TlsConfigError, TlsFiles
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.services.common.conftest import arun
from tests.services.common.test_auth import TOKEN, _Identity
from tests.services.common.tls_certs import make_ca, make_cert, needs_openssl

pytestmark = [pytest.mark.timeout(60), needs_openssl]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = make_ca(d, "ca"), make_ca(d, "rogue-ca")

    def files(cert, ca_pem) -> TlsFiles:
        return TlsFiles.load(str(cert[0]), str(cert[1]), str(ca_pem))

    return {"server": files(make_cert(d, ca, "server"), ca[0]), "client": files(make_cert(d, ca, "client"), ca[0]),
            "rogue": files(make_cert(d, rogue, "rogue"), rogue[0]), "paths": (d, ca)}


async def _ask(server_auth: InternalAuth, client) -> grpc.StatusCode:
    server = grpc.aio.server(interceptors=[server_auth.server_interceptor()])
    worker_pb2_grpc.add_WorkerIdentityServicer_to_server(_Identity(), server)
    port = server_auth.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        async with client(f"127.0.0.1:{port}") as channel:
            try:
                await worker_pb2_grpc.WorkerIdentityStub(channel).GetWorkerInfo(worker_pb2.WorkerInfoRequest(),
                                                                                timeout=5)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                return e.code()
    finally:
        await server.stop(0)


def test_only_a_client_with_a_certificate_from_the_ca_gets_through(pki):
    server = InternalAuth(TOKEN, tls=pki["server"])
    good = InternalAuth(TOKEN, tls=pki["client"])
    assert arun(_ask(server, good.channel)) == grpc.StatusCode.OK
    assert arun(_ask(server, InternalAuth(TOKEN).channel)) == grpc.StatusCode.UNAVAILABLE      # plaintext
    assert arun(_ask(server, InternalAuth(TOKEN, tls=pki["rogue"]).channel)) == grpc.StatusCode.UNAVAILABLE
    # TLS does not replace the secret: a certificate without it is still UNAUTHENTICATED.
    assert arun(_ask(server, InternalAuth(None, tls=pki["client"]).channel)) == grpc.StatusCode.UNAUTHENTICATED


def test_incomplete_or_unreadable_tls_files_are_clear_errors(pki, tmp_path):
    d, ca = pki["paths"]
    assert TlsFiles.load(None, None, None) is None
    with pytest.raises(TlsConfigError, match="missing --tls-ca"):
        TlsFiles.load(str(d / "server.pem"), str(d / "server.key"), None)
    (tmp_path / "junk").write_text("not a certificate")
    with pytest.raises(TlsConfigError, match="not a PEM"):
        TlsFiles.load(str(d / "server.pem"), str(d / "server.key"), str(tmp_path / "junk"))
    with pytest.raises(TlsConfigError, match="cannot read"):
        TlsFiles.load(str(d / "server.pem"), str(tmp_path / "nope"), str(ca[0]))
    assert "PRIVATE KEY" not in repr(pki["server"])
