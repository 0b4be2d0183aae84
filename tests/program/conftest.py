import pytest


@pytest.fixture(autouse=True)
def _isolated_state_dir(tmp_path, monkeypatch):
    """The program writes known_hosts and key files under SPARK_VLLM_HOME: keep tests out of ~."""
    monkeypatch.setenv("SPARK_VLLM_HOME", str(tmp_path / "spark-vllm-home"))
