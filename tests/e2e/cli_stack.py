"""A stack driven by the real Pulumi CLI, as the README tells users to drive theirs.

`pulumi login`, `pulumi stack init` and `pulumi config set` run as commands; `pulumi preview --diff`,
`pulumi up`, `pulumi refresh` and `pulumi destroy` run through Pulumi's Automation API, which runs
the same CLI and engine with the program served from this process (`--client`, an inline program):
the Python language host, `pulumi-language-python`, is the one piece of the CLI distribution the Go
module proxy does not serve. Provider plugins are found on PATH: the stand-ins in
tests/e2e/providers/bin (see there for why).

Each stack gets a machine of its own: a fresh HOME (no ~/.ssh: a machine that never connected to
the nodes), its own PULUMI_HOME, a `file://` backend, no SSH agent. What the CLI prints is passed
through to `echo`, and every engine event is kept, so tests assert on what the engine did to each
resource: `run.ops` maps resource name → operation (`create`, `update`, `replace`, `delete`, `same`…).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from pulumi import automation as auto

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "spark-vllm"
PLUGIN_DIR = ROOT / "tests" / "e2e" / "providers" / "bin"
CLI_DIR = ROOT / ".toolchain" / "bin"
PASSPHRASE = "rehearsal-only-passphrase"  # encrypts this stack's secrets in its config and state
REPLACE_OPS = {"replace", "create-replacement", "delete-replaced", "discard-replaced"}


def cli_missing() -> Optional[str]:
    if not (CLI_DIR / "pulumi").exists():
        return f"no Pulumi CLI at {CLI_DIR / 'pulumi'} (scripts/toolchain.sh builds it)"
    return None


def _log_timing(command: str, seconds: float, resources: dict[str, ResourceEvent], failed: bool = False) -> None:
    """With SPARK_VLLM_TEST_TIMINGS=FILE: one JSON line per command, failed ones too (the test, the
    command, its seconds, the slowest resources), to see where the rehearsal's time goes."""
    path = os.environ.get("SPARK_VLLM_TEST_TIMINGS")
    if not path:
        return
    slow = sorted(
        ((e.finished - e.started, f"{e.op} {e.name}") for e in resources.values() if e.finished is not None),
        reverse=True,
    )[:6]
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "command": command,
        "seconds": round(seconds, 2),
        "slowest": [[round(s, 2), what] for s, what in slow],
        **({"failed": True} if failed else {}),
    }
    with open(path, "a") as handle:
        handle.write(json.dumps(line) + "\n")


class StackError(Exception):
    """A `pulumi` command failed. The message holds the engine's error diagnostics (one per failed
    resource, named `type (name): error: …` as the CLI prints them) and the tail of its output."""

    def __init__(self, command: str, errors: list[str], output: str):
        self.command = command
        self.errors = errors
        self.output = output
        tail = "\n".join(output.strip().splitlines()[-40:])
        super().__init__(f"pulumi {command} failed:\n" + "\n".join(errors) + f"\n--- output ---\n{tail}")


@dataclass
class ResourceEvent:
    name: str
    type: str
    op: str
    started: float
    finished: Optional[float] = None
    failed: bool = False
    diffs: list[str] = field(default_factory=list)


@dataclass
class Run:
    """What one command did: per resource the operation, the CLI's own output, the outputs."""

    command: str
    resources: dict[str, ResourceEvent]
    output: str
    outputs: dict[str, Any]
    seconds: float
    diagnostics: list[str]
    change_summary: dict[str, int] = field(default_factory=dict)
    engine_seconds: Optional[float] = None  # the duration the engine itself reported (its summary)

    @property
    def ops(self) -> dict[str, str]:
        return {name: event.op for name, event in self.resources.items()}

    @property
    def changed(self) -> dict[str, str]:
        """Resources the command did (or would do) something to: name → create/update/replace/delete."""
        return {
            name: ("replace" if op in REPLACE_OPS else op)
            for name, op in self.ops.items()
            if op not in ("same", "read")
        }


