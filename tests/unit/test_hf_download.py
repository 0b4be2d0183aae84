"""components/scripts/hf_download.py run for real (huggingface_hub, as vLLM images carry it) against the
stand-in Hugging Face Hub: a gated repo with and without the token, a repo that does not exist, and a
second run that downloads nothing."""

import json
import os
import subprocess
import sys

import pytest

from components.plan.programs import script_program
from tests.e2e.hfhub import HubStandIn, Repo

pytest.importorskip("huggingface_hub")  # requirements-dev.txt installs it


@pytest.fixture
def hub(tmp_path):
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text('{"architectures": ["X"]}')
    (repo / "sub" / "tokenizer.json").write_text("{}")
    (repo / "model.safetensors").write_bytes(os.urandom(2 << 20))
    # what vLLM does not load: the same weights as .bin beside the safetensors, Llama's original/ checkpoint
    (repo / "pytorch_model.bin").write_bytes(os.urandom(3 << 20))
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.00.pth").write_bytes(os.urandom(3 << 20))
    (repo / "original" / "params.json").write_text('{"dim": 4096}')
    server = HubStandIn("127.0.0.1", {"org/tiny": Repo(repo, token="hf_right")}).start()
    yield server
    server.stop()


def download(hub, tmp_path, repo="org/tiny", token="hf_right"):
    params = {
        "node": "spark-01",
        "repo": repo,
        "hf_home": str(tmp_path / "cache"),
        "host_cache": "/data/hf",
        "endpoint": hub.endpoint,
        "token": token,
        "progress_seconds": 1,
    }
    program = script_program("hf_download.py", params)
    return subprocess.run([sys.executable, "-"], input=program, capture_output=True, text=True, timeout=120)


def test_a_gated_repo_is_downloaded_with_the_token_and_reports_the_host_path(hub, tmp_path):
    result = download(hub, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    revision = summary["revision"]
    assert summary["snapshot"] == f"/data/hf/hub/models--org--tiny/snapshots/{revision}"
    assert summary["files"] == 4 and (2 << 20) < summary["downloaded_bytes"] < (3 << 20)
    assert "leaving out 2 weight file(s) vLLM does not load: original/consolidated.00.pth, pytorch_model.bin" in (
        result.stdout
    )
    assert not (
        tmp_path / "cache" / "hub" / "models--org--tiny" / "snapshots" / revision / "pytorch_model.bin"
    ).exists()
    snapshot = tmp_path / "cache" / "hub" / "models--org--tiny" / "snapshots" / revision
    assert (snapshot / "config.json").read_text() == '{"architectures": ["X"]}'
    # what vLLM offline resolves the repo id by
    assert (tmp_path / "cache" / "hub" / "models--org--tiny" / "refs" / "main").read_text() == revision
    assert "hf_right" not in result.stdout + result.stderr

    again = download(hub, tmp_path)
    assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1])["downloaded_bytes"] == 0
    fetched = hub.downloads("org/tiny")
    assert sum(fetched.values()) == 4 and "pytorch_model.bin" not in fetched  # each file once, over both runs


def test_without_the_right_token_a_gated_repo_names_the_fix(hub, tmp_path):
    result = download(hub, tmp_path, token="hf_wrong")
    assert result.returncode == 1
    assert "[spark-01] org/tiny is gated or private: set hfToken" in result.stdout


def test_a_repo_that_does_not_exist_is_named(hub, tmp_path):
    result = download(hub, tmp_path, repo="org/missing")
    assert result.returncode == 1
    assert f"[spark-01] no repository org/missing on {hub.endpoint}" in result.stdout
