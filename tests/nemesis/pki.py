"""The fleet's certificates: one CA, a server certificate valid for every address the replicas are
reached at, and a client certificate per node (its name as the common name), as an operator would
issue them. Written into the run's directory; never committed, never reused across runs."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_path: Path, key_path: Path) -> None:
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    key_path.chmod(0o600)


class FleetPki:
    def __init__(self, d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.dir = d
        self.now = datetime.datetime.now(datetime.UTC)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca = (
            x509.CertificateBuilder().subject_name(_name("podium nemesis CA")).issuer_name(_name("podium nemesis CA"))
            .public_key(self.ca_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(minutes=5)).not_valid_after(self.now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self.ca_key, hashes.SHA256())
        )  # fmt: skip
        self.ca_cert = d / "ca.pem"
        self.ca_cert.write_bytes(self.ca.public_bytes(serialization.Encoding.PEM))

    def _leaf(
        self, cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(self.ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(self.now - datetime.timedelta(minutes=5))
            .not_valid_after(self.now + datetime.timedelta(days=2))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()), critical=False)
        )  # fmt: skip
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(self.ca_key, hashes.SHA256()), key

    def server(self, name: str, ips: list[str]) -> tuple[Path, Path]:
        sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(name)]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        cert, key = self._leaf(name, ExtendedKeyUsageOID.SERVER_AUTH, sans)
        paths = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        _write(cert, key, *paths)
        return paths

    def node(self, name: str) -> tuple[Path, Path]:
        cert, key = self._leaf(name, ExtendedKeyUsageOID.CLIENT_AUTH, [])
        paths = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        _write(cert, key, *paths)
        return paths
