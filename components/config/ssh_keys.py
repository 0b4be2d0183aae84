"""What an SSH key in the stack config really is. Pure: no I/O, no crypto library.

Both SSH transports fail at the first connection on a bad key, with a message that names neither the
key nor the config: pulumi-command's Go client parses `host_key` with ssh.ParseAuthorizedKey and
`private_key` with ssh.ParsePrivateKey (golang.org/x/crypto/ssh keys.go), the Docker provider's
OpenSSH reads the identity file (sshkey.c). So the shapes are checked here, before any resource.

Wire formats (RFC 4253 §6.6, RFC 5656 §3.1, RFC 8709 §4, OpenSSH PROTOCOL.key): a public key blob is
a sequence of `string` fields (4-byte big-endian length, then the bytes): the key type, then
ed25519: the 32-byte key; ecdsa: the curve name and the point (0x04 ‖ X ‖ Y); rsa: e and n.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Optional

# ecdsa curve → length of the uncompressed point (RFC 5656 §3.1: 0x04 ‖ X ‖ Y)
ECDSA_POINT = {"nistp256": 65, "nistp384": 97, "nistp521": 133}
ED25519_KEY_BYTES = 32
OPENSSH_MAGIC = b"openssh-key-v1\x00"
PEM_PRIVATE = re.compile(
    r"-----BEGIN (OPENSSH|RSA|EC|DSA|ENCRYPTED|) ?PRIVATE KEY-----\r?\n(.*?)\r?\n-----END \1 ?PRIVATE KEY-----",
    re.S,
)
PUBLIC_LINE = re.compile(r"(ssh-ed25519|ssh-rsa|ssh-dss|ecdsa-sha2-nistp\d+|sk-\S+)\s+[A-Za-z0-9+/=]+")


def _strings(blob: bytes) -> list[bytes]:
    """The `string` fields of an SSH wire blob; ValueError when it is cut short."""
    fields, at = [], 0
    while at < len(blob):
        if at + 4 > len(blob):
            raise ValueError("a length cut short")
        (length,) = struct.unpack(">I", blob[at : at + 4])
        at += 4
        if at + length > len(blob):
            raise ValueError("a field longer than the key")
        fields.append(blob[at : at + length])
        at += length
    return fields


def public_blob_problem(kind: str, blob: bytes) -> Optional[str]:
    """Why `blob` is not a public key of type `kind`, or None."""
    try:
        fields = _strings(blob)
    except ValueError as error:
        return f"its base64 decodes to no SSH key ({error})"
    if not fields or fields[0] != kind.encode():
        found = fields[0][:40].decode("ascii", "replace") if fields else "nothing"
        return f"its base64 holds a key of type {found!r}, not {kind!r}"
    if kind == "ssh-ed25519":
        if len(fields) != 2 or len(fields[1]) != ED25519_KEY_BYTES:
            sizes = [len(f) for f in fields[1:]]
            return f"an ed25519 key is {ED25519_KEY_BYTES} bytes; its base64 holds fields of {sizes} bytes"
        return None
    if kind.startswith("ecdsa-sha2-"):
        curve = kind.removeprefix("ecdsa-sha2-")
        if len(fields) != 3 or fields[1] != curve.encode():
            return f"an {kind} key names curve {curve!r} and holds one point; its base64 does not"
        if len(fields[2]) != ECDSA_POINT.get(curve, -1) or fields[2][:1] != b"\x04":
            return f"an {kind} key holds a {ECDSA_POINT.get(curve)}-byte point; its base64 holds {len(fields[2])} bytes"
        return None
    if kind == "ssh-rsa":
        if len(fields) != 3:
            return "an ssh-rsa key holds an exponent and a modulus; its base64 does not"
        return None
    return f"a key type this program knows (not {kind!r})"


def _b64(text: str) -> bytes:
    """Strict base64 (padding included), as Go's base64.StdEncoding.DecodeString reads it: whole groups of 4."""
    if len(text) % 4:
        raise ValueError("base64 comes in groups of 4 characters")
    return base64.b64decode(text.encode("ascii"), validate=True)


