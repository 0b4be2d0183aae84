"""A stack driven by the real Pulumi CLI, as the README tells users to drive theirs.

Every command is the one a user types, run in the stack's project directory: `pulumi login`, `stack init`,
`config set --secret`, `preview --diff`, `up --yes` (which previews first), `refresh --yes`, `destroy --yes`.
The CLI runs the program itself through the Python language host with the project's venv (Pulumi.yaml's
`runtime`), so Pulumi.yaml, its config declarations and `__main__.py` are what is tested; the language
host and both provider plugins are the real ones, built by scripts/toolchain.sh: the CLI with the language
host beside it on PATH (.toolchain/bin), the plugins installed as `pulumi plugin install` lays them out
(.toolchain/plugins, which is each stack's PULUMI_HOME/plugins).

Each stack gets a machine of its own: a fresh HOME (no ~/.ssh: a machine that never connected to
the nodes), its own PULUMI_HOME, a `file://` backend, no SSH agent. What the CLI prints is passed
through to `echo`, and every engine event (`--event-log`) is kept, so tests assert on what the engine did
to each resource: `run.ops` maps resource name → operation (`create`, `update`, `replace`, `delete`, `same`…).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pulumi import automation as auto
from pulumi.runtime import rpc

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "spark-vllm"
CLI_DIR = ROOT / ".toolchain" / "bin"  # the CLI and the language host beside it (scripts/toolchain.sh)
PLUGINS_DIR = ROOT / ".toolchain" / "plugins"  # the provider plugins, installed (scripts/toolchain.sh)
TOOLS = ("bin/pulumi", "bin/pulumi-language-python", "plugins/resource-command-v*", "plugins/resource-docker-v*")
PROGRAM_FILES = ("__main__.py", "components")  # linked into each stack's project directory
VENV_OPTION = "    virtualenv: venv\n"  # Pulumi.yaml's runtime option, as the README's checkout uses it
COMMAND_TIMEOUT_S = 1800
PASSPHRASE = "rehearsal-only-passphrase"  # encrypts this stack's secrets in its config and state
# Pulumi's passphrase secrets, as the CLI writes them (v3.276.0: pkg/secrets/passphrase/manager.go,
# sdk/go/common/resource/config/crypt.go): the stack file's `encryptionsalt` is "v1:<salt>:<'pulumi' encrypted>" and a
# secret "v1:<nonce>:<ciphertext>", base64, AES-256-GCM under PBKDF2-SHA256(passphrase, salt, 1,000,000 rounds).
PBKDF2_ROUNDS = 1_000_000
_KEYS: dict[str, bytes] = {}  # an encryptionsalt's key, derived once a process
_SALT: list[str] = []  # the encryptionsalt this process gives the stacks whose secrets it writes
REPLACE_OPS = {"replace", "create-replacement", "delete-replaced", "discard-replaced"}
# The key under which the engine writes a value that is not plain JSON (a secret, an asset, a resource reference):
# pulumi/sdk/go/common/resource/sig/sig.go `Key`, as the Python SDK has it (tests/harness.py takes it from there too)
SIGNATURE_KEY = rpc._special_sig_key


def prune_stale_bytecode(basetemp: Path) -> None:
    """The bytecode earlier sessions' stacks left under PYTHONPYCACHEPREFIX (./run-tests sets it): each stack's
    project directory is under pytest's temporary directory, and the cache mirrors its path, so every session added
    its stacks' compiled `components/` (about 1 MB each, 30 stacks) for directories pytest has since removed. Only the
    current session's are kept."""
    prefix = sys.pycache_prefix
    sessions = next((path for path in Path(basetemp).resolve().parents if path.name.startswith("pytest-of-")), None)
    if not prefix or sessions is None:
        return
    current = Path(basetemp).resolve().relative_to(sessions).parts[0]
    mirror = Path(prefix) / sessions.relative_to(sessions.anchor)
    for stale in mirror.glob("pytest-*"):
        if stale.name != current:
            shutil.rmtree(stale, ignore_errors=True)  # another process may be removing it too


