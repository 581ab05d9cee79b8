"""TLS certificates that renew without a restart.

cert-manager renews a certificate by rewriting the mounted Secret (kubelet swaps the projected files at
once). Each service keeps serving: its server credentials are gRPC's dynamic ones, whose fetcher runs
at every new connection's handshake and hands over the files' new contents when they changed; the
target's channel to the draft is built from the current files at each (re)connect. Connections already
open keep the certificate they started with, so streams in flight finish.

A `CertificateWatcher` holds every certificate set of the process and checks the files every
`interval` seconds as well, so the expiry gauge follows a renewal even without new connections, and a
reload is logged. A set whose files do not load (a key that is not the certificate's, a half-written
file) keeps its last good contents and says so once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from common.grpc_util import read_file

log = logging.getLogger("specsplit")

# (certificate, flag) -> expiry as a Unix time; ServiceMetrics.set_tls_expiry.
ExpirySink = Callable[[str, float], None]


@dataclass(frozen=True)
class Pem:
    """One loaded set: a key and its certificate chain, and/or CA certificates (PEM bytes)."""

    key: bytes | None
    chain: bytes | None
    ca: bytes | None


def _not_after(pem: bytes, flag: str) -> float:
    """The earliest expiry of the certificates in `pem` (a bundle: the first to lapse breaks it)."""
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ValueError(f"{flag}: not a PEM certificate ({exc})") from exc
    return min(c.not_valid_after_utc.timestamp() for c in certs)


def _check_key_matches(key: bytes, chain: bytes, key_flag: str, cert_flag: str) -> None:
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key_flag}: not an unencrypted PEM private key ({exc})") from exc
    leaf = x509.load_pem_x509_certificates(chain)[0]
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        raise ValueError(f"{key_flag}: the key is not the one of {cert_flag}'s certificate")


class CertificateSet:
    """The files behind one credential (flag -> path), reloaded when any of them changes on disk."""

    def __init__(self, files: dict[str, str], roles: tuple[str, str, str], on_expiry: ExpirySink | None):
        """`files`: flag -> path for the flags in use; `roles`: the (key, cert, ca) flag names."""
        self.files = files
        self.key_flag, self.cert_flag, self.ca_flag = roles
        self.on_expiry = on_expiry
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._failed_stamp: tuple | None = None
        self.pem = self._load()  # start-up: a bad file is an error naming the flag
        self.generation = 0

    def _stat(self) -> tuple:
        # stat follows the projected Secret's symlinks: a swap changes the inode.
        stamps = []
        for path in self.files.values():
            try:
                st = os.stat(path)
                stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def _load(self) -> Pem:
        """Reads and checks the files; the expiry sink hears of them only once all of them load."""
        raw = {flag: read_file(path, flag) for flag, path in self.files.items()}
        key, chain, ca = raw.get(self.key_flag), raw.get(self.cert_flag), raw.get(self.ca_flag)
        expiry = {
            flag: _not_after(pem, flag) for flag, pem in ((self.cert_flag, chain), (self.ca_flag, ca)) if pem
        }
        if key is not None and chain is not None:
            _check_key_matches(key, chain, self.key_flag, self.cert_flag)
        if self.on_expiry is not None:
            for flag, when in expiry.items():
                self.on_expiry(flag, when)
        return Pem(key, chain, ca)

    def poll(self) -> bool:
        """Reloads if the files changed since the last load; True when new contents were taken."""
        stamp = self._stat()
        if stamp == self._stamp:
            return False
        with self._lock:
            if stamp == self._stamp or stamp == self._failed_stamp:
                return False
            try:
                self.pem = self._load()
            except ValueError as exc:
                self._failed_stamp = stamp
                log.warning("TLS files changed but do not load (%s); keeping the previous ones", exc)
                return False
            self._stamp, self._failed_stamp = stamp, None
            self.generation += 1
        log.info("TLS certificates reloaded: %s", ", ".join(self.files.values()))
        return True


class CertificateWatcher:
    """Every reloadable certificate set of one process, and the thread that checks their files."""

    def __init__(self, on_expiry: ExpirySink | None = None, interval: float = 10.0):
        self.on_expiry = on_expiry
        self.interval = interval
        self.sets: list[CertificateSet] = []
        self._thread: threading.Thread | None = None

    def _add(self, files: dict[str, str | None], roles: tuple[str, str, str]) -> CertificateSet:
        cert_set = CertificateSet({f: p for f, p in files.items() if p}, roles, self.on_expiry)
        self.sets.append(cert_set)
        if self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._watch, name="tls-watch", daemon=True)
            self._thread.start()
        return cert_set

    def _watch(self) -> None:
        while True:  # a daemon thread: it ends with the process
            time.sleep(self.interval)
            for cert_set in self.sets:
                cert_set.poll()

    def server_credentials(self, cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
        """TLS (mTLS with `client_ca`) whose certificate, key and client CA follow the files."""
        roles = ("--tls-key", "--tls-cert", "--tls-client-ca")
        cert_set = self._add({"--tls-key": key, "--tls-cert": cert, "--tls-client-ca": client_ca}, roles)

        def configuration() -> grpc.ServerCertificateConfiguration:
            pem = cert_set.pem
            return grpc.ssl_server_certificate_configuration([(pem.key, pem.chain)], root_certificates=pem.ca)

        served = [cert_set.generation]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Runs at each new connection's handshake: a stat of each file, a reload only after a change.
            cert_set.poll()
            if cert_set.generation == served[0]:
                return None
            served[0] = cert_set.generation
            return configuration()

        return grpc.dynamic_ssl_server_credentials(
            configuration(), fetch, require_client_authentication=bool(client_ca)
        )

    def channel_credentials(
        self, ca: str | None, cert: str | None, key: str | None
    ) -> Callable[[], grpc.ChannelCredentials] | None:
        """Credentials for the draft link, rebuilt from the current files each time they are asked for
        (each new channel); None without TLS."""
        if not (ca or cert):
            return None
        roles = ("--draft-tls-key", "--draft-tls-cert", "--draft-tls-ca")
        cert_set = self._add({"--draft-tls-key": key, "--draft-tls-cert": cert, "--draft-tls-ca": ca}, roles)

        def current() -> grpc.ChannelCredentials:
            cert_set.poll()
            pem = cert_set.pem
            return grpc.ssl_channel_credentials(
                root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.chain
            )

        return current


def add_port(
    server: grpc.Server,
    address: str,
    tls_cert: str | None,
    tls_key: str | None,
    tls_client_ca: str | None,
    certificates: CertificateWatcher,
) -> int:
    """Binds plaintext, TLS, or mTLS (client CA given); TLS files are reloaded when they change
    (`certificates`, common/tls.py). Returns the bound port."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if tls_client_ca and not tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    if tls_cert and tls_key:
        creds = certificates.server_credentials(tls_cert, tls_key, tls_client_ca)
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ValueError(f"--port: cannot bind {address}")
    return port
