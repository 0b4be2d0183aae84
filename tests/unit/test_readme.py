"""The README stays true: its config reference is the models' own, and what it tells users to run exists."""

import re
import subprocess
import sys

from tests.harness import ROOT

README = (ROOT / "README.md").read_text()
DOCS = {path: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
ALL = README + "".join(DOCS.values())  # the README and every page it links to


def test_config_reference_matches_the_models():
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert generated in DOCS[ROOT / "docs" / "config.md"], "run: venv/bin/python scripts/config_reference.py --write"


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
        assert f"| `{key}` |" in DOCS[ROOT / "docs" / "config.md"], key


def test_the_commands_the_readme_names_exist():
    for command in ("rehearse", "run-tests", "scripts/setup.sh", ".ci/run"):
        assert (ROOT / command).exists(), command
    for stack in re.findall(r"`(Pulumi\.[\w-]+\.yaml)`", ALL):
        assert (ROOT / stack).exists(), stack


def test_no_section_is_left_unwritten():
    assert not re.search(r"[A-Z]+-(SECTION|NUMBERS)", ALL)


def test_the_bad_config_example_is_what_the_program_prints():
    from components.config import ConfigError, load_cluster_config

    node = {"fabricAddress": "192.168.200.12", "fabricInterface": "enp1s0f1np1"}
    raw = {
        "nodes": [{"name": f"spark-0{i}", "host": f"spark-0{i}.lan", **node} for i in (1, 2)],
        "image": "hellohal2064/vllm-qwen3.5-gb10",
        "model": "/models/Qwen3.5-122B-A10B-FP8",
        "tensorParallelSize": 4,
        "vllm": {"maxModelLen": 32768},
        "apiKey": "sk-example-0123456789",
    }
    try:
        load_cluster_config(raw)
    except ConfigError as error:
        assert f"```\n{error}\n```" in README
    else:
        raise AssertionError("the example config is valid")


def test_the_guard_rules_shown_are_what_the_guard_writes_for_the_prod_head():
    import yaml

    from components.config import load_cluster_config
    from components.plan.programs import script_program
    from components.resources.guard import guard_params

    raw = {k.split(":", 1)[1]: v for k, v in yaml.safe_load((ROOT / "Pulumi.prod.yaml").read_text())["config"].items()}
    cfg = load_cluster_config({**raw, "apiKey": "x" * 16, "security": {}})  # host keys are the user's to add
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        low, high = handle.read().split()
    for backend in ("nft", "iptables"):
        params = {**guard_params(cfg, cfg.nodes[0], "show"), "backend": backend}
        shown = subprocess.run(
            [sys.executable, "-"],
            input=script_program("node_guard.py", params),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # The README shows the usual ephemeral range; this machine's may differ.
        shown = shown.replace(f"{low}-{high}", "32768-60999").replace(f"{low}:{high}", "32768:60999")
        block = re.search(rf"<!-- guard-rules:{backend} -->\n```\n(.*?)```", DOCS[ROOT / "docs" / "security.md"], re.S)
        assert block and block.group(1) == shown, f"docs/security.md's {backend} rules differ from the guard's"


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def test_the_readme_is_a_front_door():
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    assert max(len(line) for line in lines) <= 200


def test_every_page_the_readme_links_to_exists_and_every_link_lands():
    pages = {ROOT / "README.md": README, **DOCS}
    anchors = {
        path: {github_anchor(line) for line in text.splitlines() if line.startswith("#")}
        for path, text in pages.items()
    }
    broken = []
    for path, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            landing = (path.parent / file).resolve() if file else path
            if not landing.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and landing.suffix == ".md" and anchor not in anchors.get(landing, set()):
                broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", README))
    assert {path.name for path in DOCS} <= linked, "a page under docs/ that the README does not link"


def openssl_recipe(host: str) -> list[str]:
    """docs/security.md's commands that make a CA and the endpoint's certificate, for `host` (an address)."""
    text = DOCS[ROOT / "docs" / "security.md"]
    block = text.split("<!-- tls-recipe:begin -->", 1)[1].split("<!-- tls-recipe:end -->", 1)[0]
    script = block.split("```bash\n", 1)[1].split("```", 1)[0]
    assert script.startswith('SAN="DNS:spark-01.lan"\n'), script
    return [script.replace('SAN="DNS:spark-01.lan"', f'SAN="IP:{host}"', 1)]
