"""scripts/diagnose.py for real: node_diagnose.sh run through a fake `ssh` (this machine's bash) with fake
docker, nvidia-smi and dmesg that print every secret the stack has; a second node that does not answer."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.harness import ROOT
from tests.keys import openssh_private_key

API_KEY = "sk-planted-" + secrets.token_hex(12)
HF_TOKEN = "hf_" + secrets.token_hex(16)
RAY_TOKEN = secrets.token_hex(32)
COPY_TOKEN = secrets.token_hex(32)
SSH_KEY = openssh_private_key("diagnose")
GRAFANA_PASSWORD = "grafana " + secrets.token_hex(8)  # a password may hold a space
PLANTED = [
    API_KEY,
    HF_TOKEN,
    RAY_TOKEN,
    COPY_TOKEN,
    GRAFANA_PASSWORD,
    *[line for line in SSH_KEY.splitlines()[1:-1] if len(line) >= 16],
]

FAKE_SSH = """#!/usr/bin/env bash
# a node: the last word is the remote command; "down.invalid" never answers
for word in "$@"; do target=$word; done
case "$*" in *down.invalid*) echo "ssh: connect to host down.invalid port 22: Connection refused" >&2; exit 255;; esac
case "$*" in *leaky.invalid*) echo "ssh: banner says $PLANTED_IN_ERROR" >&2; exit 255;; esac
echo "$@" >> "$FAKE_LOG"
exec bash -c "$target"
"""
FAKE_DOCKER = f"""#!/usr/bin/env bash
case "$1" in
  logs) echo "supervisor up"; echo "HF_TOKEN={HF_TOKEN} RAY_AUTH_TOKEN={RAY_TOKEN}"; echo "Authorization: Bearer {API_KEY}";
        echo "copy token {COPY_TOKEN}"; echo "GF_SECURITY_ADMIN_PASSWORD={GRAFANA_PASSWORD}"; printf '%s\\n' "$FAKE_KEY";;
  exec) case "$*" in
          *status.json*) echo '{{"state": "running", "serving": true, "restarts_total": 2}}';;
          *vllm.log*) echo "NCCL INFO Channel 00 : 0[0] -> 1[0] via NET/IB/0"; echo "vllm serve --api-key {API_KEY}";;
          *ray*) echo "Active: 2 nodes; 2.0/2.0 GPU";;
        esac;;
  inspect) echo "image sha256:abc; state running since now; exit 0; restarted 0 time(s); oom-killed false";;
  ps) echo "spark-vllm-node-1  sha256:abc  Up 3 hours";;
  images) echo "vllm:latest  sha256:abc  <none>  20GB";;
esac
"""
FAKE_NVIDIA_SMI = "#!/usr/bin/env bash\necho 'NVIDIA GB10, [N/A]'\n"
FAKE_DMESG = (
    f"#!/usr/bin/env bash\necho '[Wed Dec  3 01:00:00 2026] NVRM: Xid 79, GPU has fallen off the bus {API_KEY}'\n"
)


def secret_output(value):
    """A value Pulumi's state holds as a secret, as `pulumi stack export --show-secrets` writes it."""
    return {"4dabf18193072939515e22adb298388d": "1b47061264138c4ac30d75fd1eb44270", "plaintext": json.dumps(value)}


def bundle(
    tmp_path: Path, replicas=("spark-vllm-node-1",), leaky=False
) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("ssh", FAKE_SSH),
        ("docker", FAKE_DOCKER),
        ("nvidia-smi", FAKE_NVIDIA_SMI),
        ("dmesg", FAKE_DMESG),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    node = {"user": "root", "sshPort": 22, "hostKey": "ssh-ed25519 AAAA", "identity": None, "runDir": "/run/spark-vllm",
            "fabricInterface": "lo"}  # fmt: skip
    inputs = {
        "diagnostics": {
            "stack": "prod",
            "nodes": [
                {
                    **node,
                    "name": "node-1",
                    "host": "node-1.local",
                    "containers": [*replicas, "spark-vllm.guard"],
                    "vllmContainers": list(replicas),
                },
                {**node, "name": "node-2", "host": "down.invalid", "containers": ["spark-vllm-node-2"]},
                *(
                    [{**node, "name": "node-3", "host": "leaky.invalid", "containers": ["spark-vllm-node-3"]}]
                    if leaky
                    else []
                ),
            ],
        },
        "outputs": {"endpoint": "http://node-1:8000/v1", "prometheusConfig": "[secret]", "fabric": {"checked": True}},
        "config": {
            "spark-vllm:apiKey": {"value": API_KEY, "secret": True},
            "spark-vllm:hfToken": {"value": HF_TOKEN, "secret": True},
            "spark-vllm:sshPrivateKey": {"value": SSH_KEY, "secret": True},
            "spark-vllm:grafanaAdminPassword": {"value": GRAFANA_PASSWORD, "secret": True},
            "spark-vllm:image": {"value": "vllm/vllm-openai:v0.33.0", "secret": False},
        },
        # as `pulumi stack export --show-secrets` has them: each secret output wrapped, its value JSON-encoded
        "state": {
            "deployment": {
                "resources": [
                    {
                        "urn": "urn:pulumi:prod::spark-vllm::spark-vllm:index:VllmCluster$command:local:Command::ray-auth-token",
                        "outputs": {"create": "python3 -c …", "stdout": secret_output(RAY_TOKEN + "\n")},
                    },
                    {
                        "urn": "urn:pulumi:prod::spark-vllm::spark-vllm:index:FabricCopy$command:local:Command::spark-vllm-copy-token",
                        "outputs": {"stdout": secret_output(COPY_TOKEN)},
                    },
                    {
                        "urn": "urn:pulumi:prod::spark-vllm::spark-vllm:index:VllmServer$command:remote:Command::small-serve",
                        "inputs": {
                            "stdin": secret_output(f'PARAMS = "{{\\"env\\": {{\\"VLLM_API_KEY\\": \\"{API_KEY}\\"}}}}"')
                        },
                    },
                ]
            }
        },
    }
    (tmp_path / "inputs.json").write_text(json.dumps(inputs))
    out = tmp_path / "bundle.tar.gz"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "ssh.log"),
           "FAKE_KEY": SSH_KEY}  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "diagnose.py"), "--inputs", str(tmp_path / "inputs.json"), "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    files = {}
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            files[member.name.split("/", 1)[1]] = tar.extractfile(member).read().decode()
    return result, files