class _Events:
    def __init__(self, on_event: Optional[Callable[[ResourceEvent], None]]):
        self.resources: dict[str, ResourceEvent] = {}
        self.errors: list[str] = []
        self.diagnostics: list[str] = []
        self.summary: dict[str, int] = {}
        self.engine_seconds: Optional[float] = None
        self._on_event = on_event
        self._lock = threading.Lock()

    def __call__(self, event: auto.EngineEvent) -> None:
        now = time.monotonic()
        with self._lock:
            if event.resource_pre_event:
                meta = event.resource_pre_event.metadata
                name = meta.urn.rsplit("::", 1)[-1]
                if meta.type == "pulumi:pulumi:Stack":
                    return
                op = meta.op.value if hasattr(meta.op, "value") else str(meta.op)
                known = self.resources.get(name)
                # A replacement arrives as several steps; keep "replace" as what happened to it.
                if known is None or op in REPLACE_OPS or known.op == "same":
                    self.resources[name] = ResourceEvent(name, meta.type, op, now, diffs=list(meta.diffs or []))
            elif event.res_outputs_event or event.res_op_failed_event:
                meta = (event.res_outputs_event or event.res_op_failed_event).metadata
                name = meta.urn.rsplit("::", 1)[-1]
                known = self.resources.get(name)
                if known is not None:
                    known.finished = now
                    known.failed = event.res_op_failed_event is not None
                    if known.op == "refresh":
                        # What a refresh found: gone (no new state), drifted (diffs), or as recorded.
                        known.op = "delete" if meta.new is None else ("update" if meta.diffs else "same")
                    if self._on_event:
                        self._on_event(known)
            elif event.diagnostic_event:
                diag = event.diagnostic_event
                message = diag.message.strip()
                if diag.severity == "error":
                    where = ""
                    if diag.urn:
                        parts = diag.urn.rsplit("::", 2)
                        where = f"{parts[-2].split('$')[-1]} ({parts[-1]}): "
                    self.errors.append(f"{where}error: {message}")
                elif not diag.ephemeral and diag.severity != "debug":
                    self.diagnostics.append(f"{diag.severity}: {message}")
            elif event.summary_event:
                self.summary = {str(k): v for k, v in (event.summary_event.resource_changes or {}).items()}
                self.engine_seconds = event.summary_event.duration_seconds


