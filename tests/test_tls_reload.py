"""Certificate rotation without a restart, over real gRPC between real service processes.

The files are published as kubelet publishes a projected Secret: each version in its own directory,
`..data` a symlink swapped atomically to the new one, and every file name a symlink through `..data`.
Mid-load the CA and every leaf are replaced (mTLS between target and draft, TLS from clients to the
target): streams in flight finish with the exact greedy tokens, new connections get and need the new
certificates, the expiry gauge follows, and neither service restarts.
"""

from __future__ import annotations

import grpc
import pytest
from service_util import Load, prompts, request, start_draft, start_target, wait_for
from tls_util import FILES, Issued, issue, publish

from specsplit.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


def creds(issued: Issued, client_cert: bool) -> grpc.ChannelCredentials:
    f = issued.files
    if client_cert:
        return grpc.ssl_channel_credentials(f["ca.crt"], f["client.key"], f["client.crt"])
    return grpc.ssl_channel_credentials(f["ca.crt"])


def connects(address: str, credentials: grpc.ChannelCredentials, role: str) -> bool:
    """A new connection: True if the handshake and one call succeed, False if it is refused."""
    with grpc.secure_channel(address, credentials) as channel:
        try:
            if role == "draft":
                draft_pb2_grpc.DraftServiceStub(channel).GetDraftInfo(
                    draft_pb2.GetDraftInfoRequest(), timeout=5
                )
            else:
                target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
                    target_pb2.GetModelInfoRequest(), timeout=5
                )
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return False
    return True


def test_rotated_ca_and_leaves_are_used_without_a_restart(demo_models, tmp_path):
    certs = tmp_path / "certs"
    certs.mkdir()
    old, new = issue(1, days=30), issue(2, days=90)
    publish(certs, old, 1)
    c = {name: str(certs / name) for name in FILES}
    server_tls = ["--tls-cert", c["tls.crt"], "--tls-key", c["tls.key"], "--tls-reload-interval", "0.5"]
    draft = start_draft(demo_models.draft, tmp_path, *server_tls, "--tls-client-ca", c["ca.crt"])
    draft_port = draft.port
    draft.wait_ready()
    link_tls = ["--draft-tls-ca", c["ca.crt"], "--draft-tls-cert", c["client.crt"],
                "--draft-tls-key", c["client.key"], "--verify-backend", "torch"]  # fmt: skip
    target = start_target(demo_models.target, tmp_path, f"localhost:{draft_port}", *server_tls, *link_tls)
    target.wait_ready()
    channel = grpc.secure_channel(target.address, creds(old, client_cert=False))  # opened before the rotation
    stub = target_pb2_grpc.TargetServiceStub(channel)
    try:
        ps = prompts(4, seed=31)
        want = [
            [t for m in stub.Generate(request(p, max_new_tokens=NEW_TOKENS, k=0)) for t in m.token_ids]
            for p in ps
        ]
        assert draft.metric("specsplit_tls_certificate_expiry_timestamp_seconds", certificate="tls_cert") == (
            old.not_after.timestamp()
        )
        load = Load(stub, ps, NEW_TOKENS)
        wait_for(load.started, 60, "every stream's first tokens")
        publish(certs, new, 2)

        # New connections: the new certificates are served and required (client CA, both services).
        assert connects(target.address, creds(new, client_cert=False), "target")
        assert not connects(target.address, creds(old, client_cert=False), "target")
        assert connects(f"127.0.0.1:{draft_port}", creds(new, client_cert=True), "draft")
        assert not connects(f"127.0.0.1:{draft_port}", creds(old, client_cert=True), "draft")
        for service, certificate in ((draft, "tls_cert"), (target, "tls_cert"), (target, "draft_tls_cert")):
            wait_for(
                lambda s=service, c=certificate: s.metric(
                    "specsplit_tls_certificate_expiry_timestamp_seconds", certificate=c
                ) == new.not_after.timestamp(),
                10,
                f"{certificate}'s expiry gauge to follow the renewal",
            )  # fmt: skip

        # Streams in flight on connections opened before the rotation finish, exactly.
        load.join()
        assert load.status == [grpc.StatusCode.OK] * len(ps)
        assert load.tokens == want
        drafted = target.metric("specsplit_spec_draft_tokens_total")
        assert drafted > 0

        # The draft restarts (a rollout after the renewal): the target, not restarted, dials it with the
        # renewed client certificate and trusts only the new CA, and speculates again.
        assert draft.stop() == 0
        draft = start_draft(demo_models.draft, tmp_path, *server_tls, "--tls-client-ca", c["ca.crt"],
                            port=draft_port).wait_ready()  # fmt: skip
        wait_for(lambda: target.metric("specsplit_draft_connected") == 1, 30, "the target to reconnect")
        with grpc.secure_channel(target.address, creds(new, client_cert=False)) as fresh:
            again = Load(target_pb2_grpc.TargetServiceStub(fresh), ps, NEW_TOKENS)
            again.join()
        assert again.tokens == want
        assert target.metric("specsplit_spec_draft_tokens_total") > drafted
        assert "TLS certificates reloaded" in target.log_text()
        assert target.popen.poll() is None
    finally:
        channel.close()
        target.stop()
        draft.stop()
