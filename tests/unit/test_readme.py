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


def test_pulumi_yaml_declares_the_models_config():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--project"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert generated in (ROOT / "Pulumi.yaml").read_text(), "run: venv/bin/python scripts/config_reference.py --write"
    import yaml

    declared = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["config"]
    assert declared["nodes"] == {
        "type": "array",
        "items": {"type": "object"},
        "description": declared["nodes"]["description"],
    }
    assert declared["tensorParallelSize"]["default"] == 1 and declared["vllm"]["default"] == {}
    assert "gpuMemoryUtilization" in declared["vllm"]["description"]
    assert "image" not in declared  # optional without a default: Pulumi would require it


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


def test_the_bad_config_example_is_what_the_program_prints():
    from components.config import ConfigError, load_cluster_config

    node = {"fabricAddress": "192.168.200.12", "fabricInterface": "enp1s0f1np1"}
    raw = {
        "nodes": [{"name": f"spark-0{i}", "host": f"spark-0{i}.lan", **node} for i in (1, 2)],
        "image": "hellohal2064/vllm-qwen3.5-gb10",
        "model": "/models/Qwen3.5-122B-A10B-FP8",
        "tensorParallelSize": 4,
        "vllm": {"maxModelLen": 32768},
        "apiKey": "sk-example",
    }
    try:
        load_cluster_config(raw)
    except ConfigError as error:
        assert f"```\n{error}\n```" in README
    else:
        raise AssertionError("the example config is valid")
