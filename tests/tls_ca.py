"""A CA of the tests' own and the certificates it issues (PEM text), for the endpoint over TLS: the good one
for a host, and each way one can be wrong (expired, another name, no subjectAltName, a client certificate)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


def _pem(certificate: x509.Certificate) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode()


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


@dataclass
class Issued:
    certificate: str  # PEM, the server's first (then the intermediate, when there is one)
    key: str  # PEM

    def write(self, directory: Path) -> tuple[Path, Path]:
        cert, key = directory / "server.pem", directory / "server.key"
        cert.write_text(self.certificate)
        key.write_text(self.key)
        key.chmod(0o600)
        return cert, key


class TestCa:
    """A self-signed CA (ECDSA P-256), and what it signs."""

    __test__ = False

    def __init__(self, common: str = "spark-vllm tests CA") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(common))
            .issuer_name(_name(common))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - DAY)
            .not_valid_after(NOW + 365 * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> str:
        return _pem(self.certificate)

    def write(self, path: Path) -> Path:
        path.write_text(self.pem)
        return path

    def issue(
        self,
        *names: str,
        not_before: datetime.datetime = NOW - DAY,
        not_after: datetime.datetime = NOW + 90 * DAY,
        san: bool = True,
        usage: x509.ObjectIdentifier = ExtendedKeyUsageOID.SERVER_AUTH,
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(names[0] if names else "nameless"))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        if san:
            builder = builder.add_extension(_san(names), critical=False)
        return Issued(_pem(builder.sign(self.key, hashes.SHA256())), _key_pem(key))
