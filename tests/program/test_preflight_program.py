"""Preflight and fabric network under mocks: what runs where, in which order, and what a failure stops."""

import pytest

from tests.harness import CONTAINER, FakeCloud, run_program, shared_run
from tests.program.test_program import SECRETS, prod

# network.guard (on in the prod stack) only closes ports: its container starts with the image,
# before the checks. Nothing that runs Ray, vLLM or serves anything does.
GUARDS_ONLY = {"spark-vllm.guard"}


def test_every_node_is_checked_before_any_container_starts():
    run = shared_run(prod(), SECRETS, stack="prod")
    for node in ("spark-01", "spark-02"):
        preflight = run.named(f"{node}-preflight")
        assert (
            preflight.inputs["create"].startswith("env NODE=" + node + " FABRIC_IF=enp1s0f1np1")
            and "bash -s <<'SPARK_VLLM_SCRIPT_END'" in preflight.inputs["create"]
        )
        fingerprint = run.named(f"{node}-model-fingerprint")
        assert fingerprint.inputs["create"].startswith("python3 - /models/Qwen3.5-122B-A10B-FP8 <<")
        gpu = run.named(f"{node}-gpu-check")
        assert gpu.inputs["create"].startswith("docker run --rm --gpus all --entrypoint nvidia-smi sha256:")
    checks = {r.urn for r in run.registrations if r.name.endswith(("-preflight", "-model-fingerprint", "-gpu-check"))}
    by_urn = run.by_urn()

    def waits_for(urn: str) -> set[str]:
        deps = set(by_urn[urn].dependencies)
        return deps.union(*(waits_for(d) for d in deps if d in by_urn))

    for container in run.of_type(CONTAINER):
        if container.inputs["name"] in GUARDS_ONLY:
            continue
        # every container waits for every node's checks, not only its own (workers through the head)
        assert checks <= waits_for(container.urn), container.name
    gate, head = run.named("spark-vllm-checks-passed"), run.named("spark-01-container")
    assert checks <= set(gate.dependencies)
    assert gate.urn in head.dependencies
    # the gate holds what every node agreed on; the head's own inputs take nothing from it
    assert gate.inputs["create"] == "echo '2 node(s) checked: image sha256:" + "ab" * 32 + ", model ffffffffffffffff'"
    assert head.inputs["image"] == run.named("spark-01-image").outputs["image_id"]


def test_peers_are_named_in_each_preflight():
    run = shared_run(prod(), SECRETS, stack="prod")
    assert "PEERS=spark-02=192.168.200.13" in run.named("spark-01-preflight").inputs["create"]
    assert "PEERS=spark-01=192.168.200.12" in run.named("spark-02-preflight").inputs["create"]


def test_a_model_that_differs_on_one_node_stops_every_container():
    class Differing(FakeCloud):
        def fingerprint(self, node):
            result = super().fingerprint(node)
            if node == "spark-02":
                result = {**result, "fingerprint": "e" * 64, "files": {"config.json": 701}}
            return result

    cloud = Differing()
    with pytest.raises(Exception, match=r"model differs: spark-02 vs spark-01: config.json size 701 vs 700"):
        run_program(prod(), SECRETS, stack="prod", mocks=cloud)
    assert set(cloud.containers) <= GUARDS_ONLY


def test_a_failing_check_on_one_node_stops_every_container():
    class Failing(FakeCloud):
        def new_resource(self, args):
            if args.name == "spark-02-preflight":
                raise RuntimeError("preflight spark-02: cannot reach spark-01 (192.168.200.12) via enp1s0f1np1")
            return super().new_resource(args)

    cloud = Failing()
    with pytest.raises(Exception, match="cannot reach spark-01"):
        run_program(prod(), SECRETS, stack="prod", mocks=cloud)
    assert set(cloud.containers) <= GUARDS_ONLY


def test_cpu_only_hosts_skip_the_gpu_check_and_repo_ids_skip_the_fingerprint():
    run = run_program(prod(container={"gpus": False}, model="Qwen/Qwen3-0.6B"), SECRETS, stack="prod")
    names = {r.name for r in run.registrations}
    assert not any(n.endswith(("-gpu-check", "-model-fingerprint")) for n in names)
    assert "MODEL= " in run.named("spark-01-preflight").inputs["create"]


