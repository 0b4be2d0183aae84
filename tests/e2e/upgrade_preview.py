"""Does an upgrade preview clean? An older commit's program deploys the rehearsal's stack on simulated nodes
(its own checkout, `rehearse --keep`), then this checkout's program previews that stack with the real CLI:
every resource the same, or the list of what it would change. For a refactor that must change nothing.

    sudo venv/bin/python -m tests.e2e.upgrade_preview 6b86d2e            # the single-model rehearsal stack
    sudo venv/bin/python -m tests.e2e.upgrade_preview 6b86d2e --fleet    # several models on three nodes

Exit status 0 when nothing would change, 1 when something would, 2 when it cannot run here. The older
checkout borrows this one's Pulumi CLI, stand-in plugins and venv (the CLI and plugins are built here, not
committed), but not its image cache: an older stand-in is another image, and the rehearsal keeps one archive
a cache (building the older one there would take this checkout's out from under the suite's registry), so
the older checkout builds and keeps its own in OLDER_CACHE. Everything else it made is removed at the end
(`rehearse teardown`, the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.e2e.cli_stack import CLI_DIR, PLUGIN_DIR, ROOT, RehearsalStack, cli_missing
from tests.e2e.rehearsal import CACHE_DIR

OLDER_CACHE = CACHE_DIR.with_name(CACHE_DIR.name + "-older")


def _older_checkout(commit: str, into: Path) -> Path:
    checkout = into / "older"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), commit], check=True,
                   capture_output=True)  # fmt: skip
    (checkout / ".toolchain").symlink_to(CLI_DIR.parent)
    (checkout / "venv").symlink_to(ROOT / "venv")
    shutil.rmtree(checkout / "tests/e2e/providers/bin", ignore_errors=True)
    shutil.copytree(PLUGIN_DIR, checkout / "tests/e2e/providers/bin", symlinks=True)
    return checkout


def _rehearse(checkout: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPARK_VLLM_REHEARSAL_CACHE": str(OLDER_CACHE)}
    return subprocess.run([str(ROOT / "venv/bin/python"), "-m", "tests.e2e.rehearsal", *args], cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="upgrade_preview", description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("commit", help="the older commit whose program deploys the stack")
    parser.add_argument("--fleet", action="store_true", help="the rehearsal's several-models stack")
    args = parser.parse_args(argv)
    if cli_missing():
        print(f"upgrade_preview: cannot run here: {cli_missing()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="spark-vllm-upgrade-") as scratch:
        workdir = Path(scratch) / "rehearsal"
        checkout = _older_checkout(args.commit, Path(scratch))
        try:
            deployed = _rehearse(checkout, "--keep", "--workdir", str(workdir), *(["--fleet"] if args.fleet else []))
            if deployed.returncode != 0:
                print(deployed.stdout[-3000:], deployed.stderr[-3000:], sep="\n", file=sys.stderr)
                return 2
            run = RehearsalStack(workdir / "deployer", "rehearsal").preview()
            changed = {name: op for name, op in run.ops.items() if op not in ("same", "read")}
            print(json.dumps({"deployedBy": args.commit, "previewedBy": "this checkout",
                              "summary": run.change_summary, "changed": changed}, indent=1))  # fmt: skip
            return 1 if changed else 0
        finally:
            _rehearse(checkout, "teardown", "--workdir", str(workdir))
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)], check=False,
                           capture_output=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
