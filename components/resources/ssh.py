"""How this machine reaches the nodes over SSH, on both transports, and what it checks first.

Two SSH clients reach every node, and they read credentials differently:

* the Docker provider runs the local `ssh` binary (`ssh … docker system dial-stdio`): it reads the
  user's ssh_config, default keys and agent, and takes extra options (`sshOpts`), not key material;
* pulumi-command dials with Go's x/crypto/ssh: only `privateKey`, a password, or the agent at
  `SSH_AUTH_SOCK` — never `~/.ssh/id_*`; with `SSH_AUTH_SOCK` set to a dead socket every command
  fails, even with a private key.

So the program makes both use the same credential and the same host key, and refuses to start
where they would not (`ssh_access`). Host keys reach the Docker provider through
`KnownHostsCommand` in its options (no file: `pulumi destroy` and `pulumi refresh`, which configure
the provider from the stack's state, work on any machine). A private key given as the
`sshPrivateKey` secret is written to a file for `ssh` (mode 600) under `~/.spark-vllm/<project>/
<stack>/`, named with a literal `~` in the options so the state does not depend on one machine's
home directory; SPARK_VLLM_HOME moves it.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from components.config import ClusterConfig, NodeConfig
from components.plan.shell import shell_line

IDENTITY_NAME = "id_spark_vllm"
KEYSCAN_TYPE = "ed25519"


class SshAccessError(Exception):
    """This machine cannot reach the nodes the way both transports need. One problem a line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"spark-vllm: SSH from this machine would fail on the nodes:\n{lines}")


@dataclass(frozen=True)
class SshAccess:
    """What the Docker provider's `ssh` is told: the identity file as ssh names it (or None: the
    agent and ssh's own defaults)."""

    identity: Optional[str]

    def docker_ssh_opts(self, node: NodeConfig, host_key: str) -> list[str]:
        """Options for the Docker provider's `ssh`: the node's host key and nothing else is trusted
        (the user's known_hosts does not count), no prompt can hang `pulumi up`."""
        pattern = node.host if node.ssh_port == 22 else f"[{node.host}]:{node.ssh_port}"
        opts = [
            "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=15",
            "-o", "StrictHostKeyChecking=yes",
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "GlobalKnownHostsFile=/dev/null",
            # Values are checked by the config rules (host name, key alphabet); ssh splits the command
            # into words itself, no shell is involved.
            "-o", f"KnownHostsCommand=/bin/echo {pattern} {host_key}",
        ]  # fmt: skip
        if self.identity is not None:
            opts += ["-o", f"IdentityFile={self.identity}", "-o", "IdentitiesOnly=yes"]
        return opts


def keyscan_command(node: NodeConfig) -> str:
    """A local command printing the node's ed25519 host key ('ssh-ed25519 AAAA…'), or failing with
    the reason: trust on first use, run once when the node is first deployed."""
    scan = shell_line(["ssh-keyscan", "-T", "15", "-p", str(node.ssh_port), "-t", KEYSCAN_TYPE, node.host])
    complaint = shell_line(
        [
            "echo",
            f"spark-vllm: ssh-keyscan read no {KEYSCAN_TYPE} host key from {node.host} port {node.ssh_port} "
            f"(node {node.name}): is sshd running there? Or pin the key yourself in nodes[].hostKey",
        ]
    )
    return (
        f"key=$({scan} 2>/dev/null | awk '!/^#/ && NF >= 3 {{print $2 \" \" $3; exit}}'); "
        f'if [ -z "$key" ]; then {complaint} >&2; exit 1; fi; echo "$key"'
    )


# --- files -----------------------------------------------------------------------------------------


def login_home() -> Path:
    """The home directory ssh expands `~` to: the account's, not $HOME."""
    return Path(pwd.getpwuid(os.getuid()).pw_dir)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two programs of one stack at once (two shells) each its own
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def identity_location(project: str, stack: str, environ: Mapping[str, str]) -> tuple[str, Path]:
    """(the path as ssh is told it, the file written here)."""
    if environ.get("SPARK_VLLM_HOME"):
        path = Path(environ["SPARK_VLLM_HOME"]) / project / stack / IDENTITY_NAME
        return str(path), path
    relative = Path(".spark-vllm") / project / stack / IDENTITY_NAME
    return f"~/{relative}", login_home() / relative