def test_managed_fabric_network_is_written_before_any_check_and_removed_on_delete():
    run = run_program(prod(network={"manage": True, "mtu": 9000}), SECRETS, stack="prod")
    networks = {n: run.named(f"{n}-fabric-network") for n in ("spark-01", "spark-02")}
    create = networks["spark-01"].inputs["create"]
    assert "NETPLAN_PATH=/etc/netplan/40-spark-vllm-fabric.yaml" in create
    assert "'SUDO=sudo -n'" in create and "ACTION=apply" in create  # user aurora is not root
    assert "ACTION=remove" in networks["spark-01"].inputs["delete"]
    for node in ("spark-01", "spark-02"):
        deps = set(run.named(f"{node}-preflight").dependencies)
        assert {networks["spark-01"].urn, networks["spark-02"].urn} <= deps


def test_no_fabric_network_resource_unless_managed():
    run = shared_run(prod(), SECRETS, stack="prod")
    assert not any(r.name.endswith("-fabric-network") for r in run.registrations)


# --- the memory plan --------------------------------------------------------------------------------


def test_the_seed_recipe_fits_and_its_plan_is_an_output():
    run = shared_run(prod(), SECRETS, stack="prod")
    plan = run.exports["memoryPlan"]
    assert plan["checked"] is True and plan["fits"] is True and plan["maxModelLen"] == 32768
    node = plan["nodes"]["spark-02"]
    assert node["memory_gib"] == 119.21 and node["budget_gib"] == 107.29 and node["weights_gib"] == 58.67
    assert node["max_sequences"] > 20 and node["headroom_gib"] > 40


def one_spark(**changes) -> dict:
    cfg = prod(tensorParallelSize=1, **changes)
    cfg["nodes"] = cfg["nodes"][:1]
    return cfg


def test_a_model_that_does_not_fit_stops_before_any_container_with_the_numbers_and_ways_out():
    cloud = FakeCloud()
    with pytest.raises(Exception) as caught:
        run_program(one_spark(), SECRETS, stack="prod", mocks=cloud)
    message = str(caught.value)
    assert "the model does not fit (memoryCheck: enforce)" in message
    assert "spark-01: needs 121." in message and "has 107.29 GiB (119.21 GiB × gpuMemoryUtilization 0.9)" in message
    assert "ways out:" in message and "2 GPUs or more" in message
    assert set(cloud.containers) <= GUARDS_ONLY


def test_memory_check_warn_deploys_with_a_warning_and_off_skips_the_plan(caplog):
    with caplog.at_level("WARNING"):
        run = run_program(one_spark(memoryCheck="warn"), SECRETS, stack="prod")
    assert run.exports["memoryPlan"]["fits"] is False
    assert any("the model does not fit (memoryCheck: warn)" in r.getMessage() for r in caplog.records)
    off = run_program(one_spark(memoryCheck="off"), SECRETS, stack="prod")
    assert off.exports["memoryPlan"] == {"checked": False, "reason": "memoryCheck: off"}


def test_a_repo_id_model_is_not_planned():
    run = run_program(prod(model="Qwen/Qwen3-0.6B"), SECRETS, stack="prod")
    assert run.exports["memoryPlan"]["checked"] is False


def test_dropping_the_page_cache_runs_on_every_node_just_before_vllm_starts():
    run = run_program(prod(memory={"dropPageCache": True}), SECRETS, stack="prod")
    serve = run.named("spark-vllm-serve")
    for node in ("spark-01", "spark-02"):
        drop = run.named(f"{node}-drop-page-cache")
        assert drop.inputs["create"] == "sudo -n sh -c 'sync && echo 1 > /proc/sys/vm/drop_caches'"  # user aurora
        assert drop.urn in serve.dependencies
        assert run.named("spark-vllm-cluster-ready").urn in drop.dependencies
    assert not any(r.name.endswith("-drop-page-cache") for r in shared_run(prod(), SECRETS, stack="prod").registrations)


