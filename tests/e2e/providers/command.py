"""Stand-in for the pulumi-command provider (v1.2.1): `command:remote:Command` and `command:local:Command`.

NOT pulumi-command. The real provider cannot be built on our machines (its Go module is not served
by the Go module proxy we reach; see docs/development.md), so the rehearsal runs this test
double in its place, behind the real Pulumi CLI and engine. Every rule below was read from
pulumi-command v1.2.1 and pulumi-go-provider v1.3.0 (provider/pkg/provider/remote/*.go, local/*.go,
infer/resource.go) and is kept as strict as the original:

* Remote commands dial with an SSH client library (paramiko), never the system `ssh`: only the
  `privateKey`, the `password` (then keyboard-interactive with it) and the agent at
  `agentSocketPath`/`SSH_AUTH_SOCK` authenticate, in that order, and once a private key was tried
  the agent is not; `~/.ssh/id_*`, ssh_config and known_hosts are never read. An agent socket that
  cannot be dialled fails at once, even beside a key.
* `hostKey` is an authorized_keys line; only that key is accepted and only its algorithm is offered
  (an `ssh-rsa` key means SHA-1 RSA). Without it any host key is accepted.
* Every dial error, authentication included, is retried `dialErrorLimit` times (default 10) with a
  backoff from 100 ms ×1.5 capped at 5 s; then `after N failed attempts: <last error>`.
* One connection and one session per run; `environment` is sent as env requests that must be
  accepted (sshd's AcceptEnv), stdin only when non-empty. Output lines stream to the engine as
  status lines; stdout/stderr lose one trailing newline; a failure reads
  `Process exited with status N: running "<cmd>":\\n<output>`.
* Check fills connection defaults (port 22, user root, dialErrorLimit 10, perDialTimeout 15) and
  makes `connection` secret. Diff: every change is an update except `triggers` (the SDK asks the
  engine to replace on `triggers[*]`); never delete-before-replace. Update runs `update`, else
  `create`, with the new inputs and PULUMI_COMMAND_STDOUT/STDERR of the last run; Delete runs the
  old state's `delete` with the old connection. Read changes nothing. Preview runs nothing.
"""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import paramiko
from paramiko.agent import AgentSSH
from paramiko.common import cMSG_CHANNEL_REQUEST
from paramiko.message import Message

from tests.e2e.providers.plugin import (
    ADD,
    DELETE,
    UNKNOWN,
    Call,
    Provider,
    ProviderError,
    Resource,
    Secret,
    diff_response,
    reveal,
    serve,
    unique_id,
)

VERSION = "1.2.1"
CONNECTION_DEFAULTS = {"port": 22, "user": "root", "dialErrorLimit": 10, "perDialTimeout": 15}
CONNECTION_SECRETS = ("password", "privateKey", "privateKeyPassword")
REMOTE_INPUTS = {
    "connection", "create", "update", "delete", "triggers", "environment", "stdin", "addPreviousOutputInEnv",
    "logging",
}  # fmt: skip
LOCAL_INPUTS = {
    "create", "update", "delete", "triggers", "environment", "stdin", "addPreviousOutputInEnv", "logging",
    "interpreter", "dir", "assetPaths", "archivePaths",
}  # fmt: skip
ACCEPT_ENV_HINT = (
    "Unable to set '{key}'. This only works if your SSH server is configured to accept\n"
    "\tthese variables via AcceptEnv. Alternatively, if a Bash-like shell runs the command on the remote host, you could\n"
    "\tprefix the command itself with the variables in the form 'VAR=value command'"
)


def go_quote(text: str) -> str:
    """Go's %q of a string (how the real provider names the command in an error)."""
    escapes = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class CommandFailedError(ProviderError):
    pass


# --- running, the part both resources share --------------------------------------------------------


