"""The value types of the stack config: each a pydantic annotation with the rule it carries.

Strings that reach a shell have a tight alphabet (quoting at the edge is a second line of defence);
paths are normalised and not system directories; secrets are set to something usable; keys are keys.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated

from pydantic import AfterValidator, Field, SecretStr, ValidationInfo
from pydantic.alias_generators import to_camel

from components.config.ssh_keys import host_key_problem, private_key_problem

NAMESPACE = "spark-vllm"


def matching(regex: str, expected: str):
    """A validator for strings that end up in shell commands: the allowed alphabet is tight so a
    value can never be read as shell syntax, and quoting at the edge is a second line of defence."""
    compiled = re.compile(regex)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"expected {expected}")
        return value

    return AfterValidator(check)


# A size as Docker's json-file log driver takes it (max-size): a number and k, m or g.
LogSize = Annotated[str, matching(r"[1-9][0-9]{0,5}[kmg]", "a size such as 50m (a number, then k, m or g)")]
DnsLabel = Annotated[
    str,
    matching(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", "a DNS label (a-z, 0-9, '-', at most 63 characters)"),
]
HostName = Annotated[
    str,
    matching(
        r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?",
        "a host name or IPv4 address (letters, digits, '.', '-')",
    ),
]
PosixUser = Annotated[str, matching(r"[a-z_][a-z0-9_-]{0,31}", "a user name (a-z, 0-9, '_', '-')")]
NetDevName = Annotated[
    str,
    matching(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}", "a network interface name (at most 15 of A-Z a-z 0-9 _ . -)"),
]
RdmaDeviceName = Annotated[str, matching(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", "an RDMA device name such as rocep1s0f1")]
ImageRef = Annotated[
    str,
    matching(
        r"[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
        r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?",
        "an image reference: name[:tag][@sha256:<64 hex>]",
    ),
]
# Directories no path of the stack may be: the model is mounted into every container and, with
# modelSync, mirrored onto every other node (files the source lacks are deleted there).
SYSTEM_DIRS = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/lost+found", "/media",
     "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/usr/local", "/var",
     "/var/lib", "/var/lib/docker"}
)  # fmt: skip
SYSTEM_TREES = ("/bin/", "/boot/", "/dev/", "/etc/", "/lib/", "/lib32/", "/lib64/", "/proc/", "/run/", "/sbin/",
                "/sys/", "/usr/bin/", "/usr/lib/", "/usr/sbin/", "/var/lib/docker/", "/var/run/")  # fmt: skip


def _normal_path(value: str) -> str:
    """An absolute path as it is meant: no `.` or `..` segment, no `//`, no trailing `/`, not a system directory."""
    if not value.startswith("/"):
        return value
    normal = posixpath.normpath(value)
    if normal.startswith("//"):
        normal = "/" + normal.lstrip("/")
    if normal != value:
        raise ValueError(
            f"a normalised path: write it as {normal!r} (no '.' or '..' segment, no '//', no trailing '/'; "
            "the model is mounted and, with modelSync, mirrored at exactly this path)"
        )
    if value in SYSTEM_DIRS or value.startswith(SYSTEM_TREES) or re.fullmatch(r"/home/[^/]+", value):
        raise ValueError(
            "a directory of its own (such as /models/Name), not a system or home directory: it is mounted into "
            "every container, and modelSync deletes on the other nodes what the source lacks there"
        )
    return value


def _repo_id(value: str) -> str:
    """A Hugging Face repo id as the Hub takes it (huggingface_hub utils/_validators.py validate_repo_id)."""
    if value.startswith("/"):
        return value
    if "--" in value or ".." in value:
        raise ValueError("a Hugging Face repo id without '--' or '..' (the Hub refuses both)")
    if value.endswith(".git") or value.endswith((".", "-")) or len(value.split("/")[1]) > 96:
        raise ValueError("a Hugging Face repo id (a name of at most 96 characters, not ending in '.', '-' or '.git')")
    return value


ModelRef = Annotated[
    str,
    matching(
        r"/+[A-Za-z0-9._+@=-]+(/+[A-Za-z0-9._+@=-]+)*/*|[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*",
        "an absolute path (/models/Name) or a Hugging Face repo id (org/name)",
    ),
    AfterValidator(_normal_path),
    AfterValidator(_repo_id),
]
HttpEndpoint = Annotated[
    str,
    matching(
        r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?", "an http(s) URL such as https://hf-mirror.com"
    ),
]
AbsolutePath = Annotated[
    str,
    matching(r"/+[A-Za-z0-9._+@=-]+(/+[A-Za-z0-9._+@=-]+)*/*", "an absolute path of A-Z a-z 0-9 . _ + @ = -"),
    AfterValidator(_normal_path),
]
ServedName = Annotated[str, matching(r"[A-Za-z0-9][A-Za-z0-9._/:+-]{0,127}", "a model name of A-Z a-z 0-9 . _ / : + -")]
ParserName = Annotated[str, matching(r"[a-z0-9][a-z0-9_-]{0,63}", "a parser name such as qwen3 (a-z, 0-9, _, -)")]
StackName = Annotated[
    str,
    matching(
        r"(?!\.{1,2}(/|$))[A-Za-z0-9_.-]+(/(?!\.{1,2}(/|$))[A-Za-z0-9_.-]+){0,2}",
        "a stack name, fully qualified as organization/project/stack (no '.' or '..' part)",
    ),
]
Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]
_HOST_KEY = re.compile(
    r"(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp256|ecdsa-sha2-nistp384|ecdsa-sha2-nistp521) [A-Za-z0-9+/]+={0,3}"
)


def _host_key(value: str) -> str:
    if not _HOST_KEY.fullmatch(value):
        raise ValueError(
            "expected a public host key line such as 'ssh-ed25519 AAAA…' (see `ssh-keyscan -t ed25519 HOST`)"
        )
    if value.startswith("ssh-rsa "):
        # pulumi-command offers only the pinned key's type, and for ssh-rsa that is SHA-1 RSA,
        # which OpenSSH 8.8 and later refuse: every remote command would fail to connect.
        raise ValueError(
            "an ed25519 (or ecdsa) key: an ssh-rsa host key makes the remote commands offer SHA-1 RSA, which "
            "OpenSSH 8.8 and later refuse (get the ed25519 one: `ssh-keyscan -t ed25519 HOST`)"
        )
    problem = host_key_problem(value)
    if problem is not None:
        raise ValueError(
            f"a public host key line whose key is whole: {problem} (copy it again from "
            "`ssh-keyscan -t ed25519 HOST`, the part after the host name)"
        )
    return value


HostKeyLine = Annotated[str, AfterValidator(_host_key)]


_EMPTY_MEANS = {
    "apiKey": "the edge would ask no key of its clients",
    "apiKeys": "the edge would ask this client no key",
    "hfToken": "the Hub is asked without a token: a gated model fails to download",
    "grafanaAdminPassword": "Grafana would keep its admin/admin",
}


def _set_secret(value: SecretStr, info: ValidationInfo) -> str:
    """A secret's text, refused when it is set but blank: that must not count as set."""
    key = to_camel(info.field_name or "secret")
    text = value.get_secret_value()
    if not text.strip():
        path = f"--path {key}.<name>" if key == "apiKeys" else key
        raise ValueError(
            f"a value: it is set but empty, which counts as none ({_EMPTY_MEANS.get(key, 'nothing is sent')}); "
            f"set one (`pulumi config set --secret {path} …`) or remove it (`pulumi config rm {path}`)"
        )
    return text


