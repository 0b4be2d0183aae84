"""Command lines: every value reaches a shell only through `shlex.join` (`shell_line`), so a hostile value
stays one quoted word even if validation missed it; scripts travel as quoted heredocs; fingerprints of values."""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from components.config import NodeConfig


def exec_python(container: str, timeout_seconds: int | None = None) -> list[str]:
    """`docker exec -i CONTAINER python3 -`: runs the program given on stdin inside the container."""
    argv = ["docker", "exec", "-i", container, "python3", "-"]
    if timeout_seconds is not None:
        # pulumi-command has no timeout of its own; a hung session would hang `pulumi up`.
        argv = ["timeout", "--kill-after=10", str(timeout_seconds), *argv]
    return argv


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)


def with_log_tail_on_failure(command: list[str], node: NodeConfig, container: str, lines: int = 60) -> str:
    """Run `command` on a node; when it fails, name the node and show the tail of its Ray log."""
    quoted = shlex.quote(container)
    # Every value stays a separate quoted word: inside double quotes `$(…)` would still expand.
    banner = shell_line(["echo", f"--- node {node.name}: last {lines} lines of docker logs {container} ---"])
    return (
        f"{shell_line(command)} || {{ rc=$?; {banner} >&2; docker logs --tail {lines} {quoted} >&2 2>&1; exit $rc; }}"
    )


HEREDOC_MARKER = "SPARK_VLLM_SCRIPT_END"


def with_script(command: str, script_text: str) -> str:
    """`command` with a script on its stdin as a quoted heredoc (no expansion inside).

    The script travels inside the command itself, so create and delete work the same way
    (pulumi-command feeds `stdin` only where it is set) and nothing is copied to the host first.
    """
    if HEREDOC_MARKER in script_text:
        raise ValueError("script contains the heredoc marker")
    body = script_text if script_text.endswith("\n") else script_text + "\n"
    return f"{command} <<'{HEREDOC_MARKER}'\n{body}{HEREDOC_MARKER}"


def if_container_running(container: str, command: list[str]) -> str:
    """A delete that succeeds when the container is gone or stopped (then nothing runs in it to stop)."""
    quoted = shlex.quote(container)
    running = f"docker inspect --type container --format '{{{{.State.Running}}}}' {quoted} 2>/dev/null"
    return f'if [ "$({running})" = true ]; then {shell_line(command)}; fi'


def fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def docker_host_url(node: NodeConfig) -> str:
    port = "" if node.ssh_port == 22 else f":{node.ssh_port}"
    return f"ssh://{node.user}@{node.host}{port}"