class Streams:
    """stdout and stderr kept apart, a combined copy in write order, and each line sent to the engine."""

    def __init__(self, call: Call, logging: Optional[str]):
        self.call = call
        self.logged = {"stdout": logging in (None, "stdout", "stdoutAndStderr"), "stderr": logging in (None, "stderr", "stdoutAndStderr")}  # fmt: skip
        self.parts: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.combined = bytearray()
        self._lock = threading.Lock()

    def pump(self, name: str, read: Callable[[], bytes]) -> threading.Thread:
        def run() -> None:
            pending = b""
            while chunk := read():
                with self._lock:
                    self.parts[name] += chunk
                    self.combined += chunk
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if self.logged[name]:
                    for line in lines:
                        self.call.status(line.decode(errors="replace"))
            if pending and self.logged[name]:
                self.call.status(pending.decode(errors="replace"))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def text(self, name: str) -> str:
        value = self.parts[name].decode(errors="replace")
        return value[:-1] if value.endswith("\n") else value

    def failure(self, cause: str, command: str) -> CommandFailedError:
        return CommandFailedError(f"{cause}: running {go_quote(command)}:\n{self.combined.decode(errors='replace')}")


def previous_output_env(state: dict[str, Any], inputs: dict[str, Any]) -> dict[str, str]:
    if inputs.get("addPreviousOutputInEnv") is False:
        return {}
    env = {}
    for key, output in (("PULUMI_COMMAND_STDOUT", "stdout"), ("PULUMI_COMMAND_STDERR", "stderr")):
        value = reveal(state.get(output))
        if isinstance(value, str) and value:
            env[key] = value
    return env


# --- SSH ---------------------------------------------------------------------------------------------


def parse_private_key(text: str, passphrase: Optional[str]) -> paramiko.PKey:
    problems = []
    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text), password=passphrase)
        except paramiko.PasswordRequiredException:
            raise ProviderError("ssh: this private key is passphrase protected") from None
        except (paramiko.SSHException, ValueError) as error:
            problems.append(str(error))
    raise ProviderError("ssh: no key found")


def parse_host_key(line: str) -> paramiko.PKey:
    """ssh.ParseAuthorizedKey: `[options] TYPE BASE64 [comment]`."""
    fields = line.split()
    for index, word in enumerate(fields[:-1]):
        if word.startswith(("ssh-", "ecdsa-", "sk-")):
            try:
                return paramiko.PKey.from_type_string(word, base64.b64decode(fields[index + 1]))
            except (ValueError, paramiko.SSHException, TypeError):
                break
    raise ProviderError("failed to parse host key: ssh: no key found")


def _agent(path: str) -> AgentSSH:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as error:
        sock.close()
        reason = (
            "no such file or directory"
            if isinstance(error, FileNotFoundError)
            else (error.strerror or str(error)).lower()
        )
        raise ProviderError(f"dial unix {path}: connect: {reason}") from None
    agent = AgentSSH()
    agent._connect(sock)  # noqa: SLF001 - paramiko's Agent only reads SSH_AUTH_SOCK; this is its own connect
    return agent


class DialError(Exception):
    pass


def _handshake(connection: dict[str, Any], methods: list, host_key: Optional[paramiko.PKey]) -> paramiko.Transport:
    host, port = connection["host"], int(connection["port"])
    timeout = connection.get("perDialTimeout") or None
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise DialError(f"dial tcp {host}:{port}: i/o timeout") from None
    except OSError as error:
        raise DialError(f"dial tcp {host}:{port}: connect: {(error.strerror or str(error)).lower()}") from None
    sock.settimeout(None)  # the timeout covers the TCP connect only, as in x/crypto/ssh
    transport = paramiko.Transport(sock)
    if host_key is not None:
        transport.get_security_options().key_types = (host_key.get_name(),)
    try:
        try:
            transport.start_client(timeout=60)
        except paramiko.ssh_exception.IncompatiblePeer as error:
            offered = [host_key.get_name()] if host_key else []
            raise DialError(
                f"ssh: handshake failed: ssh: no common algorithm for host key; we offered: {offered}: {error}"
            ) from None
        except (paramiko.SSHException, EOFError, OSError) as error:
            raise DialError(f"ssh: handshake failed: {error or type(error).__name__}") from None
        if host_key is not None and transport.get_remote_server_key().asbytes() != host_key.asbytes():
            raise DialError("ssh: handshake failed: ssh: host key mismatch")
        attempted = ["none"]
        try:
            transport.auth_none(connection["user"])
        except paramiko.BadAuthenticationType:
            pass
        except paramiko.AuthenticationException:
            pass
        for name, attempt in methods:
            if transport.is_authenticated():
                break
            if name in attempted:
                continue  # x/crypto/ssh tries each method name once: agent keys after a failed key are skipped
            attempted.append(name)
            try:
                attempt(transport)
            except paramiko.AuthenticationException:
                continue
        if not transport.is_authenticated():
            raise DialError(
                "ssh: handshake failed: ssh: unable to authenticate, attempted methods "
                f"[{' '.join(attempted)}], no supported methods remain"
            )
        return transport
    except BaseException:
        transport.close()
        raise


