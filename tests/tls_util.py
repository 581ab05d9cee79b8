"""Certificates for TLS tests, issued with `cryptography`, and published as kubelet publishes a projected
Secret: each version in its own directory, `..data` a symlink swapped atomically to the newest, every
file name a symlink through `..data`."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

FILES = ("ca.crt", "tls.crt", "tls.key", "client.crt", "client.key")


@dataclass
class Issued:
    files: dict[str, bytes]  # FILES -> PEM
    not_after: datetime.datetime  # the server leaf's


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def issue(generation: int, days: int) -> Issued:
    """A CA, a server leaf for localhost/127.0.0.1 and a client leaf, valid `days` days."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    not_after = now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"specsplit-test-ca-{generation}")

    def build(subject: x509.Name, public_key, ca: bool, san: list | None, until: datetime.datetime):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
             .not_valid_after(until)
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    local = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    files = {
        "ca.crt": build(ca_name, ca_key.public_key(), True, None, now + datetime.timedelta(days=days + 30)),
        "tls.crt": build(_name("server"), server_key.public_key(), False, local, not_after),
        "tls.key": _pem_key(server_key),
        "client.crt": build(
            _name("client"), client_key.public_key(), False, [x509.DNSName("client")], not_after
        ),
        "client.key": _pem_key(client_key),
    }
    return Issued(files, not_after)


def publish(directory: Path, issued: Issued, version: int) -> None:
    """Writes a version directory, then swaps `..data` to it in one rename (as kubelet does)."""
    target = directory / f"..v{version}"
    target.mkdir()
    for name, pem in issued.files.items():
        (target / name).write_bytes(pem)
    link = directory / "..data_tmp"
    link.symlink_to(target.name)
    os.replace(link, directory / "..data")
    for name in FILES:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
