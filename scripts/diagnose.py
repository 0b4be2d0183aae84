"""One artifact when something is wrong: every node's state, logs and facts in one tar.gz with an index.

    python3 scripts/diagnose.py --stack prod [--out FILE]      (the stack output `diagnoseCommand` says this)

Reads the stack (`pulumi stack output`, `pulumi config`, `pulumi stack export`: the nodes, how to reach
them, the outputs, the config, and the secrets to scrub), then over SSH — the user's `ssh`, with each
node's host key from the stack and the stack's key file where there is one — runs
components/scripts/node_diagnose.sh on every node at once: vLLM's and the supervisor's log tails, its
status, Ray's status, nvidia-smi, MemAvailable, the kernel's NVRM/Xid/OOM lines, NCCL's transport lines,
image ids, container states. A node that does not answer is named in the index, and the others are
collected all the same. Everything written is scrubbed: every secret value the stack holds (API key,
HF token, SSH key, Ray token, copy token) and anything shaped like one. Standard library only.

`--inputs FILE` takes what the pulumi commands would give as one JSON document instead (tests, or a
stack file copied from elsewhere): {"diagnostics": …, "outputs": …, "config": …, "state": …} (and "secrets":
[values] to scrub besides those the config and the state hold).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NODE_SCRIPT = ROOT / "components" / "scripts" / "node_diagnose.sh"
SECTION = re.compile(r"^=== spark-vllm-diagnose: (\S+) ===$", re.M)
NODE_TIMEOUT_SECONDS = 240
REDACTED = "[redacted by spark-vllm]"
# Shapes of secrets, for what the stack does not know it holds (a token in an image's env, a key pasted in a log).
SECRET_SHAPES = [
    re.compile(
        r"\b((?:VLLM_API_KEY|HF_TOKEN|HUGGING_FACE_HUB_TOKEN|RAY_AUTH_TOKEN|SPARK_VLLM_COPY_TOKEN|OPENAI_API_KEY)=)\S+"
    ),
    re.compile(r"((?:Authorization|authorization):\s*Bearer\s+)\S+"),
    re.compile(r"(--api-key[= ])\S+"),
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S),
]
SECRET_CONFIG_KEYS = ("apiKey", "hfToken", "sshPrivateKey", "grafanaAdminPassword")


def pulumi_json(args: list[str], stack: str) -> Any:
    result = subprocess.run(["pulumi", *args, "--stack", stack], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"diagnose: `pulumi {' '.join(args)}` failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout or "null")


def stack_inputs(stack: str) -> dict[str, Any]:
    """What the stack says: the diagnostics output, every plain output, the config, its state."""
    outputs = pulumi_json(["stack", "output", "--json"], stack)
    config = pulumi_json(["config", "--json", "--show-secrets"], stack)
    state = pulumi_json(["stack", "export", "--show-secrets"], stack)
    return {"diagnostics": outputs.get("diagnostics"), "outputs": outputs, "config": config, "state": state}


# How `pulumi stack export --show-secrets` writes a value held as a secret: the secret signature's key, and the
# value JSON-encoded in "plaintext" (pulumi sdk/go/common/resource/config: the "4dabf18193072939515e22adb298388d"
# sig key; ciphertext instead without --show-secrets).
SECRET_SIG = "4dabf18193072939515e22adb298388d"


def secrets_of(config: Any, state: Any) -> list[str]:
    """Every secret value the stack holds: the secret config keys, and every value its state holds as a secret
    (the Ray token, the copy token, a step's stdin or stdout), unwrapped as the export writes them."""
    found = [
        entry.get("value")
        for key, entry in (config or {}).items()
        if isinstance(entry, dict) and (entry.get("secret") or key.split(":")[-1] in SECRET_CONFIG_KEYS)
    ]
    pending = [state]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            if value.get(SECRET_SIG) and "plaintext" in value:
                found += plain_values(value["plaintext"])
                continue
            pending += list(value.values())
        elif isinstance(value, list):
            pending += value
    return [value for value in found if isinstance(value, str)]


def plain_values(plaintext: Any) -> list[str]:
    """The strings inside a secret's plaintext (JSON: a string, or a structure of them), each line of a multi-line
    one too (a token printed bare on a line of a step's output)."""
    try:
        value = json.loads(plaintext) if isinstance(plaintext, str) else plaintext
    except ValueError:
        value = plaintext
    strings, pending = [], [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            strings.append(item)
            strings += [line.strip() for line in item.splitlines() if len(line.strip()) >= 16]
        elif isinstance(item, dict):
            pending += list(item.values())
        elif isinstance(item, list):
            pending += item
    return strings


class Scrubber:
    def __init__(self, secrets: list[Any]):
        values = set()
        for secret in secrets:
            if not isinstance(secret, str) or len(secret.strip()) < 4:
                continue
            values.add(secret.strip())
            values.update(line.strip() for line in secret.splitlines() if len(line.strip()) >= 16)
        self.values = sorted(values, key=len, reverse=True)  # the whole key before its lines
        self.count = 0

    def __call__(self, text: str) -> str:
        for value in self.values:
            if value in text:
                self.count += text.count(value)
                text = text.replace(value, REDACTED)
        for shape in SECRET_SHAPES:
            text, found = shape.subn(lambda m: (m.group(1) if m.groups() else "") + REDACTED, text)
            self.count += found
        return text


def scrubbed_config(config: dict[str, Any]) -> dict[str, Any]:
    """The stack's config with every secret (and every value held as a secret) replaced."""
    shown = {}
    for key, entry in (config or {}).items():
        value = entry.get("value") if isinstance(entry, dict) else entry
        secret = isinstance(entry, dict) and entry.get("secret") or key.split(":")[-1] in SECRET_CONFIG_KEYS
        shown[key] = "[secret]" if secret else value
    return shown


def ssh_argv(node: dict[str, Any], known_hosts: str) -> list[str]:
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-p", str(node["sshPort"])]
    if node.get("hostKey"):
        argv += ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}"]
    if node.get("identity"):
        argv += ["-o", f"IdentityFile={node['identity']}", "-o", "IdentitiesOnly=yes"]
    env = {
        "CONTAINERS": " ".join(node.get("containers") or []),
        "VLLM_CONTAINERS": " ".join(node.get("vllmContainers") or (node.get("containers") or [])[:1]),
        "RUN_DIR": node.get("runDir", "/run/spark-vllm"),
        "FABRIC_IF": node.get("fabricInterface", ""),
    }
    remote = "env " + " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items()) + " bash -s"
    return [*argv, f"{node['user']}@{node['host']}", remote]


def collect(node: dict[str, Any], known_hosts: str) -> dict[str, Any]:
    """One node's sections (file name -> text), or why it could not be reached."""
    started = time.monotonic()
    try:
        result = subprocess.run(
            ssh_argv(node, known_hosts),
            input=NODE_SCRIPT.read_text(),
            capture_output=True,
            text=True,
            timeout=NODE_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return {"reachable": False, "error": f"no answer within {NODE_TIMEOUT_SECONDS} s", "files": {}}
    seconds = round(time.monotonic() - started, 1)
    parts = SECTION.split(result.stdout)
    files = {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts) - 1, 2)}
    if result.returncode == 255 or not files:  # ssh's own failure: the node was not reached
        reason = (result.stderr.strip().splitlines() or [f"ssh exited {result.returncode}"])[-1]
        return {"reachable": False, "error": reason, "seconds": seconds, "files": {}}
    return {"reachable": True, "seconds": seconds, "exit": result.returncode, "files": files}


