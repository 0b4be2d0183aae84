"""executor auto: the executor the image the user names can run, chosen before anything exists."""

from __future__ import annotations

import json

import pytest

from components.config import ConfigError, auto_executor, load_cluster_config
from components.plan.preflight import image_problems
from tests.unit.test_config import DELETE, config

STOCK_WITHOUT_RAY = ["vllm/vllm-openai:v0.33.0", "vllm/vllm-openai:v0.19.0", "vllm/vllm-openai", "vllm/vllm-openai:latest",
                     "docker.io/vllm/vllm-openai:v0.25.0", "vllm/vllm-openai:nightly", "vllm/vllm-openai@sha256:" + "a" * 64]  # fmt: skip
WITH_RAY = ["vllm/vllm-openai:v0.18.1", "vllm/vllm-openai:v0.10.1.1", "hellohal2064/vllm-qwen3.5-gb10",
            "nvcr.io/nvidia/vllm:25.09-py3", "registry.lan:5000/spark/vllm:0.25-ray", "localhost:5000/vllm-openai:v0.33.0"]  # fmt: skip


@pytest.mark.parametrize("image", STOCK_WITHOUT_RAY)
def test_the_stock_image_since_0_19_runs_mp(image):
    cfg = load_cluster_config(config(executor=DELETE, image=image))
    assert cfg.executor == "mp" and cfg.executor_reason.startswith("executor auto: mp")


@pytest.mark.parametrize("image", WITH_RAY)
def test_other_images_and_older_stock_ones_run_ray(image):
    cfg = load_cluster_config(config(executor="auto", image=image))
    assert cfg.executor == "ray" and cfg.executor_reason.startswith("executor auto: ray")


def test_a_named_executor_is_kept_and_has_no_reason():
    cfg = load_cluster_config(config(executor="ray", image="vllm/vllm-openai:v0.33.0"))
    assert cfg.executor == "ray" and cfg.executor_reason is None


def test_a_promoted_release_runs_ray_until_the_image_check_says_otherwise():
    assert auto_executor(None)[0] == "ray"
    raw = config(executor=DELETE, image=DELETE, model=DELETE, promoteFrom="organization/spark-vllm/staging")
    assert load_cluster_config(raw).executor == "ray"


def test_the_rules_see_the_chosen_executor():
    # mp needs the same GPUs on every node: auto's mp is held to it like a named one
    problems = pytest.raises(
        ConfigError, load_cluster_config, config(executor=DELETE, nodes__0__gpus=2, tensorParallelSize=3)
    )
    assert "the same number on every node with executor mp" in str(problems.value)


def test_an_image_without_ray_that_auto_sent_to_ray_is_refused_naming_the_choice():
    cfg = load_cluster_config(config(executor=DELETE, image="registry.lan:5000/spark/vllm:0.25"))
    facts = json.dumps({"python": "3.12.3", "vllm": "0.25.0", "vllm_nnodes": True, "ray": None})
    (problem,) = image_problems(cfg, cfg.nodes[1], facts)
    assert problem.startswith("image check spark-02: the image has no Ray (executor auto: ray (registry.lan:5000")
    assert problem.endswith("— set executor: mp, or use an image with Ray installed")
