"""The host check under mocks (#68): each node's host facts (components/scripts/host_facts.py) against its image's,
judged before any container; a host that cannot run the image stops the program naming the node and the fix."""

from __future__ import annotations

import copy

import pytest

from tests.harness import CONTAINER, FakeCloud, run_program, shared_run
from tests.program.test_program import SECRETS, prod


class Host(FakeCloud):
    """One node (spark-02) on another host, or another image, as a test gives them."""

    def __init__(self, node: dict | None = None, image: dict | None = None):
        super().__init__()
        self.node, self.image_facts = node or {}, {**FakeCloud.image_facts, **(image or {})}

    def host_of(self, node: str) -> dict:
        return {**copy.deepcopy(self.host_facts), **(self.node if node == "spark-02" else {})}


def refused(cloud: FakeCloud, cfg: dict | None = None) -> str:
    with pytest.raises(Exception) as caught:
        run_program(cfg or prod(), SECRETS, stack="prod", mocks=cloud)
    assert not [name for name in cloud.containers if name != "spark-vllm.guard"], "a container started"
    return str(caught.value)


def test_each_node_runs_the_host_facts_on_its_host_before_any_container():
    run = shared_run(prod(), SECRETS, stack="prod")
    for node in ("spark-01", "spark-02"):
        step = run.named(f"{node}-host-check")
        assert step.inputs["create"].startswith("env FABRIC_IF=enp1s0f1np1 python3 - <<'SPARK_VLLM_SCRIPT_END'")
        assert run.named(f"{node}-preflight").urn in step.dependencies
        assert step.urn in run.named("spark-vllm-checks-passed").dependencies
    assert all(r.urn not in run.named("spark-01-host-check").dependencies for r in run.of_type(CONTAINER))


def test_an_image_built_for_a_newer_cuda_than_the_driver_is_refused_naming_the_node():
    said = refused(Host(node={"driver": "575.57.08", "cuda": "12.9"}))
    assert "host check spark-02: the image's torch 2.11.0 is built for CUDA 13.0, which needs NVIDIA driver 580" in said
    assert "the node runs driver 575.57.08 (CUDA 12.9)" in said and "update the node's driver" in said
    assert "host check spark-01" not in said


def test_a_torch_without_code_for_the_gpu_is_refused():
    said = refused(Host(image={"torch_arch": ["sm_80", "sm_90"]}))
    # both nodes' GB10s (12.1): sm_90's major is not 12, and there is no PTX
    assert (
        "host check spark-01: the image's torch 2.11.0 carries GPU code for sm_80 sm_90 and none that runs on " in said
    )
    assert "the node's NVIDIA GB10 (compute capability 12.1)" in said and "sm_121" in said
    assert said.count("no kernel image is available") == 2


def test_a_known_bad_kernel_is_refused_with_its_source_and_only_where_rdma_is_used():
    said = refused(Host(node={"kernel": "7.0.0-1019-nvidia"}))
    assert "host check spark-02: kernel 7.0.0-1019-nvidia: NCCL over RoCE fails at start" in said
    assert "6.17.0-1032-nvidia" in said and "MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks#14 (2026-09-12)" in said
    # NCCL over TCP does not register memory with the NIC: the stack deploys
    run_program(prod(nccl={"ibDisable": True}), SECRETS, stack="prod", mocks=Host(node={"kernel": "7.0.0-1019-nvidia"}))


def test_a_good_host_passes_a_newer_cuda_minor_and_differing_drivers_warn(caplog):
    with caplog.at_level("WARNING"):
        run = run_program(
            prod(), SECRETS, stack="prod", mocks=Host(node={"driver": "580.65.06"}, image={"torch_cuda": "13.1"})
        )
    warned = [r.getMessage() for r in caplog.records]
    assert any(
        "host check: the nodes run different drivers (spark-01 580.95.05, spark-02 580.65.06)" in w for w in warned
    )
    assert any("CUDA 13.1" in w and "minor version compatibility" in w for w in warned)
    assert run.named("spark-01-container")


