"""A private certificate authority for tests and development stacks: a CA and certificates issued by it, written
as PEM files, each usable as server and client certificate (serverAuth + clientAuth) with the SANs given (by
default localhost and 127.0.0.1, what tests dial). Uses `cryptography`; P-256 keys (fast to make).

    pki = CertAuthority.create(tmp / "pki")
    tls = pki.issue("router")            # TlsConfig(cert, key, ca) for `--tls-cert/--tls-key/--tls-ca`
    rogue = CertAuthority.create(tmp / "rogue").issue("intruder")   # well-formed, from another CA
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.server.tls import TlsConfig

DEFAULT_HOSTS = ("localhost", "127.0.0.1")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


@dataclass
class CertAuthority:
    directory: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    @classmethod
    def create(cls, directory: Path, name: str = "pdserve test CA", days: int = 30) -> CertAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        ca = cls(directory, key, cert)
        ca.ca_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return ca

    def issue(self, name: str, hosts: tuple[str, ...] = DEFAULT_HOSTS, days: int = 30) -> TlsConfig:
        """A certificate for `name` with `hosts` as SANs; returns its paths with this CA's as `ca`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = self.directory / f"{name}.pem", self.directory / f"{name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(_key_pem(key))
        key_path.chmod(0o600)
        return TlsConfig(str(cert_path), str(key_path), str(self.ca_path))