def host_key_problem(line: str) -> Optional[str]:
    """Why `line` ('ssh-ed25519 AAAA…') is not a usable public host key, or None."""
    kind, _, data = line.partition(" ")
    try:
        blob = _b64(data)
    except (binascii.Error, ValueError):
        return "its base64 part does not decode (cut short, or a character lost in a copy?)"
    return public_blob_problem(kind, blob)


def private_key_problem(text: str) -> Optional[str]:
    """Why `text` is not an unencrypted SSH private key both transports can read, or None.

    Says what it looks like instead, never what it holds."""
    stripped = text.strip()
    if not stripped:
        return "a private key, not an empty value"
    if PUBLIC_LINE.match(stripped) and "PRIVATE KEY" not in stripped:
        return (
            "a private key, not a public one (the .pub file): "
            "`pulumi config set --secret sshPrivateKey < ~/.ssh/id_ed25519`"
        )
    if stripped.startswith("PuTTY-User-Key-File"):
        return (
            "an OpenSSH private key, not a PuTTY .ppk file: "
            "convert it with `puttygen KEY.ppk -O private-openssh -o id_key`"
        )
    if stripped.startswith(("~", "/", "./")) and "\n" not in stripped and "-----" not in stripped:
        return "the key's contents, not a path: `pulumi config set --secret sshPrivateKey < ~/.ssh/id_ed25519`"
    if "-----BEGIN" in stripped and "\n" not in stripped:
        return "the key with its line breaks (they were lost: set it from the file, `… < ~/.ssh/id_ed25519`)"
    match = PEM_PRIVATE.search(stripped)
    if not match:
        return "an SSH private key ('-----BEGIN OPENSSH PRIVATE KEY-----' … '-----END OPENSSH PRIVATE KEY-----')"
    kind, body = match.group(1), match.group(2)
    if kind == "ENCRYPTED" or "Proc-Type: 4,ENCRYPTED" in body:
        return _ENCRYPTED
    if kind == "DSA":
        return "an ed25519, ecdsa or rsa key: OpenSSH 7.0 and later refuse DSA keys"
    lines = [line for line in body.splitlines() if line.strip() and ":" not in line]
    try:
        data = _b64("".join(line.strip() for line in lines))
    except (binascii.Error, ValueError):
        return "a private key whose base64 body decodes (it is cut short, or a line was changed)"
    if kind != "OPENSSH":
        return None if len(data) > 32 else "a whole private key (its body is too short to be one)"
    return _openssh_problem(data)


_ENCRYPTED = (
    "an unencrypted private key: both transports run without a prompt, so a passphrase cannot be typed "
    "(use an ssh-agent instead: `ssh-add KEY`, and leave sshPrivateKey unset; or remove the passphrase on "
    "a copy: `ssh-keygen -p -N '' -f COPY`)"
)


def _openssh_problem(data: bytes) -> Optional[str]:
    """OpenSSH's own format (PROTOCOL.key): magic, cipher, kdf, kdf options, key count, public keys."""
    if not data.startswith(OPENSSH_MAGIC):
        return "an OpenSSH private key whose body starts with 'openssh-key-v1' (this one does not)"
    rest = data[len(OPENSSH_MAGIC) :]
    try:
        header, at = [], 0
        for _ in range(3):  # ciphername, kdfname, kdfoptions
            (length,) = struct.unpack(">I", rest[at : at + 4])
            header.append(rest[at + 4 : at + 4 + length])
            at += 4 + length
        (count,) = struct.unpack(">I", rest[at : at + 4])
        at += 4
        (length,) = struct.unpack(">I", rest[at : at + 4])
        public = rest[at + 4 : at + 4 + length]
    except struct.error:
        return "a whole OpenSSH private key (this one is cut short)"
    if header[0] != b"none":
        return _ENCRYPTED
    if count != 1:
        return f"one key in the file (it holds {count})"
    try:
        kind = _strings(public)[0].decode("ascii", "replace")
    except (ValueError, IndexError):
        return "a whole OpenSSH private key (its public part is cut short)"
    if kind == "ssh-dss":
        return "an ed25519, ecdsa or rsa key: OpenSSH 7.0 and later refuse DSA keys"
    problem = public_blob_problem(kind, public)
    return None if problem is None else f"a private key whose public part is whole: {problem}"