def test_the_image_is_checked_on_every_node_in_a_throwaway_container():
    run = shared_run(prod(), SECRETS, stack="prod")
    for node in ("spark-01", "spark-02"):
        check = run.named(f"{node}-image-check")
        assert check.inputs["create"].startswith(
            "docker run --rm -i --network=none --entrypoint python3 sha256:"
            + "ab" * 32
            + " - <<'SPARK_VLLM_SCRIPT_END'"
        )
        assert "ray.dashboard.optional_deps" in check.inputs["create"]  # what `ray start` imports for the dashboard
        assert check.urn in run.named("spark-vllm-checks-passed").dependencies


@pytest.mark.parametrize(
    "facts, config, message",
    [
        ({"vllm_nnodes": False, "vllm": "0.25.0"}, {"executor": "mp"},
         "image check spark-01: executor mp needs vLLM's multi-node flags (--nnodes, --node-rank, --headless), and "
         "the image's vLLM 0.25.0 has none — use executor: ray, or an image with a newer vLLM"),
        ({"vllm": "0.20.1+nv26.05"}, {},
         "image check spark-01: vLLM 0.20.1+nv26.05 is older than the oldest this program drives (0.25.0): its flags, "
         "routes and cache were never read"),
        ({"ray": "2.49.2"}, {},
         "image check spark-01: ray.auth: token needs Ray 2.52 or later and the image has Ray 2.49.2, which ignores "
         "RAY_AUTH_MODE and would run without authentication"),
        ({"ray_dashboard": False, "ray_dashboard_error": "No module named 'aiohttp_cors'"}, {"ray": {"dashboard": True}},
         "image check spark-01: ray.dashboard: true needs Ray's dashboard packages (ray[default]) and the image lacks "
         "them (No module named 'aiohttp_cors')"),
        ({"vllm": None, "vllm_nnodes": None}, {}, "image check spark-01: the image has no vLLM"),
        ({"vllm": "0.25.0", "vllm_load_tracking": False}, {},
         "image check spark-01: the image's vLLM 0.25.0 has no --enable-server-load-tracking, which every vLLM of this "
         "program is started with"),
    ],
    ids=["mp-without-nnodes", "older-than-supported", "ray-auth-on-old-ray", "dashboard-without-its-packages", "no-vllm",
         "no-load-tracking"],
)  # fmt: skip
def test_an_image_that_cannot_work_stops_every_container_naming_each_node_and_the_fix(facts, config, message):
    cloud = FakeCloud()
    cloud.image_facts = {**FakeCloud.image_facts, **facts}
    with pytest.raises(Exception) as caught:
        run_program(prod(**config), SECRETS, stack="prod", mocks=cloud)
    assert message in str(caught.value)
    assert message.replace("spark-01", "spark-02") in str(caught.value)  # every node, in the one message
    assert set(cloud.containers) <= GUARDS_ONLY


@pytest.mark.parametrize("said", ["0.35.0.dev12+g1234abc", "0.36.1", "nightly"])
def test_a_vllm_newer_than_any_read_deploys_with_a_warning_per_node_naming_what_was_not_checked(caplog, said):
    cloud = FakeCloud()
    cloud.image_facts = {**FakeCloud.image_facts, "vllm": said}
    with caplog.at_level("WARNING"):
        run_program(prod(), SECRETS, stack="prod", mocks=cloud)
    warned = [r.getMessage() for r in caplog.records if "not checked for it" in r.getMessage()]
    assert [w.split(":")[0] for w in warned] == ["image check spark-01", "image check spark-02"], warned
    assert said in warned[0] and "0.34.0" in warned[0] and "the memory plan's cache layout" in warned[0]
    assert set(cloud.containers) - GUARDS_ONLY  # a warning: it deployed


def test_an_image_without_bytecode_that_runs_with_dontwritebytecode_deploys_with_a_warning_per_node(caplog):
    cloud = FakeCloud()
    cloud.image_facts = {**FakeCloud.image_facts, "bytecode": {"vllm": False, "torch": True},
                         "dont_write_bytecode": True}  # fmt: skip
    with caplog.at_level("WARNING"):
        run_program(prod(), SECRETS, stack="prod", mocks=cloud)
    warned = [r.getMessage() for r in caplog.records if "no bytecode" in r.getMessage()]
    assert [w.split(":")[0] for w in warned] == ["image check spark-01", "image check spark-02"]
    assert warned[0].startswith("image check spark-01: vllm in the image has no bytecode and the image runs Python")
    assert set(cloud.containers) - GUARDS_ONLY  # a warning: it deployed
