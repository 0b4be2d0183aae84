"""fabric.bandwidthTest: nccl under mocks: an NCCL all-reduce in every node's image, all nodes at once,
after every node's checks and before any Ray container; its figures become the fabric's."""

import pytest

from components.plan import fabric
from tests.harness import CONTAINER, FakeCloud, gate_params_of, run_program
from tests.program.test_preflight_program import GUARDS_ONLY
from tests.program.test_program import SECRETS, prod

NODES = ("spark-01", "spark-02")


def nccl(**fabric_settings) -> dict:
    return prod(fabric={"bandwidthTest": "nccl", **fabric_settings})


def waits_for(run, urn: str) -> set[str]:
    by_urn = run.by_urn()
    deps = set(by_urn[urn].dependencies)
    return deps.union(*(waits_for(run, d) for d in deps if d in by_urn))


def test_every_node_runs_the_test_in_its_image_after_every_nodes_checks_and_before_any_container():
    run = run_program(nccl(), SECRETS, stack="prod")
    checks = {r.urn for r in run.registrations if r.name.endswith(("-preflight", "-gpu-check"))}
    tests = {node: run.named(f"{node}-fabric-nccl") for node in NODES}
    image = "sha256:" + "ab" * 32
    for rank, node in enumerate(NODES):
        test = tests[node]
        create = test.inputs["create"]
        assert create.startswith("timeout --kill-after=10 240 docker run --rm -i --gpus all --network host --ipc host ")
        assert f"--entrypoint python3 {image} - <<'SPARK_VLLM_SCRIPT_END'" in create
        assert "--device /dev/infiniband:/dev/infiniband" in create and "--cap-add IPC_LOCK" in create
        assert "-e NCCL_SOCKET_IFNAME=enp1s0f1np1 " in create and "-e NCCL_IB_HCA=" in create
        params = gate_params_of(create)
        assert (params["node"], params["rank"], params["world"]) == (node, rank, 2)
        assert params["master_address"] == "192.168.200.12"  # the head's fabric address
        # every node's checks first (on every node: the tests meet), all at once after them
        assert checks <= set(test.dependencies)
        assert set(test.inputs["triggers"][:2]) == {image}
        for secret in SECRETS.values():
            assert secret.strip() not in create
    for container in run.of_type(CONTAINER):
        if container.inputs["name"] not in GUARDS_ONLY:
            assert {t.urn for t in tests.values()} <= waits_for(run, container.urn), container.name
    figures = run.exports["fabric"]
    assert figures["bandwidthTest"] == "nccl"
    assert figures["bandwidthGbps"] == {fabric.NCCL_FIGURE: pytest.approx(150.17, abs=0.01)}
    assert figures["floorGbps"] == 110.0  # 55 % of the 200 Gb/s links
    assert figures["nccl"]["network"] == {"spark-01": "IB", "spark-02": "IB"}
    assert figures["problems"] == []
    release = run.exports["release"]
    assert release["fabric"]["bandwidthGbps"] == figures["bandwidthGbps"]
    assert release["fabric"]["nccl"]["transports"] == ["NET/IB/0", "NET/IB/1"]


def test_a_socket_fallback_and_a_slow_all_reduce_stop_the_deploy_before_any_container():
    class Sockets(FakeCloud):
        nccl_network = "Socket"
        nccl_seconds = 0.5  # ~4 Gb/s

    cloud = Sockets()
    with pytest.raises(Exception) as caught:
        run_program(nccl(), SECRETS, stack="prod", mocks=cloud)
    said = str(caught.value)
    assert "the fabric gate found problems (fabric.gate: enforce); nothing was started" in said
    for node in NODES:
        assert f"fabric gate {node} (NCCL test): NCCL fell back to TCP sockets" in said
    assert "bus bandwidth across the 2 nodes is 4.3 Gb/s (0.5 GB/s), below the floor of 110 Gb/s" in said
    assert not [name for name in cloud.containers if name not in GUARDS_ONLY]


def test_with_warn_the_problems_are_kept_and_the_deploy_goes_on():
    class Slow(FakeCloud):
        nccl_seconds = 0.05

    run = run_program(nccl(gate="warn", minBandwidthGbps=175), SECRETS, stack="prod", mocks=Slow())
    figures = run.exports["fabric"]
    assert figures["floorGbps"] == 175
    assert (
        len(figures["problems"]) == 1
        and "below the floor of 175 Gb/s (fabric.minBandwidthGbps)" in (figures["problems"][0])
    )
    assert run.named("spark-01-container")


def test_tcp_and_off_run_no_nccl_test_and_nccl_needs_the_gpus():
    for settings in ({}, {"bandwidthTest": "off"}, {"bandwidthTest": "nccl", "gate": "off"}):
        run = run_program(prod(fabric=settings), SECRETS, stack="prod")
        assert not [r for r in run.registrations if r.name.endswith("-fabric-nccl")]
    run = run_program(nccl(), SECRETS, stack="prod")
    assert gate_params_of(run.named("spark-01-fabric-gate").inputs["create"])["bandwidth"] is None  # no TCP test
    with pytest.raises(Exception, match=r"fabric.bandwidthTest: 'nccl' — tcp or off with container.gpus: false"):
        run_program({**nccl(), "container": {"gpus": False}}, SECRETS, stack="prod")
