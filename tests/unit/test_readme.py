"""The README stays true: its config reference is the models' own, and what it tells users to run exists."""

import re
import subprocess
import sys

from tests.harness import ROOT

README = (ROOT / "README.md").read_text()


def test_config_reference_matches_the_models():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert generated in README, "run: venv/bin/python scripts/config_reference.py --write"


def test_every_config_key_of_the_design_is_documented():
    for key in ("nodes[].fabricAddress", "nodes[].fabricInterface", "nodes[].rdmaDevices", "head", "image", "model",
                "tensorParallelSize", "pipelineParallelSize", "maxModelLen", "promoteFrom", "apiKey", "hfToken",
                "sshPrivateKey", "network.manage", "ray.port", "nccl.debug"):  # fmt: skip
        assert f"| `{key}` |" in README, key


def test_the_commands_the_readme_names_exist():
    for command in ("rehearse", "run-tests", "scripts/setup.sh", ".ci/run"):
        assert (ROOT / command).exists(), command
    for stack in re.findall(r"`(Pulumi\.\w+\.yaml)`", README):
        assert (ROOT / stack).exists(), stack


def test_no_section_is_left_unwritten():
    assert not re.search(r"[A-Z]+-(SECTION|NUMBERS)", README)