def cli_missing() -> Optional[str]:
    missing = [tool for tool in TOOLS if not any(CLI_DIR.parent.glob(tool))]
    if missing:
        return f"no {', '.join(missing)} in {CLI_DIR.parent} (scripts/toolchain.sh builds them)"
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


def _skip_preview(preview_first: bool) -> list[str]:
    return [] if preview_first else ["--skip-preview"]


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
    steps: list[str] = field(default_factory=list)  # every step the engine took for it, in order

    @property
    def change(self) -> str:
        """create/update/replace/delete/same…: a replacement's steps as "replace", except a resource only
        deleted in one (a dependent of a delete-before-replace that the program no longer declares: the engine
        deletes it first, as `delete-replaced`, and creates nothing in its place) as "delete"."""
        replacing = set(self.steps) & REPLACE_OPS
        if replacing and replacing <= {"delete-replaced", "discard-replaced"}:
            return "delete"
        return "replace" if self.op in REPLACE_OPS else self.op


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
        changes = {name: event.change for name, event in self.resources.items()}
        return {name: change for name, change in changes.items() if change not in ("same", "read")}


class _Events:
    def __init__(self):
        self.resources: dict[str, ResourceEvent] = {}
        self.errors: list[str] = []
        self.diagnostics: list[str] = []
        self.summary: dict[str, int] = {}
        self.engine_seconds: Optional[float] = None
        self.failures: list[str] = []  # events that could not be read or handled
        self.stack_outputs: Optional[dict[str, Any]] = None  # the stack's outputs as the engine registered them
        self._lock = threading.Lock()

    def __call__(self, event: auto.EngineEvent) -> None:
        now = time.monotonic()
        with self._lock:
            if event.prelude_event:
                # A phase begins: `up`, `refresh` and `destroy` preview first; what counts is the last phase.
                self.resources, self.diagnostics, self.summary, self.stack_outputs = {}, [], {}, None
            elif event.resource_pre_event:
                meta = event.resource_pre_event.metadata
                name = meta.urn.rsplit("::", 1)[-1]
                if meta.type == "pulumi:pulumi:Stack":
                    return
                op = meta.op.value if hasattr(meta.op, "value") else str(meta.op)
                known = self.resources.get(name)
                if known is None or known.op == "same":
                    self.resources[name] = ResourceEvent(
                        name, meta.type, op, now, diffs=list(meta.diffs or []), steps=[op]
                    )
                else:  # a replacement arrives as several steps; keep one of them as what happened to it
                    known.steps.append(op)
                    known.op = op if op in REPLACE_OPS else known.op
            elif event.res_outputs_event or event.res_op_failed_event:
                meta = (event.res_outputs_event or event.res_op_failed_event).metadata
                name = meta.urn.rsplit("::", 1)[-1]
                if meta.type == "pulumi:pulumi:Stack" and event.res_outputs_event and meta.new is not None:
                    self.stack_outputs = dict(meta.new.outputs or {})
                known = self.resources.get(name)
                if known is not None:
                    known.finished = now
                    known.failed = event.res_op_failed_event is not None
                    if known.op == "refresh":
                        # What a refresh found: gone (no new state), drifted (diffs), or as recorded.
                        known.op = "delete" if meta.new is None else ("update" if meta.diffs else "same")
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


def _special(value: Any) -> bool:
    """Whether an engine event's value holds one that is not plain JSON: a secret (which the event log writes
    blinded), an asset, a resource reference (pulumi/pkg/resource/stack/deployment.go SerializePropertyValue)."""
    if isinstance(value, dict):
        return SIGNATURE_KEY in value or any(_special(item) for item in value.values())
    if isinstance(value, list):
        return any(_special(item) for item in value)
    return False


def _encrypted(entry: Any, value: Any) -> bool:
    """Whether a stack file's `entry` holds `value`'s shape encrypted: `{secure: …}`, or a map of those for a map."""
    if isinstance(value, dict):
        return (
            isinstance(entry, dict)
            and entry.keys() == value.keys()
            and all(_encrypted(entry[k], v) for k, v in value.items())
        )
    return isinstance(entry, dict) and list(entry) == ["secure"]


