"""The benchmark after deploy, promotion floors on its figures, and the metrics outputs, under mocks."""

import json

import pytest

from components.config import ConfigError
from tests.harness import CONTAINER, IMAGE, PROGRAM_KEY, FakeCloud, changed_inputs, run_program
from tests.program.test_program import SECRETS, prod
from tests.program.test_promotion import STAGING, promoted, release, staging_cloud

COMMAND = "command:remote:Command"


def params_of(registration) -> dict:
    """PARAMS of a remote command that runs a script (its stdin's first line)."""
    return json.loads(json.loads(registration.inputs["stdin"].split("\n", 1)[0].split("=", 1)[1]))


def test_the_benchmark_runs_after_the_smoke_test_with_the_configured_load_and_its_figures_are_kept():
    run = run_program(prod(benchmark={"enabled": True, "concurrency": 8, "requests": 64}), SECRETS, stack="prod")
    bench = run.named("spark-vllm-benchmark")
    params = params_of(bench)
    assert {key: params[key] for key in ("concurrency", "requests", "prompt_tokens", "output_tokens", "tool")} == {
        "concurrency": 8, "requests": 64, "prompt_tokens": 256, "output_tokens": 128, "tool": "auto"
    }  # fmt: skip
    assert (
        params["base_url"] == "http://192.168.200.12:29002" and params["model_path"] == "/models/Qwen3.5-122B-A10B-FP8"
    )
    assert params["api_key"] == PROGRAM_KEY  # on stdin, which is a secret; never on a command line
    assert PROGRAM_KEY not in bench.inputs["create"]
    # after the smoke test (and the key it is given, vLLM's, made once)
    assert {run.by_urn()[urn].name for urn in bench.dependencies} == {"spark-vllm-smoke", "vllm-api-key"}
    figures = run.exports["benchmark"]
    assert figures["outputTokensPerSecond"] == 412.5 and figures["settings"]["concurrency"] == 8
    recorded = run.exports["release"]["benchmark"]
    assert recorded["outputTokensPerSecond"] == 412.5 and recorded["ttftMs"] == {"p50": 48.0, "p99": 91.5}
    assert recorded["settings"] == {"concurrency": 8, "requests": 64, "promptTokens": 256, "outputTokens": 128}
    assert run.exports["release"]["validated"] is True


def test_without_the_benchmark_there_is_no_step_and_no_figures():
    run = run_program(prod(benchmark={"enabled": False}), SECRETS, stack="prod")
    assert not [r for r in run.registrations if r.name.endswith("-benchmark")]
    assert run.exports["benchmark"] is None and "benchmark" not in run.exports["release"]


def test_a_benchmark_setting_touches_only_the_benchmark_and_the_release_fingerprint_stays():
    first = run_program(prod(), SECRETS, stack="prod")
    second = run_program(prod(benchmark={"enabled": True, "concurrency": 2}), SECRETS, stack="prod")
    assert changed_inputs(first, second) == {"spark-vllm-benchmark": {"stdin", "triggers"}}
    assert first.exports["release"]["fingerprint"] == second.exports["release"]["fingerprint"]


@pytest.mark.parametrize(
    ("floors", "message"),
    [
        ({"minOutputTokensPerSecond": 500}, r"release.minOutputTokensPerSecond: its release made 412.5 output "
         r"tokens/s, below the floor 500.0 \(412.5 output tokens/s, .* 64 requests, concurrency 8, 256 prompt"),
        ({"maxP99TtftMs": 50}, r"release.maxP99TtftMs: its release's p99 time to first token was 91.5 ms, above "
         r"the ceiling 50.0 ms"),
    ],
    ids=["throughput", "ttft"],
)  # fmt: skip
def test_a_release_below_a_floor_is_refused_with_its_figures_and_the_floor(floors, message):
    figures = FakeCloud().benchmark_figures("")
    figures["settings"] = {"concurrency": 8, "requests": 64, "promptTokens": 256, "outputTokens": 128}
    cloud = staging_cloud(release(benchmark=figures))
    with pytest.raises(Exception, match=f"promoteFrom '{STAGING}': {message}"):
        run_program(promoted(release=floors), SECRETS, stack="prod", mocks=cloud)
    assert IMAGE not in cloud.created and CONTAINER not in cloud.created and COMMAND not in cloud.created


def test_a_release_that_meets_its_floors_is_deployed_and_one_without_figures_is_refused():
    figures = FakeCloud().benchmark_figures("")
    floors = {"minOutputTokensPerSecond": 400, "maxP99TtftMs": 100}
    run = run_program(promoted(release=floors), SECRETS, stack="prod", mocks=staging_cloud(release(benchmark=figures)))
    assert run.exports["release"]["promotedFrom"] == STAGING
    with pytest.raises(Exception, match="has no benchmark figures, and this stack's release.* floors need them"):
        run_program(promoted(release=floors), SECRETS, stack="prod", mocks=staging_cloud(release()))