def dial(call: Call, connection: dict[str, Any]) -> paramiko.Transport:
    connection = reveal(connection)
    if connection.get("proxy"):
        raise ProviderError("the stand-in command provider does not implement connection.proxy")
    user = connection["user"]
    host_key = parse_host_key(connection["hostKey"]) if connection.get("hostKey") else None
    methods: list[tuple[str, Callable]] = []
    if connection.get("privateKey"):
        key = parse_private_key(connection["privateKey"], connection.get("privateKeyPassword"))
        methods.append(("publickey", lambda t: t.auth_publickey(user, key)))
    if connection.get("password"):
        password = connection["password"]
        methods.append(("password", lambda t: t.auth_password(user, password, fallback=False)))
        methods.append(
            (
                "keyboard-interactive",
                lambda t: t.auth_interactive(user, lambda title, text, prompts: [password] * len(prompts)),
            )
        )
    agent_path = connection.get("agentSocketPath") or os.environ.get("SSH_AUTH_SOCK")
    if agent_path:
        agent = _agent(agent_path)  # a stale socket fails here, not retried

        def with_agent(transport: paramiko.Transport) -> None:
            for agent_key in agent.get_keys():
                try:
                    transport.auth_publickey(user, agent_key)
                    return
                except paramiko.AuthenticationException:
                    continue
            raise paramiko.AuthenticationException("agent keys refused")

        methods.append(("publickey", with_agent))
    limit = int(connection["dialErrorLimit"])
    delay, attempt = 0.1, 0
    while True:
        try:
            return _handshake(connection, methods, host_key)
        except DialError as error:
            last = str(error)
        attempt += 1
        if limit != -1 and attempt > limit:
            raise ProviderError(f"after {attempt - 1} failed attempts: {last}")
        call.status(f"Dial {attempt}/{'inf' if limit == -1 else limit} failed: retrying")
        time.sleep(delay)
        delay = min(delay * 1.5, 5.0)


def _setenv(channel: paramiko.Channel, key: str, value: str) -> bool:
    """An `env` request with want-reply, as Go's session.Setenv sends it; False when refused."""
    message = Message()
    message.add_byte(cMSG_CHANNEL_REQUEST)
    message.add_int(channel.remote_chanid)
    message.add_string("env")
    message.add_boolean(True)
    message.add_string(key)
    message.add_string(value)
    channel._event_pending()  # noqa: SLF001 - paramiko's own request/reply handshake
    channel.transport._send_user_message(message)  # noqa: SLF001
    try:
        channel._wait_for_event()  # noqa: SLF001
        return True
    except paramiko.SSHException:
        return False


def run_remote(call: Call, inputs: dict[str, Any], command: str, previous: dict[str, str]) -> dict[str, str]:
    transport = dial(call, inputs["connection"])
    try:
        channel = transport.open_session()
        for key, value in (reveal(inputs.get("environment")) or {}).items():
            if not _setenv(channel, key, value):
                call.error(ACCEPT_ENV_HINT.format(key=key))
                raise ProviderError(f'could not set environment variable "{key}": ssh: setenv failed')
        for key, value in previous.items():
            if not _setenv(channel, key, value):
                call.warn(ACCEPT_ENV_HINT.format(key=key))
                channel = transport.open_session()  # a refused request closes paramiko's channel; Go's stays open
        streams = Streams(call, inputs.get("logging"))
        channel.exec_command(command)
        stdin = reveal(inputs.get("stdin")) or ""
        pumps = [
            streams.pump("stdout", lambda: channel.recv(65536)),
            streams.pump("stderr", lambda: channel.recv_stderr(65536)),
        ]
        if stdin:
            channel.sendall(stdin.encode())
        channel.shutdown_write()
        status = channel.recv_exit_status()
        for pump in pumps:
            pump.join()
        if status == -1:
            raise streams.failure("wait: remote command exited without exit status or exit signal", command)
        if status != 0:
            raise streams.failure(f"Process exited with status {status}", command)
        return {"stdout": streams.text("stdout"), "stderr": streams.text("stderr")}
    finally:
        transport.close()


