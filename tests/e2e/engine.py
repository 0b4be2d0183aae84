"""The rehearsal engine: Pulumi's mocks, where each registration is carried out for real.

This is a test double for the Pulumi engine and its docker and command providers, small on
purpose. The real `__main__.py` runs under `pulumi.runtime.set_mocks`; every resource it registers
reaches `RehearsalCloud.new_resource`, which does what the provider would do on the simulated
nodes: a docker provider becomes the docker CLI over `ssh://` with the provider's own ssh options,
a RemoteImage makes the image present on the node (loaded from the locally built archive, since
nothing can be pulled here), a Container is created with the same arguments, and a remote Command
runs its `create` over real SSH with the connection it was given.

Between runs it keeps a state file, so a second run decides per resource — with the rules in
tests/lifecycle.py — whether to leave it, update it or replace it, and `destroy` deletes in reverse
order. It proves the generated commands and containers work together; it is not `pulumi up`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import pulumi

from tests import lifecycle
from tests.harness import ExtendedArgs, ProgramRun, run_program

SSH = "/usr/bin/ssh"


class ResourceError(Exception):
    """A resource operation failed; the message reads like Pulumi's: type (name): error: …"""


@dataclass
class Entry:
    urn: str
    typ: str
    name: str
    custom: bool
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    id: Optional[str]
    provider: str
    delete_before_replace: bool


@dataclass
class Operation:
    action: str
    typ: str
    name: str
    seconds: float