def _derive(salt: str) -> bytes:
    """The passphrase's AES key under a base64 salt."""
    return hashlib.pbkdf2_hmac("sha256", PASSPHRASE.encode(), base64.b64decode(salt), PBKDF2_ROUNDS, 32)


def _passphrase_key(salt_state: str) -> bytes:
    """The AES key of a stack file's `encryptionsalt`, checked against the "pulumi" it encrypts, as the CLI does."""
    if salt_state not in _KEYS:
        version, salt, check = salt_state.split(":", 2)
        assert version == "v1", f"encryptionsalt {salt_state!r}: not Pulumi's v1"
        key = _derive(salt)
        try:
            known = _decrypt(key, check) == "pulumi"
        except InvalidTag:
            known = False
        assert known, "encryptionsalt: not this passphrase's"
        _KEYS[salt_state] = key
    return _KEYS[salt_state]


def _encrypt(key: bytes, value: str) -> str:
    nonce = os.urandom(12)
    sealed = AESGCM(key).encrypt(nonce, value.encode(), None)
    return f"v1:{base64.b64encode(nonce).decode()}:{base64.b64encode(sealed).decode()}"


def _decrypt(key: bytes, secret: str) -> str:
    version, nonce, sealed = secret.split(":", 2)
    assert version == "v1", f"a secret not in Pulumi's v1: {version!r}"
    return AESGCM(key).decrypt(base64.b64decode(nonce), base64.b64decode(sealed), None).decode()


def process_salt() -> str:
    """An `encryptionsalt` for this process's stacks (a new salt, its check value), so that one key derivation serves
    every secret they hold."""
    if not _SALT:
        salt = base64.b64encode(os.urandom(8)).decode()
        key = _derive(salt)
        _SALT.append(f"v1:{salt}:{_encrypt(key, 'pulumi')}")
        _KEYS[_SALT[0]] = key
    return _SALT[0]


def _secure(key: bytes, value: Any) -> Any:
    """`value` as `pulumi config set --secret` leaves it in the stack file: `{secure: …}`, a map of those for a map
    (what `--path KEY.SUB` sets one at a time)."""
    if isinstance(value, dict):
        return {sub: _secure(key, item) for sub, item in value.items()}
    return {"secure": _encrypt(key, value)}


