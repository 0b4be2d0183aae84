import pytest


@pytest.fixture(autouse=True)
def _isolated_machine(tmp_path, monkeypatch):
    """The program writes the SSH key file under SPARK_VLLM_HOME (kept out of ~ here) and checks this
    machine's ssh-agent: tests get a stand-in agent holding one key unless they say otherwise."""
    monkeypatch.setenv("SPARK_VLLM_HOME", str(tmp_path / "spark-vllm-home"))
    monkeypatch.setenv("SSH_AUTH_SOCK", str(tmp_path / "agent.sock"))
    monkeypatch.setattr("components.resources.ssh.agent_key_count", lambda path: 1)
