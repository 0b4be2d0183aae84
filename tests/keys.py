"""SSH keys of the right shape for tests that never dial: built from fixed bytes, no crypto library.

The config rules parse keys (components/config/ssh_keys.py), so a test's key must be shaped as a real one:
an OpenSSH private key (PROTOCOL.key: magic, cipher "none", one ed25519 public key, the private
section) and a public line whose base64 decodes to a 32-byte ed25519 key.
"""

from __future__ import annotations

import base64
import hashlib
import struct


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def ed25519_public_blob(seed: str) -> bytes:
    return _string(b"ssh-ed25519") + _string(hashlib.sha256(seed.encode()).digest())


def host_key_line(seed: str) -> str:
    """'ssh-ed25519 AAAA…' as ssh-keyscan prints it (no host name)."""
    return "ssh-ed25519 " + base64.b64encode(ed25519_public_blob(seed)).decode()


def openssh_private_key(seed: str, cipher: str = "none") -> str:
    """An unencrypted (or, with `cipher`, an encrypted-looking) OpenSSH ed25519 private key file's text."""
    public = ed25519_public_blob(seed)
    key = hashlib.sha256(("private" + seed).encode()).digest()
    private = struct.pack(">II", 0x5EED, 0x5EED) + _string(b"ssh-ed25519")
    private += _string(public[-32:]) + _string(key + public[-32:]) + _string(seed.encode())
    private += bytes(range(1, 1 + (-len(private)) % 8))
    kdf = b"none" if cipher == "none" else b"bcrypt"
    body = b"openssh-key-v1\x00" + _string(cipher.encode()) + _string(kdf) + _string(b"" if cipher == "none" else b"x")
    body += struct.pack(">I", 1) + _string(public) + _string(private)
    text = base64.b64encode(body).decode()
    lines = [text[i : i + 70] for i in range(0, len(text), 70)]
    return "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(lines) + "\n-----END OPENSSH PRIVATE KEY-----\n"