def run_local(call: Call, inputs: dict[str, Any], command: str, previous: dict[str, str]) -> dict[str, str]:
    plain = reveal(inputs)
    argv = [*(plain.get("interpreter") or ["/bin/sh", "-c"]), command]
    env = {**os.environ, **(plain.get("environment") or {}), **previous}
    streams = Streams(call, plain.get("logging"))
    try:
        process = subprocess.Popen(
            argv,
            cwd=plain.get("dir") or None,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError as error:
        raise ProviderError(f"exec: {argv[0]!r}: {error.strerror}") from None
    pumps = [
        streams.pump("stdout", lambda: process.stdout.read1(65536)),
        streams.pump("stderr", lambda: process.stderr.read1(65536)),
    ]
    if plain.get("stdin"):
        process.stdin.write(plain["stdin"].encode())
    process.stdin.close()
    status = process.wait()
    for pump in pumps:
        pump.join()
    if status != 0:
        cause = f"signal: {-status}" if status < 0 else f"exit status {status}"
        raise streams.failure(cause, command)
    return {"stdout": streams.text("stdout"), "stderr": streams.text("stderr")}


# --- the resources ------------------------------------------------------------------------------------


class Command(Resource):
    def __init__(self, known: set[str], runner: Callable, remote: bool):
        self.known = known
        self.runner = runner
        self.remote = remote

    def check(self, call: Call, olds: dict, news: dict) -> tuple[dict, list[tuple[str, str]]]:
        failures = [
            (key, f"Unrecognized field '{key}'") for key in news if key not in self.known and not key.startswith("__")
        ]
        inputs = dict(news)
        if self.remote:
            connection = inputs.get("connection")
            plain = reveal(connection)
            if plain is UNKNOWN:
                pass  # not known yet (a preview): checked when it is
            elif not isinstance(plain, dict) or not plain.get("host"):
                failures.append(("connection", "Missing required field 'connection.host'"))
            else:
                inner = dict(connection.value if isinstance(connection, Secret) else connection)
                for key, default in CONNECTION_DEFAULTS.items():
                    if inner.get(key) is None:
                        inner[key] = default
                for key in CONNECTION_SECRETS:
                    if inner.get(key) is not None and not isinstance(inner[key], Secret):
                        inner[key] = Secret(inner[key])
                inputs["connection"] = Secret(inner)
        return inputs, failures

    def diff(self, call: Call, id_: str, old_inputs: dict, olds: dict, news: dict):
        # Only `triggers` added or removed as a whole replaces here; element changes are replaced by
        # the engine because the SDK registers replaceOnChanges: ["triggers[*]"].
        return diff_response(old_inputs, news, lambda key, path, kind: path == "triggers" and kind in (ADD, DELETE))

    def _run(self, call: Call, inputs: dict, command: Optional[str], state: dict) -> dict[str, str]:
        try:
            return self.runner(call, inputs, command, previous_output_env(state, inputs))
        except (paramiko.SSHException, OSError, EOFError) as error:
            raise ProviderError(f"{type(error).__name__}: {error}") from None

    def create(self, call: Call, news: dict) -> tuple[str, dict]:
        id_ = unique_id(call.name)
        if call.preview:
            return id_, {**news, "stdout": UNKNOWN, "stderr": UNKNOWN}
        command = reveal(news.get("create"))
        if not command:
            return id_, {**news, "stdout": "", "stderr": ""}
        return id_, {**news, **self._run(call, news, command, {})}

    def update(self, call: Call, id_: str, olds: dict, news: dict, old_inputs: dict) -> dict:
        if call.preview:
            return {**news, "stdout": UNKNOWN, "stderr": UNKNOWN}
        command = reveal(news.get("update")) or reveal(news.get("create"))
        if not command:
            return {**news, "stdout": olds.get("stdout", ""), "stderr": olds.get("stderr", "")}
        return {**news, **self._run(call, news, command, olds)}

    def delete(self, call: Call, id_: str, olds: dict, old_inputs: dict) -> None:
        command = reveal(olds.get("delete"))
        if command:
            self._run(call, olds, command, olds)


PROVIDER = Provider(
    name="command",
    version=VERSION,
    resources={
        "command:remote:Command": Command(REMOTE_INPUTS, run_remote, remote=True),
        "command:local:Command": Command(LOCAL_INPUTS, run_local, remote=False),
    },
)


if __name__ == "__main__":
    serve(PROVIDER)