def bundle(inputs: dict[str, Any], out: Path) -> dict[str, Any]:
    """Collects every node at once and writes the tar.gz; returns its index."""
    facts = inputs.get("diagnostics") or {}
    nodes = facts.get("nodes") or []
    scrub = Scrubber([*(inputs.get("secrets") or []), *secrets_of(inputs.get("config"), inputs.get("state"))])
    with tempfile.NamedTemporaryFile("w", suffix="-known_hosts", delete=False) as handle:
        for node in nodes:
            if node.get("hostKey"):
                host = node["host"] if int(node["sshPort"]) == 22 else f"[{node['host']}]:{node['sshPort']}"
                handle.write(f"{host} {node['hostKey']}\n")
        known_hosts = handle.name
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            results = pool.map(lambda node: collect(node, known_hosts), nodes)
            found = dict(zip([node["name"] for node in nodes], results, strict=True))
    finally:
        os.unlink(known_hosts)
    files: dict[str, str] = {
        "config.json": json.dumps(scrubbed_config(inputs.get("config") or {}), indent=1, sort_keys=True) + "\n",
        "outputs.json": json.dumps(inputs.get("outputs") or {}, indent=1, sort_keys=True, default=str) + "\n",
    }
    index: dict[str, Any] = {
        "stack": facts.get("stack"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nodes": {},
    }
    for name, result in found.items():
        entry = {key: value for key, value in result.items() if key != "files"}
        entry["files"] = {}
        for file, text in result["files"].items():
            path = f"{name}/{file}"
            files[path] = text
            entry["files"][file] = len(text.encode())
        index["nodes"][name] = entry
    files = {path: scrub(text) for path, text in files.items()}
    index = scrub_values(index, scrub)  # a node's error (ssh's stderr) is the node's word: scrubbed too
    index["secrets_scrubbed"] = scrub.count
    index["files"] = sorted(files)
    files["index.json"] = json.dumps(index, indent=1, sort_keys=True) + "\n"
    files["INDEX.txt"] = scrub(describe(index))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for path, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{out.name.split('.')[0]}/{path}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o600
            tar.addfile(info, io.BytesIO(data))
    return index


def scrub_values(value: Any, scrub: Scrubber) -> Any:
    """`value` (the index) with every string in it scrubbed."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {key: scrub_values(item, scrub) for key, item in value.items()}
    if isinstance(value, list):
        return [scrub_values(item, scrub) for item in value]
    return value


def describe(index: dict[str, Any]) -> str:
    lines = [f"spark-vllm diagnostics of stack {index.get('stack')}, {index['created']}", ""]
    for name, entry in index["nodes"].items():
        if entry["reachable"]:
            lines.append(f"{name}: collected in {entry.get('seconds')} s, {len(entry['files'])} file(s)")
            lines += [f"  {name}/{file}  ({size} bytes)" for file, size in sorted(entry["files"].items())]
        else:
            lines.append(f"{name}: NOT REACHED — {entry['error']}")
    lines += ["", "config.json   the stack's config, every secret replaced",
              "outputs.json  the stack's outputs (the release, the memory plan, the fabric gate's figures …)",
              f"{index['secrets_scrubbed']} secret value(s) replaced by {REDACTED}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", help="the stack to diagnose (pulumi's --stack)")
    parser.add_argument("--inputs", help="a JSON file with what the pulumi commands would give (see above)")
    parser.add_argument("--out", help="the tar.gz to write (default: spark-vllm-<stack>-<time>.tar.gz)")
    args = parser.parse_args(argv)
    if not args.stack and not args.inputs:
        parser.error("--stack or --inputs")
    inputs = json.loads(Path(args.inputs).read_text()) if args.inputs else stack_inputs(args.stack)
    if not (inputs.get("diagnostics") or {}).get("nodes"):
        print("diagnose: the stack has no `diagnostics` output (deploy it with this version first)", file=sys.stderr)
        return 2
    stack = (inputs["diagnostics"].get("stack") or args.stack or "stack").replace("/", "-")
    out = Path(args.out or f"spark-vllm-{stack}-{time.strftime('%Y%m%d-%H%M%S')}.tar.gz")
    index = bundle(inputs, out)
    print(describe(index), end="")
    print(f"diagnose: wrote {out}")
    return 0 if all(entry["reachable"] for entry in index["nodes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
