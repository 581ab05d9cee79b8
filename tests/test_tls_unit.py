"""common/tls.py on its own: what a renewal, a broken renewal and a bad start-up file do (no services)."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from tls_util import issue, publish

from common.tls import CertificateWatcher


def watched(tmp_path: Path) -> tuple[Path, dict[str, float], CertificateWatcher]:
    certs = tmp_path / "certs"
    certs.mkdir()
    expiry: dict[str, float] = {}
    return certs, expiry, CertificateWatcher(expiry.__setitem__, interval=0)


def test_a_renewal_is_taken_and_a_broken_one_keeps_the_last_good_files(tmp_path, caplog):
    certs, expiry, watcher = watched(tmp_path)
    first, second, third = issue(1, days=30), issue(2, days=60), issue(3, days=90)
    publish(certs, first, 1)
    creds = watcher.server_credentials(str(certs / "tls.crt"), str(certs / "tls.key"), str(certs / "ca.crt"))
    assert isinstance(creds, grpc.ServerCredentials)
    (cert_set,) = watcher.sets
    assert expiry["--tls-cert"] == first.not_after.timestamp()
    assert not cert_set.poll()  # nothing changed

    publish(certs, second, 2)
    assert cert_set.poll() and cert_set.generation == 1
    assert cert_set.pem.chain == second.files["tls.crt"] and cert_set.pem.ca == second.files["ca.crt"]
    assert expiry["--tls-cert"] == second.not_after.timestamp()

    # A key that is not the certificate's (a renewal written file by file, caught half way).
    broken = type(third)(dict(third.files, **{"tls.key": second.files["tls.key"]}), third.not_after)
    publish(certs, broken, 3)
    with caplog.at_level(logging.WARNING, logger="specsplit"):
        assert not cert_set.poll()
        assert not cert_set.poll()  # said once per change, not at every handshake
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "--tls-key: the key is not the one of --tls-cert's certificate" in warning
    assert cert_set.pem.chain == second.files["tls.crt"] and cert_set.generation == 1
    assert expiry["--tls-cert"] == second.not_after.timestamp()

    publish(certs, third, 4)
    assert cert_set.poll() and cert_set.pem.key == third.files["tls.key"] and cert_set.generation == 2


def test_channel_credentials_follow_the_files(tmp_path):
    certs, expiry, watcher = watched(tmp_path)
    first, second = issue(1, days=30), issue(2, days=60)
    publish(certs, first, 1)
    current = watcher.channel_credentials(
        str(certs / "ca.crt"), str(certs / "client.crt"), str(certs / "client.key")
    )
    assert current is not None and isinstance(current(), grpc.ChannelCredentials)
    assert expiry["--draft-tls-cert"] == first.not_after.timestamp()
    publish(certs, second, 2)
    current()  # each new channel asks: the renewal is read then
    assert watcher.sets[0].pem.key == second.files["client.key"]
    assert expiry["--draft-tls-cert"] == second.not_after.timestamp()
    assert watcher.channel_credentials(None, None, None) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tls.crt": b"not a certificate"}, "--tls-cert: not a PEM certificate"),
        ({"tls.key": b"not a key"}, "--tls-key: not an unencrypted PEM private key"),
    ],
)
def test_bad_files_at_start_up_name_the_flag(tmp_path, change, message):
    certs, _, watcher = watched(tmp_path)
    issued = issue(1, days=30)
    publish(certs, type(issued)(dict(issued.files, **change), issued.not_after), 1)
    with pytest.raises(ValueError, match=message):
        watcher.server_credentials(str(certs / "tls.crt"), str(certs / "tls.key"), None)
    with pytest.raises(ValueError, match="--tls-client-ca: cannot read"):
        watcher.server_credentials(
            str(certs / "tls.crt"), str(certs / "tls.key"), str(tmp_path / "missing.crt")
        )