def test_the_bundle_holds_every_node_with_an_index_and_names_the_one_that_did_not_answer(tmp_path):
    result, files = bundle(tmp_path)
    assert result.returncode == 1  # one node was not reached: said, and the rest collected
    index = json.loads(files["index.json"])
    assert index["nodes"]["node-2"] == {
        "reachable": False,
        "error": "ssh: connect to host down.invalid port 22: Connection refused",
        "seconds": index["nodes"]["node-2"]["seconds"],
        "files": {},
    }
    collected = index["nodes"]["node-1"]["files"]
    for name in ("host.txt", "meminfo.txt", "nvidia-smi.txt", "kernel.txt", "containers.txt", "images.txt", "status.json",
                 "vllm-log.txt", "nccl.txt", "ray-status.txt", "docker-logs-spark-vllm-node-1.txt",
                 "docker-logs-spark-vllm.guard.txt", "container-spark-vllm-node-1.txt", "fabric.txt"):  # fmt: skip
        assert name in collected and f"node-1/{name}" in files, name
    assert "via NET/IB/0" in files["node-1/nccl.txt"]
    assert "MemAvailable" in files["node-1/meminfo.txt"]
    assert "Xid 79" in files["node-1/kernel.txt"]
    assert "NOT REACHED" in files["INDEX.txt"] and "node-1/vllm-log.txt" in files["INDEX.txt"]
    assert json.loads(files["config.json"])["spark-vllm:image"] == "vllm/vllm-openai:v0.33.0"
    assert json.loads(files["outputs.json"])["fabric"] == {"checked": True}


def test_no_secret_the_stack_has_is_in_the_bundle(tmp_path):
    _, files = bundle(tmp_path)
    everything = "\n".join(files.values())
    for secret in PLANTED:
        assert secret not in everything, secret[:12]
    assert json.loads(files["config.json"])["spark-vllm:apiKey"] == "[secret]"
    assert json.loads(files["index.json"])["secrets_scrubbed"] >= 8
    assert "[redacted by spark-vllm]" in files["node-1/docker-logs-spark-vllm-node-1.txt"]


def test_the_node_script_reaches_the_node_as_the_stack_says_and_passes_no_secret(tmp_path):
    bundle(tmp_path)
    command = (tmp_path / "ssh.log").read_text()
    assert "-o StrictHostKeyChecking=yes" in command and "root@node-1.local" in command
    assert "CONTAINERS='spark-vllm-node-1 spark-vllm.guard'" in command
    assert not any(secret in command for secret in PLANTED)


def test_secrets_come_from_the_state_as_pulumi_wraps_them_not_only_from_a_list(tmp_path):
    """The Ray and copy tokens, printed bare by a node, are known only from the state (`{"plaintext": …}`)."""
    _, files = bundle(tmp_path)
    logs = files["node-1/docker-logs-spark-vllm-node-1.txt"]
    assert RAY_TOKEN not in logs and COPY_TOKEN not in logs and logs.count("[redacted by spark-vllm]") >= 5


def test_every_vllm_container_on_a_node_gets_its_own_status_log_and_nccl_sections(tmp_path):
    _, files = bundle(tmp_path, replicas=("spark-vllm-coder-node-1", "spark-vllm-small-node-1"))
    for replica in ("spark-vllm-coder-node-1", "spark-vllm-small-node-1"):
        for section in (f"status-{replica}.json", f"vllm-log-{replica}.txt", f"nccl-{replica}.txt",
                        f"ray-status-{replica}.txt", f"docker-logs-{replica}.txt"):  # fmt: skip
            assert f"node-1/{section}" in files, section
    assert "node-1/status.json" not in files  # names of their own when there are several
    assert "via NET/IB/0" in files["node-1/nccl-spark-vllm-small-node-1.txt"]


def test_the_index_is_scrubbed_too(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANTED_IN_ERROR", API_KEY)
    result, files = bundle(tmp_path, leaky=True)
    assert API_KEY not in files["index.json"] + files["INDEX.txt"] + result.stdout
    assert "[redacted by spark-vllm]" in json.loads(files["index.json"])["nodes"]["node-3"]["error"]