# --- the checks ------------------------------------------------------------------------------------

SSH_AGENTC_REQUEST_IDENTITIES = 11
SSH_AGENT_IDENTITIES_ANSWER = 12


def agent_key_count(path: str, timeout: float = 5.0) -> Optional[int]:
    """How many keys the ssh-agent at `path` holds; None when no agent answers there."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(struct.pack(">IB", 1, SSH_AGENTC_REQUEST_IDENTITIES))
            header = _recv(sock, 5)
            length, kind = struct.unpack(">IB", header)
            if kind != SSH_AGENT_IDENTITIES_ANSWER or length < 5:
                return None
            return struct.unpack(">I", _recv(sock, 4))[0]
    except (OSError, struct.error):
        return None


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("agent closed the connection")
        data += chunk
    return data


def ssh_access_problems(
    cfg: ClusterConfig,
    environ: Mapping[str, str],
    count_agent_keys: Optional[Callable[[str], Optional[int]]] = None,
) -> list[str]:
    """Where the two SSH transports would fail half-way through a deployment, with the fix.

    * a stale SSH_AUTH_SOCK: pulumi-command dials it whenever it is set and fails every command;
    * no sshPrivateKey and no agent: pulumi-command has nothing to log in with (it never reads
      ~/.ssh/id_*), although `docker -H ssh://…` would work;
    * no sshPrivateKey and an agent without keys: the same.
    With sshPrivateKey and an agent both present, both transports use the key (ssh: IdentitiesOnly;
    pulumi-command: the key is tried first and the agent's keys are then skipped).
    """
    agent = environ.get("SSH_AUTH_SOCK") or ""
    keys = (count_agent_keys or agent_key_count)(agent) if agent else None
    problems = []
    if agent and keys is None:
        problems.append(
            f"SSH_AUTH_SOCK={agent!r} — no ssh-agent answers there (a socket left from another session?); "
            "pulumi-command would fail every remote command with it set, even with sshPrivateKey. "
            "Fix: `unset SSH_AUTH_SOCK`, or start an agent: `eval $(ssh-agent) && ssh-add`"
        )
    elif cfg.ssh_private_key is None and not agent:
        problems.append(
            "sshPrivateKey: None and SSH_AUTH_SOCK unset — remote commands log in only with sshPrivateKey "
            "or an ssh-agent (never ~/.ssh/id_*). Fix: `pulumi config set --secret sshPrivateKey < "
            "~/.ssh/id_ed25519`, or `eval $(ssh-agent) && ssh-add ~/.ssh/id_ed25519`"
        )
    elif cfg.ssh_private_key is None and keys == 0:
        problems.append(
            f"sshPrivateKey: None and the ssh-agent at SSH_AUTH_SOCK={agent!r} holds no keys — "
            "remote commands would have nothing to log in with. Fix: `ssh-add ~/.ssh/id_ed25519`, or "
            "`pulumi config set --secret sshPrivateKey < ~/.ssh/id_ed25519`"
        )
    return problems


def ssh_access(cfg: ClusterConfig, project: str, stack: str, environ: Optional[Mapping[str, str]] = None) -> SshAccess:
    """Check this machine's SSH credentials (SshAccessError before any resource) and write the key file."""
    environ = os.environ if environ is None else environ
    problems = ssh_access_problems(cfg, environ)
    if problems:
        raise SshAccessError(problems)
    if cfg.ssh_private_key is None:
        return SshAccess(identity=None)
    named, path = identity_location(project, stack, environ)
    key = cfg.ssh_private_key.get_secret_value()
    _write_private(path, key if key.endswith("\n") else key + "\n")
    return SshAccess(identity=named)