def test_a_host_that_cannot_say_is_not_refused():
    unknown = {fact: None for fact in FakeCloud.host_facts}
    run_program(prod(), SECRETS, stack="prod", mocks=Host(node=unknown, image={"torch": None, "torch_cuda": None,
                                                                              "torch_arch": None, "nccl": None}))  # fmt: skip


STAGING = "organization/spark-vllm/staging"


def promoting(hosts: dict | None, node: dict | None = None) -> Host:
    """prod promoting staging's release (validated on `hosts`), spark-02 on the host `node` describes."""
    from tests.program.test_promotion import release

    cloud = Host(node=node)
    cloud.stack_outputs = {STAGING: {"release": release(**({"hosts": hosts} if hosts is not None else {}))}}
    return cloud


def promoted(**changes) -> dict:
    cfg = prod(promoteFrom=STAGING, **changes)
    del cfg["image"], cfg["model"]
    return cfg


def test_the_release_records_the_hosts_it_ran_on_and_no_fingerprint_changes():
    run = shared_run(prod(), SECRETS, stack="prod")
    assert run.exports["release"]["hosts"] == {
        "kernel": ["6.17.0-1032-nvidia"], "os": ["Ubuntu 24.04.3 LTS"], "driver": ["580.95.05"], "cuda": ["13.0"],
        "gpus": ["NVIDIA GB10 (12.1)"], "toolkit": ["1.18.0"], "rdmaCore": ["50.0-2ubuntu0.2"],
        "nicFirmware": ["28.45.4028"],
    }  # fmt: skip
    other = run_program(prod(), SECRETS, stack="prod", mocks=Host(node={"driver": "580.65.06"}))
    assert other.exports["release"]["hosts"]["driver"] == ["580.65.06", "580.95.05"]
    assert other.exports["release"]["fingerprint"] == run.exports["release"]["fingerprint"]


def test_a_promotion_names_each_host_fact_that_differs_and_refuses_those_release_same_hosts_names(caplog):
    validated = dict(shared_run(prod(), SECRETS, stack="prod").exports["release"]["hosts"])
    with caplog.at_level("WARNING"):
        run_program(promoted(), SECRETS, stack="prod", mocks=promoting(validated, {"driver": "580.65.06"}))
    warned = [r.getMessage() for r in caplog.records if "where the release was validated" in r.getMessage()]
    assert warned == [f"promoteFrom '{STAGING}': driver 580.95.05 where the release was validated, 580.65.06, "
                      "580.95.05 here"]  # fmt: skip
    cloud = promoting(validated, {"driver": "580.65.06", "nic_firmware": "28.43.1014"})
    said = refused(cloud, promoted(release={"sameHosts": ["driver", "nicFirmware"]}))
    assert "driver 580.95.05 where the release was validated, 580.65.06, 580.95.05 here (release.sameHosts)" in said
    assert "nicFirmware 28.45.4028 where the release was validated, 28.43.1014, 28.45.4028 here" in said
    # the same hosts, or a release recorded before hosts were: nothing to say
    run_program(promoted(release={"sameHosts": ["driver"]}), SECRETS, stack="prod", mocks=promoting(validated))
    run_program(promoted(release={"sameHosts": ["driver"]}), SECRETS, stack="prod",
                mocks=promoting(None, {"driver": "580.65.06"}))  # fmt: skip


def test_release_same_hosts_takes_only_facts_a_release_records():
    with pytest.raises(Exception, match=r"release\.sameHosts\[0\]: 'bios' — Input should be 'kernel'"):
        run_program(promoted(release={"sameHosts": ["bios"]}), SECRETS, stack="prod", mocks=promoting(None))


def test_each_deployment_records_the_hosts_of_its_own_nodes():
    from tests.program.test_deployments_program import run_fleet

    deployments = run_fleet().exports["release"]["deployments"]
    assert {name: each["hosts"]["gpus"] for name, each in deployments.items()} == {
        name: ["NVIDIA GB10 (12.1)"] for name in ("big", "coder", "small")
    }
