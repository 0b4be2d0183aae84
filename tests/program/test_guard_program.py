"""network.guard under Pulumi's mocks: per node a host check that removes the rules on delete, the
guard container, its readiness, and everything that listens waiting for it; what turning it on,
adding a node or changing vLLM touches."""

import json

import pytest

from tests.harness import CONTAINER, REMOTE_COMMAND, changed_inputs, run_program, shared_run
from tests.program.test_program import SECRETS, prod

SOURCE_ID = "sha256:" + "ab" * 32  # the fake cloud's image id


def guarded(**changes) -> dict:
    return prod(network={"guard": True}, **changes)


@pytest.fixture(scope="module")
def run():
    return shared_run(guarded(), SECRETS, stack="prod")


def program_params(text: str) -> dict:
    return json.loads(json.loads(text.split("\n", 1)[0].removeprefix("PARAMS = ")))


def test_each_node_gets_a_host_check_a_guard_container_and_a_readiness_wait(run):
    for node, peer in (("spark-01", "192.168.200.13"), ("spark-02", "192.168.200.12")):
        host, box, ready = run.named(f"{node}-guard-host"), run.named(f"{node}-guard"), run.named(f"{node}-guard-ready")
        assert host.typ == REMOTE_COMMAND and box.typ == CONTAINER and ready.typ == REMOTE_COMMAND
        assert box.provider.startswith(run.named(f"{node}-docker").urn)
        assert box.inputs["name"] == "spark-vllm.guard" and box.inputs["networkMode"] == "host"
        assert box.inputs["capabilities"] == {"adds": ["NET_ADMIN"]} and not box.inputs.get("privileged")
        assert box.inputs["image"] == SOURCE_ID and box.inputs["restart"] == "unless-stopped"
        mounts = {(m["type"], m["source"], m["target"], m.get("readOnly", False)) for m in box.inputs["mounts"]}
        assert mounts == {
            ("bind", "/usr", "/host/usr", True),
            ("bind", "/etc", "/host/etc", True),
            ("volume", "spark-vllm-guard", "/var/lib/spark-vllm-guard", False),
        }
        params = program_params(box.inputs["entrypoints"][3])
        assert params["action"] == "run" and params["spec"]["peers"] == [peer]
        assert params["spec"]["interface"] == "enp1s0f1np1" and params["spec"]["ephemeral"] is True
        # the order: image, host check, container, ready
        assert run.named(f"{node}-image").urn in host.dependencies and host.urn in box.dependencies
        assert box.urn in ready.dependencies and len(ready.inputs["triggers"]) == 1  # the container's id
        assert program_params(host.inputs["create"].split("\n", 1)[1])["action"] == "check"
        assert program_params(host.inputs["delete"].split("\n", 1)[1])["action"] == "remove"
        assert (
            host.inputs["create"]
            .split("\n", 1)[0]
            .endswith(f"--entrypoint python3 {SOURCE_ID} - <<'SPARK_VLLM_SCRIPT_END'")
        )
        assert program_params(ready.inputs["stdin"])["hash"] == params["hash"]
        assert "docker logs --tail 60 spark-vllm.guard" in ready.inputs["create"]


def test_every_node_container_waits_for_its_guard_and_reads_the_marker(run):
    for node in ("spark-01", "spark-02"):
        container = run.named(f"{node}-container")
        assert run.named(f"{node}-guard-ready").urn in container.dependencies
        assert json.loads(container.inputs["command"][0])["guard_marker"] == "/run/spark-vllm-guard/applied.json"
        marker = [m for m in container.inputs["mounts"] if m["source"] == "spark-vllm-guard"]
        assert marker == [
            {"type": "volume", "source": "spark-vllm-guard", "target": "/run/spark-vllm-guard", "readOnly": True}
        ]


def test_the_depot_listens_only_after_the_sources_guard():
    run = run_program(guarded(imageTransfer={"method": "copy"}), SECRETS, stack="prod")
    assert run.named("spark-01-guard-ready").urn in run.named("spark-vllm-depot").dependencies
    spec = program_params(run.named("spark-01-guard").inputs["entrypoints"][3])["spec"]
    assert [29650, 29650] in spec["guarded"]
    # the worker's guard runs the image it received
    assert run.named("spark-02-image").urn in run.named("spark-02-guard-host").dependencies


def unguarded(**changes) -> dict:
    return prod(network={}, **changes)


def test_without_the_guard_nothing_of_it_exists_and_the_containers_do_not_know_it():
    run = run_program(unguarded(), SECRETS, stack="prod")
    assert not [r for r in run.registrations if "guard" in r.name]
    container = run.named("spark-01-container")
    assert "guard_marker" not in json.loads(container.inputs["command"][0])


def test_turning_the_guard_on_adds_it_and_restarts_each_node_container_once():
    result = changed_inputs(
        run_program(unguarded(), SECRETS, stack="prod"), run_program(guarded(), SECRETS, stack="prod")
    )
    for node in ("spark-01", "spark-02"):
        assert result[f"{node}-guard-host"] == result[f"{node}-guard"] == result[f"{node}-guard-ready"] == "create"
        assert result[f"{node}-container"] == {"command", "mounts"}


def test_a_vllm_change_touches_no_guard_and_no_container():
    result = changed_inputs(
        run_program(guarded(), SECRETS, stack="prod"), run_program(guarded(maxModelLen=16384), SECRETS, stack="prod")
    )
    assert set(result) <= {"spark-vllm-serve", "spark-vllm-ready", "spark-vllm-smoke", "spark-vllm-benchmark",
                           "spark-vllm-cluster-ready"}  # fmt: skip


def test_a_node_added_updates_every_guard_and_no_ray_container():
    three = guarded(tensorParallelSize=3)
    third = {**three["nodes"][1], "name": "spark-03", "host": "spark-03.lan", "fabricAddress": "192.168.200.14"}
    three["nodes"] = [*three["nodes"], third]
    result = changed_inputs(run_program(guarded(), SECRETS, stack="prod"), run_program(three, SECRETS, stack="prod"))
    # the peers changed on every node: each guard applies its new rules; Ray's containers stay
    assert result["spark-01-guard"] == result["spark-02-guard"] == {"entrypoints"}
    assert result["spark-01-guard-host"] == result["spark-02-guard-host"] == {"create", "delete"}
    assert "spark-01-container" not in result and "spark-02-container" not in result
    assert result["spark-03-guard"] == "create"