def _own_resources(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """A deployment's (or checkpoint's) resources, the stack's own `pulumi:pulumi:Stack` aside."""
    return [r for r in deployment.get("resources") or [] if r.get("type") != "pulumi:pulumi:Stack"]


def _follow(path: Path, events: _Events, done: threading.Event) -> None:
    """Hand each event the engine writes to `--event-log` (a FIFO here) to `events` as it comes, until `done`
    and nothing is left. A FIFO, not a file: `pulumi up` opens the log once for its preview and again, with
    O_TRUNC, for the update, which a reader of a plain file would find itself in the middle of."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    buffer = b""
    try:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # a writer, no data yet
                chunk = None
            if not chunk:
                if chunk == b"" and done.is_set():  # no writer left and nothing unread
                    return
                time.sleep(0.05)
                continue
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                try:
                    if line.strip():
                        events(auto.EngineEvent.from_json(json.loads(line)))
                except Exception as error:  # keep reading: a writer to a full FIFO would wait for ever
                    events.failures.append(f"{type(error).__name__}: {error} in {line[:200]!r}")
    finally:
        os.close(fd)


class RehearsalStack:
    """One stack of the project on its own simulated deploying machine (directory `workdir`)."""

    def __init__(
        self,
        workdir: Path,
        stack: str = "rehearsal",
        *,
        backend: Optional[Path] = None,
        echo: Optional[Callable[[str], None]] = None,
        agent_socket: Optional[Path] = None,
        spark_vllm_home: Optional[Path] = None,
        checkpoints: bool = True,
        typed: bool = True,
    ):
        self.workdir = Path(workdir).resolve()
        # False: PULUMI_SKIP_CHECKPOINTS, the engine writes the stack's state once at the end of each command instead
        # of after every step (each write serializes, backs up and checks the whole state: 2.7 MB for two nodes). The
        # state it ends with is the same; what a crash of the CLI mid-way would keep is not, which no test asks.
        # The CLI's CPU for a several-models stack's preview, up and destroy: 34.9 -> 10.9 s (2026-12-07).
        self.checkpoints = checkpoints
        # True: the stack is set up as the README types it (`pulumi login`, `stack init`, each secret with `pulumi
        # config set --secret` from stdin). False: its backend from PULUMI_BACKEND_URL (no `login`), and its secrets
        # written into the stack file encrypted as that command writes them, under one salt a process: each such
        # command is a CLI start deriving the passphrase's key (PBKDF2, 0.3-0.5 CPU-s), 3 to 8 secrets a stack, about
        # 150 starts a suite (2026-12-07). The CLI reads them back in every command (a wrong one fails it).
        self.typed = typed
        self.agent_socket = agent_socket
        self._spark_vllm_home = spark_vllm_home
        self.stack = stack
        self.backend = Path(backend or self.workdir / "backend").resolve()
        self.project_dir = self.workdir / "project"
        self.home = self.workdir / "home"
        self.echo = echo
        self._secrets_set: dict[str, Any] = {}  # each secret `configure` set in the stack's file, as it set it
        self.outputs_read_by_cli = 0  # `up`s whose outputs their event log could not give (_outputs_after)
        for directory in (self.project_dir, self.home, self.backend, self.pulumi_home):
            directory.mkdir(parents=True, exist_ok=True)
        if not (self.pulumi_home / "plugins").exists():  # the plugins this machine has installed
            (self.pulumi_home / "plugins").symlink_to(PLUGINS_DIR)
        self._link_program()

    def _link_program(self) -> None:
        """The project directory as a user's checkout has it: Pulumi.yaml (a copy: the CLI looks for the stack's
        file beside it), and `__main__.py` and `components/` of this checkout (linked; the one that constructs the
        stack is the one whose program runs). The copy names this checkout's venv by its own path: through a link
        in each project directory, every stack's first program run compiled the venv's modules again (the bytecode
        cache is keyed by path: 2.5 s of CPU of its 3.5 s, 30 stacks a suite, 11 MB of bytecode each)."""
        project = (ROOT / "Pulumi.yaml").read_text()
        assert VENV_OPTION in project, f"Pulumi.yaml no longer has {VENV_OPTION.strip()!r}"
        (self.project_dir / "Pulumi.yaml").write_text(
            project.replace(VENV_OPTION, f"    virtualenv: {ROOT / 'venv'}\n")
        )
        for name in PROGRAM_FILES:
            link = self.project_dir / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(ROOT / name)

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
            PATH=f"{CLI_DIR}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            PULUMI_HOME=str(self.pulumi_home),
            PULUMI_CONFIG_PASSPHRASE=PASSPHRASE,
            PULUMI_SKIP_UPDATE_CHECK="true",
            PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION="true",
            **({} if self.typed else {"PULUMI_BACKEND_URL": f"file://{self.backend}"}),
            **({} if self.checkpoints else {"PULUMI_SKIP_CHECKPOINTS": "true"}),
            # Where the program writes the SSH key file on this machine (ssh's `~` is the account's home).
            SPARK_VLLM_HOME=str(self.spark_vllm_home),
        )
        if self.agent_socket is not None:
            env["SSH_AUTH_SOCK"] = str(self.agent_socket)
        return env

    @property
    def pulumi_home(self) -> Path:
        return self.workdir / "pulumi-home"

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
        """`pulumi login file://…` and `pulumi stack init` (or select, when it exists). Not `typed`: no `login`, the
        stack file given this process's salt first (`stack init` keeps a salt it finds), and a select only where the
        backend holds the stack."""
        if self.typed:
            self.cli("login", f"file://{self.backend}")
            if self.cli("stack", "select", self.stack, check=False).returncode != 0:
                self.cli("stack", "init", self.stack)
            return
        document = yaml.safe_load(self.config_file.read_text()) if self.config_file.exists() else None
        document = document or {}
        if "encryptionsalt" not in document:
            document["encryptionsalt"] = process_salt()
            self.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
        exists = (self.backend / ".pulumi" / "stacks" / PROJECT / f"{self.stack}.json").exists()
        self.cli("stack", "select" if exists else "init", self.stack)

    def configure(self, config: dict[str, Any], secrets: dict[str, str]) -> None:
        """The stack file with `config` (as a user edits Pulumi.<stack>.yaml), then each secret with
        `pulumi config set --secret KEY` reading the value from stdin (nothing on a command line); a secret this
        stack set before with the same value, still encrypted in the file, is kept as it is. Not `typed`: each secret
        written into the file encrypted as that command writes it (`init` gave the file its salt)."""
        existing = yaml.safe_load(self.config_file.read_text()) if self.config_file.exists() else None
        document = existing or {}
        encrypted = document.get("config") or {}
        document["config"] = {f"{PROJECT}:{key}": value for key, value in config.items()}
        to_set = {}
        for key, value in secrets.items():
            # A secret this stack set before with the same value stays in the file as it is, as in a user's edited
            # file: setting it again is a CLI start deriving the passphrase's key (PBKDF2, 0.3 CPU-s), 8 secrets a
            # configure, 156 such starts in a suite (2026-12-07).
            name = f"{PROJECT}:{key}"
            if self._secrets_set.get(key) == value and _encrypted(encrypted.get(name), value):
                document["config"][name] = encrypted[name]
            else:
                to_set[key] = value
        if not self.typed:
            salt = document.get("encryptionsalt")
            assert salt, f"{self.config_file} has no encryptionsalt: init() first"
            aes = _passphrase_key(salt)
            for key, value in to_set.items():
                document["config"][f"{PROJECT}:{key}"] = _secure(aes, value)
            to_set = {}
        self.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
        self._secrets_set = {key: copy.deepcopy(value) for key, value in secrets.items() if key not in to_set}
        for key, value in to_set.items():
            if isinstance(value, dict):  # apiKeys, tls: each value at its path, as docs/security.md shows
                for sub, text in value.items():
                    self.cli("config", "set", "--secret", "--path", f"{key}.{sub}", stdin=text)
            else:
                self.cli("config", "set", "--secret", key, stdin=value)
            self._secrets_set[key] = copy.deepcopy(value)

    def _run(self, command: str, *args: str) -> Run:
        """`pulumi COMMAND ARGS…` as a user types it, its engine events read from `--event-log` as they come."""
        events = _Events()
        lines: list[str] = []
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pulumi-events-") as scratch:
            log = Path(scratch) / "events"
            os.mkfifo(log)
            argv = [str(CLI_DIR / "pulumi"), *command.split(), *args, "--non-interactive", "--color", "never",
                    "--event-log", str(log)]  # fmt: skip
            # `--event-log` exists where PULUMI_DEBUG_COMMANDS is set (the Automation API sets it too).
            env = {**self.env, "PULUMI_DEBUG_COMMANDS": "true"}
            process = subprocess.Popen(argv, cwd=self.project_dir, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)  # fmt: skip
            done = threading.Event()
            follower = threading.Thread(target=_follow, args=(log, events, done), daemon=True)
            follower.start()
            killer = threading.Timer(COMMAND_TIMEOUT_S, process.kill)
            killer.start()
            try:
                for line in process.stdout:
                    lines.append(line.rstrip("\n"))
                    if self.echo:
                        self.echo(lines[-1])
                code = process.wait()
            finally:
                killer.cancel()
                done.set()
                follower.join()
        if events.failures:
            raise RuntimeError(f"pulumi {command}: engine events not handled: {events.failures[:3]}")
        if code != 0:
            _log_timing(command, time.monotonic() - started, events.resources, failed=True)
            raise StackError(command, events.errors or [f"exit status {code}"], "\n".join(lines))
        run = Run(
            command=command,
            resources=events.resources,
            output="\n".join(lines),
            outputs=self._outputs_after(events) if command == "up" else {},
            seconds=time.monotonic() - started,
            diagnostics=events.diagnostics,
            change_summary=events.summary,
            engine_seconds=events.engine_seconds,
        )
        _log_timing(run.command, run.seconds, run.resources)
        return run

    def _outputs_after(self, events: _Events) -> dict[str, Any]:
        """The outputs an `up` left: the stack's own outputs event in its event log, which holds every value as
        plain JSON but a secret (the log blinds those), an asset or a reference; with one of those, or no such event,
        `pulumi stack output --json --show-secrets` (a CLI start deriving the passphrase's key, 0.37 CPU-s,
        after each of the suite's 52 `up`s). test_one_node.py holds the two to the same values."""
        if events.stack_outputs is None or _special(events.stack_outputs):
            self.outputs_read_by_cli += 1
            return self.outputs(show_secrets=True)
        return events.stack_outputs

    def preview(self, *flags: str) -> Run:
        """`pulumi preview --diff FLAGS…`."""
        return self._run("preview", "--diff", *flags)

    # `up`, `refresh` and `destroy` run as the Automation API runs them (pulumi/automation/_stack.py passes
    # `--skip-preview` with `--yes`): the engine's own preview first would run the program and every provider's
    # diff (SSH to each node) a second time for a plan no test reads; a test that checks the plan runs `preview`.
    # `preview_first=True`: the command as the README types it, a preview and then the change (the main job).

    def up(self, preview_first: bool = False) -> Run:
        """`pulumi up --yes --skip-preview` (`preview_first`: `pulumi up --yes`, a preview, then the update)."""
        return self._run("up", "--yes", *_skip_preview(preview_first))

    def refresh(self, preview_first: bool = False) -> Run:
        """`pulumi refresh --yes --skip-preview` (`preview_first`: without `--skip-preview`)."""
        return self._run("refresh", "--yes", *_skip_preview(preview_first))

    def destroy(self, run_program: bool = False, preview_first: bool = False) -> Run:
        """`pulumi destroy --yes --skip-preview` (`--run-program`: run the program first, which writes the SSH
        key file; `preview_first`: without `--skip-preview`)."""
        return self._run("destroy", "--yes", *(["--run-program"] if run_program else []), *_skip_preview(preview_first))

    def outputs(self, show_secrets: bool = False) -> dict[str, Any]:
        """`pulumi stack output --json` (secrets as `[secret]` unless `show_secrets`)."""
        extra = ["--show-secrets"] if show_secrets else []
        return json.loads(self.cli("stack", "output", "--json", *extra).stdout or "{}")

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
            agent_socket=agent_socket,
            spark_vllm_home=self.spark_vllm_home,
            checkpoints=self.checkpoints,
            typed=self.typed,
        )
        shutil.copyfile(self.config_file, clone.config_file)
        clone._secrets_set = copy.deepcopy(self._secrets_set)
        if self.typed:
            clone.cli("login", f"file://{self.backend}")
        clone.cli("stack", "select", self.stack)
        return clone

    def versions(self) -> dict[str, str]:
        """What the binaries that ran say they are: the CLI, the language host, each provider plugin."""
        return tool_versions(self.env)