def _token_secret(value: SecretStr, info: ValidationInfo) -> SecretStr:
    """An API key or token: set means something, sent whole as one word of an HTTP header (`Bearer <key>`):
    visible ASCII, the characters RFC 9110's field values carry as they are (no space, line break, control
    character or non-ASCII letter, which clients refuse to send or send mangled), less the comma (proxies split a
    header at commas: the edge would see two values and refuse it)."""
    text = _set_secret(value, info)
    bad = sorted({ch for ch in text if not 33 <= ord(ch) <= 126 or ch == ","})
    if bad:
        shown = ", ".join(repr(ch) if ch.isprintable() and not ch.isspace() else f"U+{ord(ch):04X}" for ch in bad)
        raise ValueError(
            f"a key of visible ASCII characters other than ',' (this one has {shown}; a newline copied with it?): "
            "clients send it as one word of the Authorization header, which carries nothing else whole; make one "
            "with `openssl rand -base64 24`"
        )
    return value


def _password_secret(value: SecretStr, info: ValidationInfo) -> SecretStr:
    """A password handed over in a container's environment: set means something, one line."""
    text = _set_secret(value, info)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValueError("a password without line breaks or control characters (a newline copied with it?)")
    return value


def _private_key_secret(value: SecretStr) -> SecretStr:
    problem = private_key_problem(value.get_secret_value())
    if problem is not None:
        raise ValueError(problem)
    return value


# The shortest key a client may be given (apiKey, apiKeys): 16 characters is 96 bits as base64 (`openssl rand
# -base64 16` gives 24); a shorter one is a password someone chose, not a key.
CLIENT_KEY_FLOOR = 16


def _client_key(value: SecretStr, info: ValidationInfo) -> SecretStr:
    """A key a client sends: a token, and at least CLIENT_KEY_FLOOR characters."""
    text = _token_secret(value, info).get_secret_value()
    if len(text) < CLIENT_KEY_FLOOR:
        raise ValueError(
            f"a key of at least {CLIENT_KEY_FLOOR} characters (this one has {len(text)}): make one with "
            "`openssl rand -base64 24`"
        )
    return value


TokenSecret = Annotated[SecretStr, AfterValidator(_token_secret)]
ClientKey = Annotated[SecretStr, AfterValidator(_client_key)]
# A client's name (apiKeys): what the edge's log and its counter say instead of the key.
ClientName = Annotated[
    str,
    matching(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?", "a client name: a label (a-z, 0-9, '-', at most 32 characters)"),
]
PasswordSecret = Annotated[SecretStr, AfterValidator(_password_secret)]
PrivateKeySecret = Annotated[SecretStr, AfterValidator(_private_key_secret)]


def _extra_arg(value: str) -> str:
    if not value or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError("expected a non-empty argument without control characters or newlines")
    return value


ExtraArg = Annotated[str, AfterValidator(_extra_arg)]
