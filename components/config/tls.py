"""The endpoint's certificate (`tls`), read and checked before anything starts. Pure (no Pulumi).

What the edge serves must be what a client accepts: the chain parses, the key is the certificate's, each
certificate is signed by the next and the last by `tls.ca`, the names cover the host the endpoint is reached at,
and today is inside every certificate's validity. A message names what is wrong (a name, a date, a position in
the chain), never the content of a certificate or a key.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from dataclasses import dataclass
from typing import Optional

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

BEGIN_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
# Key types HAProxy's OpenSSL serves and every client verifies.
SERVED_KEYS = (rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)


@dataclass(frozen=True)
class Facts:
    """What the `tls` output says of the certificate the edge serves: its sha256 fingerprint (as `openssl x509
    -fingerprint -sha256` prints it), its names and the end of its validity."""

    fingerprint: str
    names: tuple[str, ...]
    not_after: datetime.datetime

    def to_output(self) -> dict:
        return {
            "fingerprintSha256": self.fingerprint,
            "names": list(self.names),
            "notAfter": self.not_after.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }


def _certificates(pem: str) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem.encode()) if BEGIN_CERTIFICATE in pem else []


def read_chain(pem: str, key: str) -> tuple[list[x509.Certificate], Optional[object], list[str]]:
    """(certificates, private key, problems with either): the key paths are `tls.certificate` and `tls.key`."""
    problems = []
    try:
        chain = _certificates(pem)
    except ValueError:
        chain = []
    if not chain:
        problems.append(("tls.certificate", "PEM certificates (-----BEGIN CERTIFICATE-----), the server's first"))
    try:
        private = serialization.load_pem_private_key(key.encode(), password=None)
    except (ValueError, TypeError):
        private = None
        problems.append(("tls.key", "an unencrypted PEM private key (-----BEGIN PRIVATE KEY-----)"))
    else:
        if not isinstance(private, SERVED_KEYS):
            private = None
            problems.append(("tls.key", "an RSA, ECDSA or Ed25519 key"))
    return chain, private, problems


def names_of(certificate: x509.Certificate) -> tuple[str, ...]:
    """Its subjectAltName entries (DNS names and IP addresses): what a client matches, never the subject's CN."""
    try:
        found = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return (*found.get_values_for_type(x509.DNSName), *(str(ip) for ip in found.get_values_for_type(x509.IPAddress)))


def covers(names: tuple[str, ...], host: str) -> bool:
    """Whether a client that reaches `host` accepts a certificate with `names` (RFC 6125: an IP address only by
    an IP entry; a name exactly, case aside, or by a wildcard for its whole left-most label)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for name in names:
        if address is not None:
            try:
                if ipaddress.ip_address(name) == address:
                    return True
            except ValueError:
                continue
            continue
        wanted, given = host.lower().rstrip("."), name.lower().rstrip(".")
        if given == wanted:
            return True
        if given.startswith("*.") and "." in wanted and wanted.split(".", 1)[1] == given[2:] and given.count(".") >= 2:
            return True
    return False


def fingerprint(certificate: x509.Certificate) -> str:
    digest = hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def _public(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _signed_by(certificate: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        certificate.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _validity(chain: list[x509.Certificate], now: datetime.datetime) -> list[tuple[str, str]]:
    problems = []
    for index, certificate in enumerate(chain):
        which = "the server's certificate" if index == 0 else f"certificate {index + 1} of the chain"
        if certificate.not_valid_after_utc <= now:
            end = f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M}"
            problems.append(("tls.certificate", f"{which} expired {end} UTC: a valid one (clients refuse it)"))
        elif certificate.not_valid_before_utc > now:
            start = f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M}"
            problems.append(
                (
                    "tls.certificate",
                    f"{which} is valid only from {start} UTC: one valid now (is this machine's clock right?)",
                )
            )
    return problems


def _trust(chain: list[x509.Certificate], ca_pem: str) -> list[tuple[str, str]]:
    """Each certificate signed by the next, the last by (or being) one of `tls.ca`'s."""
    try:
        anchors = _certificates(ca_pem)
    except ValueError:
        anchors = []
    if not anchors:
        return [
            (
                "tls.ca",
                "the PEM certificate of the CA that signed the server's (the certificate itself when it is "
                "self-signed): the program's own steps verify the endpoint with it, as clients do",
            )
        ]
    for index, (certificate, issuer) in enumerate(zip(chain, chain[1:], strict=False), start=1):
        if not _signed_by(certificate, issuer):
            expected = f"certificate {index + 1} of the chain to be the issuer of certificate {index}"
            return [("tls.certificate", f"{expected}: the server's first, then each issuer in order")]
    last = chain[-1]
    if any(last == anchor or _signed_by(last, anchor) for anchor in anchors):
        return []
    return [
        (
            "tls.ca",
            f"the CA that signed the chain's last certificate (issued by {last.issuer.rfc4514_string()}): "
            "this CA did not sign it",
        )
    ]


def _server_use(certificate: x509.Certificate) -> list[tuple[str, str]]:
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return []
    if ExtendedKeyUsageOID.SERVER_AUTH in usages:
        return []
    return [("tls.certificate", "a server certificate: its extendedKeyUsage lacks serverAuth (clients refuse it)")]


def tls_problems(
    certificate: str, key: str, ca: str, host: Optional[str], now: Optional[datetime.datetime] = None
) -> list[tuple[str, str]]:
    """(key path, what is expected) for each thing wrong with the certificate `host`'s endpoint would serve
    (`host` None: not known, its names are not checked)."""
    now = now or datetime.datetime.now(datetime.UTC)
    chain, private, problems = read_chain(certificate, key)
    if not chain:
        return problems
    leaf = chain[0]
    if private is not None and _public(private.public_key()) != _public(leaf.public_key()):
        problems.append(
            (
                "tls.key",
                "the private key of the server's certificate (the first of tls.certificate): "
                "this key is another certificate's",
            )
        )
    names = names_of(leaf)
    if host is not None and not covers(names, host):
        found = ", ".join(names) if names else "no subjectAltName at all: clients ignore the CN"
        problems.append(
            ("tls.certificate", f"a certificate for {host}, the host the endpoint is reached at (it names {found})")
        )
    problems += _server_use(leaf)
    problems += _validity(chain, now)
    problems += _trust(chain, ca)
    return problems


def facts(certificate: str) -> Facts:
    """The `tls` output of a certificate chain tls_problems passed."""
    leaf = _certificates(certificate)[0]
    return Facts(fingerprint(leaf), names_of(leaf), leaf.not_valid_after_utc)