def tool_versions(env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """`pulumi version`, `pulumi-language-python -version`, and each provider plugin's GetPluginInfo (a plugin
    has no version flag: it is started as the engine starts it and asked over gRPC, on loopback)."""
    found = {
        tool: subprocess.run([str(CLI_DIR / tool), flag], capture_output=True, text=True, env=env, timeout=60).stdout.strip()
        for tool, flag in (("pulumi", "version"), ("pulumi-language-python", "-version"))
    }  # fmt: skip
    for name in ("command", "docker"):
        found[name] = ", ".join(plugin_version(path) for path in sorted(PLUGINS_DIR.glob(f"*/pulumi-resource-{name}")))
    return found


def plugin_version(binary: Path) -> str:
    import grpc
    from google.protobuf import empty_pb2
    from pulumi.runtime.proto import provider_pb2_grpc

    # The engine's address is required and dialled lazily: nothing listens at port 1 and nothing needs it.
    plugin = subprocess.Popen([str(binary), "127.0.0.1:1"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)  # fmt: skip
    try:
        port = int(plugin.stdout.readline().strip())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = provider_pb2_grpc.ResourceProviderStub(channel)
            return stub.GetPluginInfo(empty_pb2.Empty(), timeout=30).version
    finally:
        plugin.kill()
        plugin.wait()