@dataclass
class State:
    path: Path
    entries: list[Entry] = field(default_factory=list)  # in completion order: deletes go in reverse

    @classmethod
    def load(cls, path: Path) -> State:
        if not path.exists():
            return cls(path)
        return cls(path, [Entry(**e) for e in json.loads(path.read_text())])

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds secrets, like a stack state
        with os.fdopen(fd, "w") as handle:
            json.dump([asdict(e) for e in self.entries], handle, indent=1)
        os.replace(tmp, self.path)

    def by_urn(self) -> dict[str, Entry]:
        return {e.urn: e for e in self.entries}


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class Transport:
    """How the engine reaches nodes: docker over ssh:// and plain ssh, each with its own options."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._lock = threading.Lock()

    def _ssh_wrapper(self, ssh_opts: list[str]) -> Path:
        """A directory with an `ssh` that adds the docker provider's ssh_opts, as the provider does."""
        key = str(abs(hash(tuple(ssh_opts))))
        directory = self.workdir / "ssh-wrappers" / key
        with self._lock:
            if not (directory / "ssh").exists():
                directory.mkdir(parents=True, exist_ok=True)
                script = f'#!/bin/sh\nexec {SSH} {" ".join(shlex.quote(o) for o in ssh_opts)} "$@"\n'
                (directory / "ssh").write_text(script)
                (directory / "ssh").chmod(0o755)
        return directory

    def docker(self, provider: dict[str, Any], *args: str, stdin: Any = None, timeout: float = 300) -> str:
        ssh_opts = provider.get("sshOpts") or []
        if isinstance(ssh_opts, str):  # provider config travels as JSON
            ssh_opts = json.loads(ssh_opts)
        env = {**os.environ, "PATH": f"{self._ssh_wrapper(ssh_opts)}:{os.environ['PATH']}"}
        env.pop("DOCKER_HOST", None)
        result = subprocess.run(
            ["docker", "-H", provider["host"], *args],
            env=env,
            stdin=stdin,
            capture_output=True,
            text=stdin is None or isinstance(stdin, int),
            timeout=timeout,
        )
        out = result.stdout if isinstance(result.stdout, str) else result.stdout.decode(errors="replace")
        err = result.stderr if isinstance(result.stderr, str) else result.stderr.decode(errors="replace")
        if result.returncode != 0:
            raise RuntimeError(f"docker {args[0]} on {provider['host']} failed: {_tail(err or out)}")
        return out.strip()

    def ssh_run(self, connection: dict[str, Any], command: str, stdin: Optional[str], timeout: float) -> tuple:
        """Run `command` as pulumi-command does: one SSH session, the remote shell, stdin fed in."""
        with tempfile.TemporaryDirectory(dir=self.workdir) as tmp:
            opts = ["-p", str(int(connection.get("port", 22))), "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
            if connection.get("privateKey"):
                key = Path(tmp) / "key"
                key.write_text(connection["privateKey"])
                key.chmod(0o600)
                opts += ["-i", str(key), "-o", "IdentitiesOnly=yes"]
            if connection.get("hostKey"):
                known = Path(tmp) / "known_hosts"
                port = int(connection.get("port", 22))
                host = connection["host"] if port == 22 else f"[{connection['host']}]:{port}"
                known.write_text(f"{host} {connection['hostKey']}\n")
                opts += ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}"]
            else:
                opts += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
            target = f"{connection.get('user', 'root')}@{connection['host']}"
            result = subprocess.run(
                [SSH, *opts, target, command],
                input=stdin or "",
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        return result.returncode, result.stdout, result.stderr


class RehearsalCloud(pulumi.runtime.Mocks):
    def __init__(
        self,
        state: State,
        transport: Transport,
        image_archives: dict[str, Path],
        on_operation: Optional[Callable[[Operation], None]] = None,
        stack_outputs: Optional[dict[str, dict]] = None,
    ):
        self.state = state
        self.previous = state.by_urn()
        self.transport = transport
        self.image_archives = image_archives  # reference → docker-save archive to "pull" from
        self.on_operation = on_operation
        self.stack_outputs = stack_outputs or {}  # what StackReferences to other rehearsal stacks read
        self.operations: list[Operation] = []
        self.registered: dict[str, Entry] = {}
        self.order: list[str] = []
        self._lock = threading.Lock()

    # --- the Mocks interface ------------------------------------------------------------------

    def new_resource(self, args: ExtendedArgs):
        if args.typ == "pulumi:pulumi:StackReference":
            name = args.inputs["name"]
            return f"{name}-ref", {**args.inputs, "outputs": self.stack_outputs.get(name, {}), "secretOutputNames": []}
        reg = args.registration
        entry = Entry(
            urn=reg.urn,
            typ=reg.typ,
            name=reg.name,
            custom=reg.custom,
            inputs=reg.inputs,
            outputs={},
            id=None,
            provider=reg.provider,
            delete_before_replace=reg.delete_before_replace,
        )
        old = self.previous.get(reg.urn)
        act = lifecycle.action(reg.typ, old.inputs if old else None, reg.inputs) if reg.custom else "same"
        started = time.monotonic()
        try:
            if not reg.custom:
                entry.id, entry.outputs = None, {}
            elif act == "same":
                entry.id, entry.outputs = old.id, old.outputs
            elif act == "replace":
                self._delete(old)
                entry.id, entry.outputs = self._create(entry)
            elif act == "update":
                entry.id, entry.outputs = self._update(old, entry)
            else:
                entry.id, entry.outputs = self._create(entry)
        except Exception as error:
            message = f"{reg.typ} ({reg.name}): error: {error}"
            self._record(Operation(f"{act}-failed", reg.typ, reg.name, time.monotonic() - started))
            raise ResourceError(message) from None
        if reg.custom:
            self._record(Operation(act, reg.typ, reg.name, time.monotonic() - started))
        with self._lock:
            self.registered[reg.urn] = entry
            self.order.append(reg.urn)
        return entry.id or f"{reg.name}-component", {**reg.inputs, **entry.outputs}

    def call(self, args: pulumi.runtime.MockCallArgs):
        return {}

    def _record(self, operation: Operation) -> None:
        with self._lock:
            self.operations.append(operation)
        if self.on_operation:
            self.on_operation(operation)

    # --- after a run -------------------------------------------------------------------------

    def finish(self, succeeded: bool) -> None:
        """Delete what the program no longer declares (only after a complete run), then save."""
        kept = [self.registered[urn] for urn in self.order]
        leftovers = [e for e in self.state.entries if e.urn not in self.registered]
        if succeeded:
            for entry in reversed(leftovers):
                self._timed_delete(entry)
            leftovers = []
        self.state.entries = leftovers + kept
        self.state.save()

    def destroy(self) -> None:
        for entry in reversed(list(self.state.entries)):
            self._timed_delete(entry)
            self.state.entries.remove(entry)
            self.state.save()

    def _timed_delete(self, entry: Entry) -> None:
        started = time.monotonic()
        try:
            self._delete(entry)
        except Exception as error:
            raise ResourceError(f"{entry.typ} ({entry.name}): error: deleting failed: {error}") from None
        if entry.custom:
            self._record(Operation("delete", entry.typ, entry.name, time.monotonic() - started))

    # --- providers -----------------------------------------------------------------------------

    def _provider_of(self, entry: Entry) -> dict[str, Any]:
        provider_urn = entry.provider.rsplit("::", 1)[0]  # a provider reference is "URN::ID"
        with self._lock:
            known = self.registered.get(provider_urn) or self.previous.get(provider_urn)
        if known is None:
            for candidate in self.state.entries:
                if candidate.urn == provider_urn:
                    known = candidate
        if known is None:
            raise RuntimeError(f"unknown provider {entry.provider}")
        return known.inputs

    def _create(self, entry: Entry) -> tuple[str, dict]:
        handler = {
            lifecycle.DOCKER_PROVIDER: lambda e: (f"{e.name}-provider", {}),
            lifecycle.IMAGE: self._create_image,
            lifecycle.CONTAINER: self._create_container,
            lifecycle.REMOTE_COMMAND: lambda e: self._run_remote(e, e.inputs.get("create")),
            lifecycle.LOCAL_COMMAND: self._run_local,
        }.get(entry.typ)
        if handler is None:
            raise RuntimeError(f"the rehearsal engine does not know how to create {entry.typ}")
        return handler(entry)

    def _update(self, old: Entry, new: Entry) -> tuple[str, dict]:
        if new.typ == lifecycle.REMOTE_COMMAND:
            _, outputs = self._run_remote(new, new.inputs.get("update") or new.inputs.get("create"))
            return old.id, outputs
        if new.typ == lifecycle.CONTAINER:
            name = new.inputs["name"]
            self.transport.docker(
                self._provider_of(new), "update", f"--restart={new.inputs.get('restart', 'no')}", name
            )
            return old.id, old.outputs
        return old.id, old.outputs

    def _delete(self, entry: Entry) -> None:
        if not entry.custom:
            return
        if entry.typ == lifecycle.CONTAINER:
            provider = self._provider_of(entry)
            name = entry.inputs["name"]
            grace = str(int(entry.inputs.get("destroyGraceSeconds", 10)))
            existing = self.transport.docker(provider, "ps", "-aq", "--filter", f"name=^{name}$")
            if existing:
                self.transport.docker(provider, "stop", "-t", grace, name)
                self.transport.docker(provider, "rm", "-f", name)
        elif entry.typ == lifecycle.IMAGE and not entry.inputs.get("keepLocally"):
            self.transport.docker(self._provider_of(entry), "rmi", entry.outputs.get("image_id", entry.inputs["name"]))
        elif entry.typ == lifecycle.REMOTE_COMMAND and entry.inputs.get("delete"):
            self._run_remote(entry, entry.inputs["delete"], stdin=None)

    # --- docker ---------------------------------------------------------------------------------

    def _create_image(self, entry: Entry) -> tuple[str, dict]:
        provider = self._provider_of(entry)
        reference = entry.inputs["name"]

        def inspect() -> Optional[dict]:
            try:
                return json.loads(self.transport.docker(provider, "image", "inspect", reference))[0]
            except RuntimeError:
                return None

        found = inspect()
        if found is None:
            archive = self.image_archives.get(reference)
            if archive is None:
                raise RuntimeError(
                    f"cannot pull {reference}: the rehearsal has no registry, only {sorted(self.image_archives)}"
                )
            with open(archive, "rb") as handle:
                self.transport.docker(provider, "load", stdin=handle, timeout=600)
            found = inspect()
        digests = found.get("RepoDigests") or []
        return found["Id"], {"image_id": found["Id"], "repo_digest": digests[0] if digests else ""}

    def _create_container(self, entry: Entry) -> tuple[str, dict]:
        provider = self._provider_of(entry)
        inputs = dict(entry.inputs)
        with tempfile.NamedTemporaryFile("w", dir=self.transport.workdir, delete=False) as env_file:
            os.chmod(env_file.name, 0o600)  # secrets (HF_TOKEN, RAY_AUTH_TOKEN) never reach an argv
            env_file.write("".join(f"{e}\n" for e in inputs.pop("envs", [])))
        try:
            argv = container_run_args(inputs, env_file.name)
            container_id = self.transport.docker(provider, *argv)
        finally:
            os.unlink(env_file.name)
        if inputs.get("mustRun", True):
            time.sleep(1)
            running = self.transport.docker(provider, "inspect", "-f", "{{.State.Running}}", container_id)
            if running != "true":
                logs = self.transport.docker(provider, "logs", "--tail", "40", container_id)
                raise RuntimeError(f"container {inputs['name']} exited at once:\n{logs}")
        return container_id, {"container_logs": ""}

    # --- commands -----------------------------------------------------------------------------

    def _run_remote(self, entry: Entry, command: Optional[str], stdin: Any = "use-inputs") -> tuple[str, dict]:
        if not command:
            return entry.id or f"{entry.name}-cmd", {"stdout": "", "stderr": ""}
        connection = entry.inputs["connection"]
        data = entry.inputs.get("stdin") if stdin == "use-inputs" else stdin
        code, out, err = self.transport.ssh_run(connection, command, data, timeout=3600)
        if code != 0:
            raise RuntimeError(
                f"Process exited with status {code}: running {command!r} on {connection['host']}:\n"
                f"{_tail(out, 120)}\n{_tail(err, 120)}"
            )
        return entry.id or f"{entry.name}-{int(time.time() * 1000)}", {
            "stdout": out.rstrip("\n"),
            "stderr": err.rstrip("\n"),
        }

    def _run_local(self, entry: Entry) -> tuple[str, dict]:
        result = subprocess.run(["/bin/sh", "-c", entry.inputs["create"]], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"Process exited with status {result.returncode}: {_tail(result.stderr)}")
        return f"{entry.name}-local", {"stdout": result.stdout.rstrip("\n"), "stderr": result.stderr.rstrip("\n")}


# Container inputs the engine turns into `docker run` flags; anything else is refused, so a new
# input in the program cannot be silently dropped by the rehearsal.
HANDLED_CONTAINER_INPUTS = {
    "name", "image", "entrypoints", "command", "networkMode", "ipcMode", "shmSize", "gpus", "ulimits",
    "mounts", "restart", "init", "privileged", "capabilities", "devices", "labels", "mustRun",
    "destroyGraceSeconds",
}  # fmt: skip


def container_run_args(inputs: dict[str, Any], env_file: str) -> list[str]:
    unknown = set(inputs) - HANDLED_CONTAINER_INPUTS
    if unknown:
        raise RuntimeError(f"the rehearsal engine does not handle container inputs {sorted(unknown)}")
    argv = ["run", "-d", "--name", inputs["name"], "--env-file", env_file]
    entrypoints = inputs.get("entrypoints") or []
    if entrypoints:
        argv += ["--entrypoint", entrypoints[0]]
    for flag, key in (("--network", "networkMode"), ("--ipc", "ipcMode"), ("--restart", "restart")):
        if inputs.get(key):
            argv += [flag, inputs[key]]
    if inputs.get("shmSize"):
        argv += ["--shm-size", f"{int(inputs['shmSize'])}m"]
    if inputs.get("gpus"):
        argv += ["--gpus", inputs["gpus"]]
    for limit in inputs.get("ulimits") or []:
        argv += ["--ulimit", f"{limit['name']}={int(limit['soft'])}:{int(limit['hard'])}"]  # numbers arrive as floats
    for mount in inputs.get("mounts") or []:
        spec = f"type={mount['type']},source={mount['source']},target={mount['target']}"
        argv += ["--mount", spec + (",readonly" if mount.get("readOnly") else "")]
    if inputs.get("init"):
        argv.append("--init")
    if inputs.get("privileged"):
        argv.append("--privileged")
    for capability in (inputs.get("capabilities") or {}).get("adds") or []:
        argv += ["--cap-add", capability]
    for device in inputs.get("devices") or []:
        argv += ["--device", f"{device['hostPath']}:{device.get('containerPath', device['hostPath'])}"]
    for label in inputs.get("labels") or []:
        argv += ["--label", f"{label['label']}={label['value']}"]
    return [*argv, inputs["image"], *entrypoints[1:], *(inputs.get("command") or [])]


@dataclass
class Deployment:
    """One stack on simulated nodes: its state file and how to apply the program to it."""

    workdir: Path
    image_archives: dict[str, Path]
    stack: str = "rehearsal"
    on_operation: Optional[Callable[[Operation], None]] = None

    @property
    def state_path(self) -> Path:
        return self.workdir / f"state-{self.stack}.json"

    def _cloud(self, stack_outputs: Optional[dict] = None) -> RehearsalCloud:
        return RehearsalCloud(
            State.load(self.state_path), Transport(self.workdir), self.image_archives, self.on_operation, stack_outputs
        )

    def up(self, config: dict[str, Any], secrets: dict[str, str], stack_outputs: Optional[dict] = None) -> tuple:
        """Apply the program; returns (ProgramRun, operations). Raises on the first failure."""
        cloud = self._cloud(stack_outputs)
        os.environ["SPARK_VLLM_HOME"] = str(self.workdir / "spark-vllm-home")
        succeeded = False
        try:
            run: ProgramRun = run_program(config, secrets, stack=self.stack, mocks=cloud)
            succeeded = True
            return run, list(cloud.operations)
        finally:
            cloud.finish(succeeded)

    def destroy(self) -> list[Operation]:
        cloud = self._cloud()
        cloud.destroy()
        return list(cloud.operations)
