"""SSH from the deploying machine: the Docker provider's options, the first-use host key scan, the
credential checks (against a real ssh-agent), and empty or broken config values."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from components.config import load_cluster_config
from components.resources.ssh import SshAccess, agent_key_count, keyscan_command, ssh_access, ssh_access_problems
from components.resources.stack import raw_stack_config
from tests.keys import host_key_line, openssh_private_key
from tests.ssh_agent import ssh_agent
from tests.unit.test_config import config

HOST_KEY = host_key_line("test-ssh")


def node(**changes):
    return load_cluster_config(config(**changes)).nodes[1]


def test_docker_ssh_opts_trust_only_the_given_key_and_name_the_identity_as_ssh_reads_it():
    opts = SshAccess(identity="~/.spark-vllm/p/s/id_spark_vllm").docker_ssh_opts(node(nodes__1__sshPort=2222), HOST_KEY)
    pairs = dict(o.split("=", 1) for o in opts[1::2])
    assert opts[::2] == ["-o"] * (len(opts) // 2)
    assert pairs["StrictHostKeyChecking"] == "yes"
    assert pairs["UserKnownHostsFile"] == pairs["GlobalKnownHostsFile"] == "/dev/null"
    assert pairs["KnownHostsCommand"] == f"/bin/echo [10.0.0.2]:2222 {HOST_KEY}"
    assert pairs["IdentityFile"] == "~/.spark-vllm/p/s/id_spark_vllm" and pairs["IdentitiesOnly"] == "yes"
    assert pairs["BatchMode"] == "yes"
    agent_only = SshAccess(identity=None).docker_ssh_opts(node(), HOST_KEY)
    assert not any(o.startswith(("IdentityFile", "IdentitiesOnly")) for o in agent_only)


def run_keyscan(tmp_path: Path, the_node, answer: str, status: int = 0):
    """The scan command run by a real shell, with a fake ssh-keyscan that records its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "argv"
    (bin_dir / "ssh-keyscan").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nprintf "%s" "$ANSWER"\nexit {status}\n'
    )
    (bin_dir / "ssh-keyscan").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ANSWER": answer}
    result = subprocess.run(["/bin/sh", "-c", keyscan_command(the_node)], env=env, capture_output=True, text=True)
    return result, record.read_text().splitlines() if record.exists() else []


def test_the_first_use_scan_prints_the_ed25519_key(tmp_path):
    answer = f"# 10.0.0.2:22 SSH-2.0-OpenSSH_9.2\n10.0.0.2 {HOST_KEY}\n"
    result, argv = run_keyscan(tmp_path, node(), answer)
    assert result.returncode == 0 and result.stdout == HOST_KEY + "\n"
    assert argv == ["-T", "15", "-p", "22", "-t", "ed25519", "10.0.0.2"]


def test_a_scan_that_reads_no_key_fails_naming_the_node_and_the_fix(tmp_path):
    result, _ = run_keyscan(tmp_path, node(), "# 10.0.0.2:22 SSH-2.0-OpenSSH_9.2\n", status=1)
    assert result.returncode == 1 and result.stdout == ""
    assert "ssh-keyscan read no ed25519 host key from 10.0.0.2 port 22 (node spark-02)" in result.stderr
    assert "nodes[].hostKey" in result.stderr


def test_a_hostile_host_stays_one_word_in_the_scan(tmp_path):
    # Config rules refuse such a host; the command quotes it anyway.
    hostile = node().model_copy(update={"host": "x; touch $HOME/pwned `id`"})
    marker = Path(os.environ.get("HOME", "/root")) / "pwned"
    result, argv = run_keyscan(tmp_path, hostile, "")
    assert argv[-1] == "x; touch $HOME/pwned `id`"
    assert not marker.exists() and result.returncode == 1


@pytest.mark.skipif(shutil.which("ssh-agent") is None, reason="needs ssh-agent")
def test_agent_key_count_talks_to_a_real_agent(tmp_path):
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with ssh_agent(tmp_path) as empty:
        assert agent_key_count(str(empty)) == 0
    assert agent_key_count(str(empty)) is None  # a stale socket
    (tmp_path / "full").mkdir()
    with ssh_agent(tmp_path / "full", keys=(key,)) as loaded:
        assert agent_key_count(str(loaded)) == 1
    assert agent_key_count(str(tmp_path / "never-there.sock")) is None


def test_credential_problems_name_the_fix_and_pass_a_key_beside_a_live_agent():
    with_key = load_cluster_config({**config(), "sshPrivateKey": openssh_private_key("ssh-test")})
    without = load_cluster_config(config())
    assert ssh_access_problems(with_key, {}, lambda p: None) == []
    assert ssh_access_problems(with_key, {"SSH_AUTH_SOCK": "/a"}, lambda p: 2) == []
    assert ssh_access_problems(without, {"SSH_AUTH_SOCK": "/a"}, lambda p: 1) == []
    (stale,) = ssh_access_problems(with_key, {"SSH_AUTH_SOCK": "/gone"}, lambda p: None)
    assert stale.startswith("SSH_AUTH_SOCK='/gone' — no ssh-agent answers there") and "unset SSH_AUTH_SOCK" in stale
    (nothing,) = ssh_access_problems(without, {}, lambda p: None)
    assert "never ~/.ssh/id_*" in nothing and "pulumi config set --secret sshPrivateKey" in nothing
    (empty,) = ssh_access_problems(without, {"SSH_AUTH_SOCK": "/a"}, lambda p: 0)
    assert "holds no keys" in empty and "ssh-add" in empty


def test_the_key_file_is_private_and_stable(tmp_path):
    key = openssh_private_key("ssh-test").rstrip("\n")  # the file ends in a newline even when the secret does not
    cfg = load_cluster_config({**config(), "sshPrivateKey": key})
    access = ssh_access(cfg, "proj", "dev", {"SPARK_VLLM_HOME": str(tmp_path)})
    path = tmp_path / "proj" / "dev" / "id_spark_vllm"
    assert access.identity == str(path)
    assert path.read_text() == key + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    mtime = path.stat().st_mtime_ns
    ssh_access(cfg, "proj", "dev", {"SPARK_VLLM_HOME": str(tmp_path)})
    assert path.stat().st_mtime_ns == mtime  # unchanged content is not rewritten


@pytest.mark.parametrize("value", ["", "[1,", "{not json"])
def test_a_config_value_that_does_not_decode_becomes_a_problem_naming_its_key(monkeypatch, value):
    from components.config import ConfigError

    given = {
        "spark-vllm:image": "x/y",
        "spark-vllm:model": "/m",
        "spark-vllm:nodes": value,
        "spark-vllm:vllm": '{"allowUnauthenticated": true}',
    }
    fake = SimpleNamespace(get_config_env=lambda: given, CONFIG=SimpleNamespace(get=dict))
    monkeypatch.setattr("components.resources.stack.runtime_config", fake)
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw_stack_config())
    assert [p.split(":")[0] for p in caught.value.problems] == ["nodes"]
    assert repr(value) in caught.value.problems[0]
