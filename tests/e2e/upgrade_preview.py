"""Does an upgrade preview clean? An older commit's program deploys the rehearsal's stack on simulated nodes
(its own checkout, `rehearse --keep`), then this checkout's program previews that stack with the real CLI:
every resource the same, or the list of what it would change. For a refactor that must change nothing.

    sudo venv/bin/python -m tests.e2e.upgrade_preview 6b86d2e            # the single-model rehearsal stack
    sudo venv/bin/python -m tests.e2e.upgrade_preview 6b86d2e --fleet    # several models on three nodes
    sudo venv/bin/python -m tests.e2e.upgrade_preview 01f991f --up       # then `pulumi up` it: what restarted
    sudo venv/bin/python -m tests.e2e.upgrade_preview 01f991f --up \
        --set network.guard=true --set imageTransfer.method='"copy"' --set modelSync.enabled=true

Exit status 0 when nothing would change, 1 when something would, 2 when it cannot run here. With --up this
checkout's program then runs `pulumi up` on that stack, and says how long it took, which containers it replaced
and which vLLM it started anew (each serve step's vLLM pid, before and after, from the state): what an upgrade
across these commits costs a running stack. `--set KEY=JSON` (dotted, repeatable) adds config that the older
program applies with a second `up` before the preview: the guard's and the depot's containers exist only with
theirs. What this checkout's rehearsal sets that the older one did not (the edge's image, published into the kept
cluster's registry) is set before the preview. The older
checkout borrows this one's toolchain (the Pulumi CLI, the real provider plugins: an older checkout that had
stand-ins gets these in their place) and venv, but not its image cache: an older stand-in is another image, and the rehearsal keeps one archive
a cache (building the older one there would take this checkout's out from under the suite's registry), so
the older checkout builds and keeps its own in OLDER_CACHE. Everything else it made is removed at the end
(`rehearse teardown`, the checkout).

A release before #55 cannot preview a new stack with the real plugins (pulumi-command refuses the unknown
secret trigger it declares; the fix is steps.plain_trigger): its rehearsal stops at its first preview, with
the nodes kept and the stack configured, and that release's `up` (the Automation API's, which skips the
preview) deploys it. The report says so (`olderPreview`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from components.plan.programs import printed
from tests.e2e.cli_stack import CLI_DIR, PLUGINS_DIR, PROJECT, ROOT, RehearsalStack, cli_missing
from tests.e2e.image.build import publish_haproxy
from tests.e2e.rehearsal import CACHE_DIR

OLDER_CACHE = CACHE_DIR.with_name(CACHE_DIR.name + "-older")


def _older_checkout(commit: str, into: Path) -> Path:
    checkout = into / "older"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), commit], check=True,
                   capture_output=True)  # fmt: skip
    (checkout / ".toolchain").symlink_to(CLI_DIR.parent)
    (checkout / "venv").symlink_to(ROOT / "venv")
    stand_ins = checkout / "tests/e2e/providers/bin"  # where a checkout before #55 looks for plugins first
    if stand_ins.exists():
        shutil.rmtree(stand_ins)
        stand_ins.mkdir()
        for plugin in ("pulumi-resource-command", "pulumi-resource-docker"):
            (stand_ins / plugin).symlink_to(next(PLUGINS_DIR.glob(f"*/{plugin}")))
    return checkout


def _older(checkout: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python ARGV…` in the older checkout, with its own image cache."""
    env = {**os.environ, "SPARK_VLLM_REHEARSAL_CACHE": str(OLDER_CACHE)}
    return subprocess.run([str(ROOT / "venv/bin/python"), *argv], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip


def _rehearse(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    return _older(checkout, "-m", "tests.e2e.rehearsal", *args)


def _serving(stack: RehearsalStack) -> dict[str, dict[str, Any]]:
    """From the stack's state: each container's id, and each serve step's vLLM pid (its last JSON line)."""
    state = json.loads(stack.cli("stack", "export", "--show-secrets").stdout)
    found: dict[str, dict[str, Any]] = {"containers": {}, "vllm": {}}
    for resource in state.get("deployment", {}).get("resources", []):
        name, outputs = resource["urn"].rsplit("::", 1)[1], resource.get("outputs") or {}
        if resource["type"] == "docker:index/container:Container":
            found["containers"][name] = resource.get("id")
        elif resource["type"] == "command:remote:Command" and name.endswith("-serve"):
            found["vllm"][name] = printed(_plain(outputs.get("stdout"))).get("vllm_pid")  # its HandoverResult
    return found


def _plain(value: Any) -> str:
    """An output as `stack export --show-secrets` writes it: a secret as {"plaintext": its JSON}."""
    if isinstance(value, dict) and "plaintext" in value:
        value = json.loads(value["plaintext"])
    return str(value or "")


def with_settings(document: dict[str, Any], settings: list[str]) -> dict[str, Any]:
    """A stack file's document with each `KEY=JSON` merged in: `network.guard=true` sets `guard` inside the
    `spark-vllm:network` section, keeping its other keys; an undotted key sets the whole value."""
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {setting!r}: expected KEY=JSON, e.g. network.guard=true")
        section, *path = key.split(".")
        place = document.setdefault("config", {})
        name = f"{PROJECT}:{section}"
        if path:
            place = place.setdefault(name, {})
            for part in path[:-1]:
                place = place.setdefault(part, {})
            name = path[-1]
        place[name] = json.loads(value)
    return document


def _with_config(checkout: Path, stack: RehearsalStack, settings: list[str]) -> subprocess.CompletedProcess:
    """The stack file with each `KEY=JSON` of `settings` merged in (a dotted key into its section), then `pulumi
    up` by the older checkout's program: a stack as that version deploys it with those settings."""
    document = with_settings(yaml.safe_load(stack.config_file.read_text()), settings)
    stack.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
    return _older_up(checkout, stack.workdir)


def _older_up(checkout: Path, deployer: Path) -> subprocess.CompletedProcess:
    up = "import sys; from pathlib import Path; from tests.e2e.cli_stack import RehearsalStack as S; S(Path(sys.argv[1])).up()"
    return _older(checkout, "-c", up, str(deployer))


def _deploy_older(checkout: Path, workdir: Path, fleet: bool) -> tuple[subprocess.CompletedProcess, str]:
    """The older checkout's `rehearse --keep`; where it stopped at its own first preview (a release before #55
    with the real plugins), that release's `up` on the kept nodes and configured stack. Also what its preview
    said."""
    deployed = _rehearse(checkout, "--keep", "--workdir", str(workdir), *(["--fleet"] if fleet else []))
    _, previewed, after = (deployed.stdout + "\n" + deployed.stderr).partition("=== pulumi preview --diff")
    stopped = next((line.strip() for line in after.splitlines() if "error: " in line), None) if previewed else None
    if deployed.returncode == 0 or stopped is None or not (workdir / "deployer" / "project").exists():
        return deployed, "passed" if deployed.returncode == 0 else "failed"
    return _older_up(checkout, workdir / "deployer"), f"failed: {stopped[:300]}"


def _this_versions_settings(stack: RehearsalStack, workdir: Path) -> list[str]:
    """What this checkout's rehearsal gives a stack that an older one did not (tests/e2e/rehearsal.py
    rehearsal_config): the edge's image, published into the kept cluster's registry through its first node's
    daemon, FROM the image the older stack runs."""
    document = yaml.safe_load(stack.config_file.read_text())
    if f"{PROJECT}:edge" in document.get("config", {}):
        return []
    base_ref = document["config"][f"{PROJECT}:image"]
    first = sorted((workdir / "nodes").glob("*-n1"))[0].name
    edge_image = publish_haproxy(CACHE_DIR, f"unix:///run/{first}/docker.sock", base_ref)
    return [f"edge.image={json.dumps(edge_image)}"]


def _upgrade(stack: RehearsalStack) -> dict[str, Any]:
    """`pulumi up` with this checkout on the older stack: its time, what it replaced, which vLLM started anew."""
    before = _serving(stack)
    started = time.monotonic()
    run = stack.up()
    seconds = round(time.monotonic() - started, 1)
    after = _serving(stack)
    replaced = sorted(n for n, i in before["containers"].items() if after["containers"].get(n) != i)
    return {
        "seconds": seconds,
        "summary": run.change_summary,
        "containersReplaced": replaced,
        "vllmRestarted": sorted(
            n
            for n, pid in before["vllm"].items()
            if after["vllm"].get(n) != pid or any(_runs_in(n, container) for container in replaced)
        ),  # fmt: skip
        "vllmPids": after["vllm"],
    }


def _runs_in(serve: str, container: str) -> bool:
    """Whether a serve step's vLLM runs in that node container (a new container is a new vLLM, whatever its pid
    inside says: pids count from 1 in each container): `big-serve` in `big-node-1-container`, a single-model
    stack's `spark-vllm-serve` in every `node-N-container`."""
    if not container.endswith("-container"):
        return False
    prefix = serve.removesuffix("serve")
    return container.startswith(f"{prefix}node-") or (prefix == "spark-vllm-" and container.startswith("node-"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="upgrade_preview", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("commit", help="the older commit whose program deploys the stack")
    parser.add_argument("--fleet", action="store_true", help="the rehearsal's several-models stack")
    parser.add_argument("--up", action="store_true", help="then `pulumi up` with this checkout: what it restarted")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="config the older program applies (a second `up`) before the preview, e.g. network.guard=true")  # fmt: skip
    args = parser.parse_args(argv)
    if cli_missing():
        print(f"upgrade_preview: cannot run here: {cli_missing()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spark-vllm-upgrade-") as scratch:
        workdir = Path(scratch) / "rehearsal"
        checkout = _older_checkout(args.commit, Path(scratch))
        try:
            deployed, older_preview = _deploy_older(checkout, workdir, args.fleet)
            if deployed.returncode != 0:
                print(deployed.stdout[-3000:], deployed.stderr[-3000:], sep="\n", file=sys.stderr)
                return 2
            stack = RehearsalStack(workdir / "deployer", "rehearsal")
            if args.set:
                applied = _with_config(checkout, stack, args.set)
                if applied.returncode != 0:
                    print(applied.stdout[-3000:], applied.stderr[-3000:], sep="\n", file=sys.stderr)
                    return 2
                # the older program's `up` linked its own program into the project: this checkout's again
                stack = RehearsalStack(workdir / "deployer", "rehearsal")
            ours = _this_versions_settings(stack, workdir)
            document = with_settings(yaml.safe_load(stack.config_file.read_text()), ours)
            stack.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
            run = stack.preview()
            changed = run.changed
            report = {"deployedBy": args.commit, "olderPreview": older_preview, "with": args.set, "then": ours, "previewedBy": "this checkout",
                      "summary": run.change_summary, "changed": changed}  # fmt: skip
            if args.up:
                report["up"] = _upgrade(stack)
            print(json.dumps(report, indent=1))
            return 1 if changed else 0
        finally:
            _rehearse(checkout, "teardown", "--workdir", str(workdir))
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)], check=False,
                           capture_output=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