def _own_resources(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """A deployment's (or checkpoint's) resources, the stack's own `pulumi:pulumi:Stack` aside."""
    return [r for r in deployment.get("resources") or [] if r.get("type") != "pulumi:pulumi:Stack"]


def _program() -> None:
    runpy.run_path(str(ROOT / "__main__.py"), run_name="__main__")


class RehearsalStack:
    """One stack of the project on its own simulated deploying machine (directory `workdir`)."""

    def __init__(
        self,
        workdir: Path,
        stack: str = "rehearsal",
        *,
        backend: Optional[Path] = None,
        echo: Optional[Callable[[str], None]] = None,
        on_event: Optional[Callable[[ResourceEvent], None]] = None,
        agent_socket: Optional[Path] = None,
        spark_vllm_home: Optional[Path] = None,
    ):
        self.workdir = Path(workdir).resolve()
        self.agent_socket = agent_socket
        self._spark_vllm_home = spark_vllm_home
        self.stack = stack
        self.backend = Path(backend or self.workdir / "backend").resolve()
        self.project_dir = self.workdir / "project"
        self.home = self.workdir / "home"
        self.echo = echo
        self.on_event = on_event
        for directory in (self.project_dir, self.home, self.backend):
            directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / "Pulumi.yaml", self.project_dir / "Pulumi.yaml")

    # --- the machine ----------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("PULUMI_", "SSH_", "DOCKER_")) and key not in ("HOME", "SPARK_VLLM_HOME")
        }
        env.update(
            HOME=str(self.home),
            PATH=f"{PLUGIN_DIR}:{CLI_DIR}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            PULUMI_HOME=str(self.workdir / "pulumi-home"),
            PULUMI_CONFIG_PASSPHRASE=PASSPHRASE,
            PULUMI_SKIP_UPDATE_CHECK="true",
            PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION="true",
            PULUMI_AUTOMATION_API_SKIP_VERSION_CHECK="true",
            # Where the program writes the SSH key file on this machine (ssh's `~` is the account's home).
            SPARK_VLLM_HOME=str(self.spark_vllm_home),
        )
        if self.agent_socket is not None:
            env["SSH_AUTH_SOCK"] = str(self.agent_socket)
        return env

    @property
    def spark_vllm_home(self) -> Path:
        """Where the program writes the SSH key file (SPARK_VLLM_HOME). The same user on another
        machine names the same path (ssh's `~` does that for everybody else)."""
        return self._spark_vllm_home or self.home / ".spark-vllm"

    @property
    def config_file(self) -> Path:
        return self.project_dir / f"Pulumi.{self.stack}.yaml"

    def cli(self, *args: str, stdin: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
        """`pulumi ARGS…` in the project directory, as a user types it."""
        result = subprocess.run(
            [str(CLI_DIR / "pulumi"), *args],
            cwd=self.project_dir,
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if check and result.returncode != 0:
            raise StackError(" ".join(args), [result.stderr.strip()], result.stdout)
        return result

    def init(self) -> None:
        """`pulumi login file://…` and `pulumi stack init` (or select, when it exists)."""
        self.cli("login", f"file://{self.backend}")
        if self.cli("stack", "select", self.stack, check=False).returncode != 0:
            self.cli("stack", "init", self.stack)

    def configure(self, config: dict[str, Any], secrets: dict[str, str]) -> None:
        """The stack file with `config` (as a user edits Pulumi.<stack>.yaml), then each secret with
        `pulumi config set --secret KEY` reading the value from stdin (nothing on a command line)."""
        existing = yaml.safe_load(self.config_file.read_text()) if self.config_file.exists() else None
        document = existing or {}
        document["config"] = {f"{PROJECT}:{key}": value for key, value in config.items()}
        self.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
        for key, value in secrets.items():
            self.cli("config", "set", "--secret", key, stdin=value)

    def _workspace_stack(self) -> auto.Stack:
        opts = auto.LocalWorkspaceOptions(
            work_dir=str(self.project_dir),
            pulumi_home=str(self.workdir / "pulumi-home"),
            env_vars=self.env,
            pulumi_command=auto.PulumiCommand(root=str(CLI_DIR.parent)),
        )
        return auto.select_stack(self.stack, project_name=PROJECT, program=_program, opts=opts)

    @contextlib.contextmanager
    def _program_env(self) -> Iterator[None]:
        """The program runs in this process (inline): give it this machine's HOME-derived paths."""
        saved = {key: os.environ.get(key) for key in ("SPARK_VLLM_HOME", "SSH_AUTH_SOCK")}
        os.environ["SPARK_VLLM_HOME"] = str(self.spark_vllm_home)
        if self.agent_socket is None:
            os.environ.pop("SSH_AUTH_SOCK", None)
        else:
            os.environ["SSH_AUTH_SOCK"] = str(self.agent_socket)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _run(self, command: str, operation: Callable[..., Any]) -> Run:
        events = _Events(self.on_event)
        lines: list[str] = []

        def output(line: str) -> None:
            lines.append(line)
            if self.echo:
                self.echo(line)

        started = time.monotonic()
        with self._program_env():
            try:
                result = operation(on_output=output, on_event=events, color="never")
            except auto.CommandError as error:
                _log_timing(command, time.monotonic() - started, events.resources, failed=True)
                raise StackError(command, events.errors or [str(error)], "\n".join(lines)) from None
        outputs = {key: value.value for key, value in (getattr(result, "outputs", None) or {}).items()}
        summary = getattr(result, "change_summary", None) or events.summary
        run = Run(
            command=command,
            resources=events.resources,
            output="\n".join(lines),
            outputs=outputs,
            seconds=time.monotonic() - started,
            diagnostics=events.diagnostics,
            change_summary={str(getattr(k, "value", k)): v for k, v in (summary or {}).items()},
            engine_seconds=events.engine_seconds,
        )
        _log_timing(run.command, run.seconds, run.resources)
        return run

    def preview(self, **kwargs: Any) -> Run:
        """`pulumi preview --diff`."""
        return self._run("preview --diff", lambda **kw: self._workspace_stack().preview(diff=True, **kw, **kwargs))

    def up(self, **kwargs: Any) -> Run:
        """`pulumi up --yes`."""
        return self._run("up", lambda **kw: self._workspace_stack().up(**kw, **kwargs))

    def refresh(self) -> Run:
        """`pulumi refresh --yes`."""
        return self._run("refresh", lambda **kw: self._workspace_stack().refresh(**kw))

    def destroy(self, run_program: bool = False) -> Run:
        """`pulumi destroy --yes` (`--run-program`: run the program first, which writes the SSH key file)."""
        extra = {"run_program": True} if run_program else {}
        return self._run("destroy", lambda **kw: self._workspace_stack().destroy(**kw, **extra))

    def outputs(self) -> dict[str, Any]:
        return json.loads(self.cli("stack", "output", "--json").stdout or "{}")

    def export(self) -> str:
        """`pulumi stack export`: the state as it is stored (secrets encrypted)."""
        return self.cli("stack", "export").stdout

    def holds_resources(self) -> bool:
        """Whether the stack's state (the `file://` backend's checkpoint, read directly: no CLI run)
        records any resource or pending operation; True when it cannot be read."""
        path = self.backend / ".pulumi" / "stacks" / PROJECT / f"{self.stack}.json"
        try:
            latest = json.loads(path.read_text())["checkpoint"].get("latest") or {}
        except (OSError, ValueError, KeyError, AttributeError):
            return True
        return bool(_own_resources(latest) or latest.get("pending_operations"))

    def resource_count(self) -> int:
        return len(_own_resources(json.loads(self.export()).get("deployment", {})))

    def fresh_clone(self, workdir: Path, agent_socket: Optional[Path] = None) -> RehearsalStack:
        """The same stack seen from another machine: a new directory with the project's files and the
        stack's config file (both committed in a real repository), the same backend and passphrase,
        and nothing the program wrote on this machine."""
        clone = RehearsalStack(
            workdir,
            self.stack,
            backend=self.backend,
            echo=self.echo,
            on_event=self.on_event,
            agent_socket=agent_socket,
            spark_vllm_home=self.spark_vllm_home,
        )
        shutil.copyfile(self.config_file, clone.config_file)
        clone.cli("login", f"file://{self.backend}")
        clone.cli("stack", "select", self.stack)
        return clone

    def versions(self) -> dict[str, str]:
        """The CLI's version and, per provider package, the plugin version the state records."""
        found = {"pulumi": self.cli("version").stdout.strip()}
        deployment = json.loads(self.export()).get("deployment", {})
        for resource in deployment.get("resources") or []:
            kind = resource.get("type", "")
            if kind.startswith("pulumi:providers:"):
                version = (resource.get("inputs") or {}).get("version") or "?"
                found[kind.rsplit(":", 1)[1]] = version
        return found
