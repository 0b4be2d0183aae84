"""The node scripts as programs: components/scripts/ with the helpers each needs prepended, and its parameters
in the program text (never argv or the remote environment); several chained as one program."""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Any

from components.plan.names import (
    SUPERVISOR_IN_CONTAINER,
)

# Scripts that share code: what each needs is prepended to it (each still travels as one program).
SCRIPT_HELPERS = {
    "supervisor.py": (
        "node_contract.py",
        "node_gpu_turn.py",
        "node_processes.py",
        "node_gpus.py",
        "node_memory_waits.py",
        "node_metrics.py",
        "node_compile_cache.py",
        "node_vllm_output.py",
        "node_chat.py",
        "node_watch.py",
        "node_vllm_watch.py",
    ),
    "serve_spec.py": ("node_contract.py",),
    "serve_stop.py": ("node_contract.py",),
    "wait_ready.py": ("node_contract.py",),
    "smoke.py": ("node_contract.py", "node_chat.py"),
    "node_answers.py": ("node_contract.py", "node_chat.py"),
    "model_fingerprint.py": ("node_contract.py", "vllm_weights.py"),
    "image_probe.py": ("node_contract.py",),
    "hf_download.py": ("node_contract.py", "vllm_weights.py", "node_common.py"),
    "ray_join.py": ("node_contract.py",),
    "node_benchmark.py": ("node_contract.py",),
    "router_keeper.py": ("node_contract.py", "node_chat.py", "node_watch.py"),
    "nccl_bandwidth.py": ("node_contract.py",),
    "node_fabric_gate.py": ("node_contract.py",),
    "image_pull.py": ("node_contract.py", "docker_api.py", "node_common.py"),
    "node_fabric_copy.py": (
        "node_contract.py",
        "docker_api.py",
        "node_common.py",
        "node_copy_channel.py",
        "node_copy_tree.py",
        "node_image_archive.py",
    ),
    "node_guard.py": ("node_contract.py",),
}


@functools.cache
def script(name: str) -> str:
    files = resources.files("components.scripts")
    return (
        "".join(files.joinpath(part).read_text() + "\n" for part in SCRIPT_HELPERS.get(name, ()))
        + files.joinpath(name).read_text()
    )


def script_program(name: str, params: dict[str, Any]) -> str:
    """A script from components/scripts with its parameters, ready to feed to `python3 -` on stdin.

    Parameters travel inside the program text on stdin, never in argv or the remote environment,
    so secrets (API key) stay out of `ps` and sshd does not need AcceptEnv.
    """
    return f"PARAMS = {json.dumps(json.dumps(params, sort_keys=True))}\n{script(name)}"


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
    return {field.name: getattr(section, field.name) for field in dataclasses.fields(contract) if field.name in known}
