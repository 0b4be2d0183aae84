"""Local SSH material for the Docker provider, which runs the local `ssh` binary.

The provider takes SSH options, not key material, so a pinned host key and a key given as the
`sshPrivateKey` secret are written to files (mode 600) under SPARK_VLLM_HOME
(default ~/.spark-vllm). Paths are stable so a second `pulumi up` sees no provider diff.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from components.config import ClusterConfig, NodeConfig
from components.render import known_hosts_lines


def state_dir(project: str, stack: str) -> Path:
    base = Path(os.environ.get("SPARK_VLLM_HOME") or Path.home() / ".spark-vllm")
    return base / project / stack


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class SshFiles:
    known_hosts: Path | None
    identity: Path | None

    def docker_ssh_opts(self, node: NodeConfig) -> list[str]:
        opts = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=15"]
        if node.host_key is not None and self.known_hosts is not None:
            opts += ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self.known_hosts}"]
        if self.identity is not None:
            opts += ["-i", str(self.identity), "-o", "IdentitiesOnly=yes"]
        return opts


def prepare_ssh_files(cfg: ClusterConfig, project: str, stack: str) -> SshFiles:
    directory = state_dir(project, stack)
    known_hosts = identity = None
    lines = known_hosts_lines(cfg)
    if lines:
        known_hosts = directory / "known_hosts"
        _write_private(known_hosts, "\n".join(lines) + "\n")
    if cfg.ssh_private_key is not None:
        identity = directory / "id_spark_vllm"
        key = cfg.ssh_private_key.get_secret_value()
        _write_private(identity, key if key.endswith("\n") else key + "\n")
    return SshFiles(known_hosts=known_hosts, identity=identity)