def test_metrics_targets_and_a_prometheus_config_that_holds_no_key():
    run = run_program(prod(ray={"metricsExportPort": 8080}), SECRETS, stack="prod")
    assert run.exports["metrics"] == {
        "targets": {
            "vllm": ["192.168.200.12:29002"],
            "edge": ["192.168.200.12:29003"],  # the edge's requests per client and model, on the fabric
            "ray": ["192.168.200.12:8080", "192.168.200.13:8080"],
        },
        "prometheus": None,
    }
    config = json.loads(run.exports["prometheusConfig"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert "authorization" not in jobs["vllm"]  # vLLM's key guards /v1 only: /metrics needs none
    assert jobs["spark-vllm-edge"]["static_configs"] == [
        {"targets": ["192.168.200.12:29003"], "labels": {"node": "spark-01"}}
    ]
    assert [c["labels"]["node"] for c in jobs["ray"]["static_configs"]] == ["spark-01", "spark-02"]
    assert "prometheusConfig" not in run.secret_exports
    for secret in (*SECRETS.values(), PROGRAM_KEY):
        assert secret not in run.exports["prometheusConfig"]
    ray_heads = [r for r in run.of_type(CONTAINER) if r.inputs["name"] == "spark-vllm-spark-01"]
    assert "--metrics-export-port=8080" in json.dumps(ray_heads[0].inputs)


def test_a_prometheus_node_runs_prometheus_with_the_config_in_a_secret_env_and_its_data_on_a_volume():
    run = run_program(prod(metrics={"prometheusNode": "spark-02", "scrapeIntervalSeconds": 5}), SECRETS, stack="prod")
    container = run.named("spark-02-prometheus")
    assert container.inputs["name"] == "spark-vllm.prometheus" and container.inputs["networkMode"] == "host"
    assert container.inputs["mounts"] == [
        {"type": "volume", "source": "spark-vllm-prometheus", "target": "/prometheus"}
    ]
    entry = container.inputs["entrypoints"]
    assert entry[:2] == ["/bin/sh", "-c"] and "--web.listen-address=0.0.0.0:9090" in entry[2]
    (env,) = container.inputs["envs"]  # one line: the configuration, which holds no key
    assert env.startswith("SPARK_VLLM_PROMETHEUS_CONFIG={") and "\n" not in env
    assert SECRETS["apiKey"] not in env and PROGRAM_KEY not in env
    assert "spark-02-guard-ready" in [run.by_urn()[urn].name for urn in container.dependencies]  # the guard holds first
    image = run.named("spark-02-prometheus-image")
    assert image.inputs["name"] == "prom/prometheus:v3.5.0"
    assert run.exports["metrics"]["prometheus"] == "http://spark-02.lan:9090"
    config = json.loads(run.exports["prometheusConfig"])
    assert config["global"]["scrape_interval"] == "5s"
    assert {job["job_name"] for job in config["scrape_configs"]} == {"vllm", "spark-vllm-edge", "prometheus"}
    guard = params_of(run.named("spark-02-guard-ready"))["spec"]
    assert 9090 in guard["public"]


def test_metrics_and_benchmark_config_problems_are_listed_with_the_rest():
    with pytest.raises(ConfigError) as caught:
        run_program(
            prod(
                maxModelLen=256,
                benchmark={"enabled": True},
                release={"minOutputTokensPerSecond": 10},
                metrics={"prometheusNode": "spark-09"},
                vllm={"port": 30000, "host": "0.0.0.0"},
            ),
            SECRETS,
            stack="prod",
        )
    keys = [p.split(":")[0] for p in caught.value.problems]
    assert keys == ["release.minOutputTokensPerSecond", "benchmark.promptTokens + benchmark.outputTokens",
                    "metrics.prometheusNode"]  # fmt: skip
    # Prometheus on another node scrapes vLLM on the fabric, which the guard lets in whatever apiSources say
    run_program(
        prod(metrics={"prometheusNode": "spark-02", "prometheusPort": 30000},
             network={"guard": True, "apiSources": ["10.0.0.0/8"]}),
        SECRETS,
        stack="prod",
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        run_program(prod(metrics={"prometheusNode": "spark-01", "prometheusPort": 30000}), SECRETS, stack="prod")
    assert "metrics.prometheusPort 30000 (Prometheus) and vllm.port 30000" in "\n".join(caught.value.problems) or (
        "vllm.port 30000 (the endpoint's edge) and metrics.prometheusPort 30000" in "\n".join(caught.value.problems)
    )
