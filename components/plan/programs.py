"""The node scripts as programs: each script of components/scripts/ with the modules it imports (found from its
imports, carried by a small loader: components/scripts/node_loader.py), and its parameters in the program text
(never argv or the remote environment); several chained as one program."""

from __future__ import annotations

import ast
import functools
import json
from importlib import resources
from typing import Any

from components.plan.names import (
    SUPERVISOR_IN_CONTAINER,
)
from components.scripts.node_contract import fields as contract_fields

PACKAGE = "components.scripts"
ENTRY = "__entry__"  # the entry script's key among a program's sources (it runs as __main__, never imported)


def imported(source: str, name: str) -> set[str]:
    """The components.scripts modules `source` imports (absolute imports only: a relative one names no module here)."""
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith(PACKAGE + ".")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise ValueError(f"{name}: a relative import (from {'.' * node.level}{node.module or ''}): "
                                 f"node modules import as `from {PACKAGE}.MODULE import NAME`")  # fmt: skip
            if node.module == PACKAGE:
                found |= {f"{PACKAGE}.{alias.name}" for alias in node.names}
            elif node.module and node.module.startswith(PACKAGE + "."):
                found.add(node.module)
    return found


@functools.cache
def node_modules(name: str) -> dict[str, str]:
    """What the script `name` runs: {ENTRY: its source, module: source} for every components.scripts module it
    reaches through its imports and theirs (none for a script of the standard library only)."""
    files = resources.files(PACKAGE)
    sources = {ENTRY: files.joinpath(name).read_text()}
    waiting = sorted(imported(sources[ENTRY], name))
    while waiting:
        module = waiting.pop()
        if module in sources:
            continue
        file = module.removeprefix(PACKAGE + ".") + ".py"
        if not files.joinpath(file).is_file():
            raise ValueError(f"{name} imports {module}, which components/scripts does not have")
        sources[module] = files.joinpath(file).read_text()
        waiting += sorted(imported(sources[module], file) - sources.keys())
    return sources


@functools.cache
def script(name: str) -> str:
    """The program of components/scripts/NAME: a shell script or a Python script of the standard library only as it
    is; one that imports node modules as the loader (node_loader.py) with the sources it reaches, then its `run`."""
    if not name.endswith(".py"):
        return resources.files(PACKAGE).joinpath(name).read_text()
    return program_of(name, node_modules(name))


def program_of(name: str, sources: dict[str, str]) -> str:
    """The program that runs `sources` ({ENTRY: the script's source, module: source}, as node_modules gives them)
    as the script `name`: its source alone when it carries no module."""
    if len(sources) <= 1:
        return sources[ENTRY]
    entry = f"{PACKAGE}.{name.removesuffix('.py')}"
    modules = {(entry if key == ENTRY else key): source for key, source in sorted(sources.items())}
    loader = resources.files(PACKAGE).joinpath("node_loader.py").read_text()
    # the sources on a line of their own: a traceback shows the short line that runs them
    return f"{loader}\n\nSOURCES = {modules!r}\nrun(SOURCES, {entry!r}, globals().get('PARAMS'))\n"


def script_program(name: str, params: dict[str, Any], sources: dict[str, str] | None = None) -> str:
    """A script from components/scripts with its parameters, ready to feed to `python3 -` on stdin.

    Parameters travel inside the program text on stdin, never in argv or the remote environment,
    so secrets (API key) stay out of `ps` and sshd does not need AcceptEnv. `sources`: other sources to carry
    than node_modules(name) finds (a test's altered script).
    """
    program = script(name) if sources is None else program_of(name, sources)
    return f"PARAMS = {json.dumps(json.dumps(params, sort_keys=True))}\n{program}"


def last_json(stdout: str) -> dict[str, Any]:
    """The JSON object a node's script printed last (its last line that starts with "{"); ValueError when it printed
    none. Read through the script's result contract (components/scripts/node_contract.py: `Cls.from_json`)."""
    for line in reversed((stdout or "").strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("the script printed no JSON line")


def printed(stdout: str) -> dict[str, Any]:
    """What a script (or a chain: {"chain": {script: its line}}) printed last; {} when it printed nothing."""
    try:
        return last_json(stdout)
    except ValueError:
        return {}


def script_chain(steps: list[tuple[str, dict[str, Any]]]) -> str:
    """Several scripts as one program for `python3 -` (one stdin, one `docker exec`): each runs in a
    namespace of its own with its parameters, in order, what it prints passed on; the first to exit with
    a failure ends the chain with its code. Last, one JSON line: {"chain": {script: its last JSON line}}."""
    programs = [(name, script_program(name, params)) for name, params in steps]
    return (
        "import contextlib, io, json, sys\n"
        f"STEPS = json.loads({json.dumps(json.dumps(programs))})\n"
        "results = {}\n"
        "for name, program in STEPS:\n"
        "    out = io.StringIO()\n"
        "    code = 0\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            exec(compile(program, name, 'exec'), {'__name__': '__main__'})\n"
        "    except SystemExit as stop:\n"
        "        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)\n"
        "    sys.stdout.write(out.getvalue())\n"
        "    sys.stdout.flush()\n"
        "    if code:\n"
        "        sys.exit(code)\n"
        "    lines = [line for line in out.getvalue().splitlines() if line.startswith('{')]\n"
        "    results[name] = json.loads(lines[-1]) if lines else None\n"
        "print(json.dumps({'chain': results}))\n"
    )


INSTALL_SUPERVISOR = (
    "import hashlib, os, sys\n"
    "path = {path!r}\n"
    "code = sys.stdin.read()\n"
    "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "with open(path + '.tmp', 'w') as handle:\n"
    "    handle.write(code)\n"
    "os.replace(path + '.tmp', path)\n"
    "print('supervisor ' + hashlib.sha256(code.encode()).hexdigest()[:12] + ' installed; it runs from the '\n"
    "      'next start of the container (its first, a restart, a reboot)')\n"
)


def install_supervisor_argv(container: str) -> list[str]:
    """`docker exec -i CONTAINER python3 -c …`: writes the supervisor (on stdin) where supervisor_boot.py finds it."""
    return ["docker", "exec", "-i", container, "python3", "-c", INSTALL_SUPERVISOR.format(path=SUPERVISOR_IN_CONTAINER)]


def as_configured(contract: type, section: Any) -> dict[str, Any]:
    """Each field of `contract` that the config `section` (a pydantic model) has by the same name, with the
    section's value: what a script takes exactly as the stack sets it (the benchmark's load, the recovery's
    limits). A field the section lacks is the caller's to give."""
    known = type(section).model_fields
    return {field.name: getattr(section, field.name) for field in contract_fields(contract) if field.name in known}
