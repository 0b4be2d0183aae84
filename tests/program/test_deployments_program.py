"""Several models on one cluster, under Pulumi's mocks: each replica's own resources, the router and its
steps, what a change to one deployment touches, the rolling order, the outputs, promotion, and that a
single-model stack keeps every resource it had."""

import copy
import json
import re
from pathlib import Path

import pytest

from tests.harness import CONTAINER, FakeCloud, changed_inputs, run_program, shared_run
from tests.program.test_program import SECRETS, prod

HERE = Path(__file__).resolve().parent
SMALL_WEIGHTS = 1_500_000_000  # a 0.6B model's bf16 weights


class Models(FakeCloud):
    """The seed's 126 GB model for deployment big; a small one for every other."""

    def fingerprint(self, node: str) -> dict:
        found = super().fingerprint(node)
        if node.startswith(("big-", "qwen-")):
            return found
        config = copy.deepcopy(found["config"])
        config["text_config"]["num_hidden_layers"] = 28
        return {**found, "fingerprint": "a" * 64, "files": {"config.json": 700, "model.safetensors": SMALL_WEIGHTS},
                "config": config}  # fmt: skip


def fleet(**changes) -> dict:
    """The README's three-Spark example: a big model over two nodes, a coder and a small one on the third."""
    cfg = prod()
    for key in ("model", "tensorParallelSize", "maxModelLen", "vllm"):
        cfg.pop(key)
    cfg["nodes"].append(dict(cfg["nodes"][1], name="spark-03", host="spark-03.lan", fabricAddress="192.168.200.14"))
    cfg["deployments"] = [
        {"name": "big", "model": "/models/Qwen3.5-122B-A10B-FP8", "nodes": ["spark-01", "spark-02"],
         "tensorParallelSize": 2, "maxModelLen": 32768, "vllm": {"port": 30000, "gpuMemoryUtilization": 0.85}},
        {"name": "coder", "model": "/models/Qwen3-Coder", "nodes": ["spark-03"], "maxModelLen": 32768,
         "vllm": {"port": 8000, "gpuMemoryUtilization": 0.5}},
        {"name": "small", "model": "/models/Qwen3-0.6B", "nodes": ["spark-03"], "replicas": 2, "maxModelLen": 8192,
         "vllm": {"port": 8001, "gpuMemoryUtilization": 0.15}},
    ]  # fmt: skip
    cfg.update(copy.deepcopy(changes))
    return cfg


def run_fleet(cfg=None, mocks=None, secrets=None):
    """The several-models stack under mocks: shared (tests/harness.py shared_run) unless `mocks` are given."""
    if mocks is None:
        return shared_run(cfg or fleet(), secrets or SECRETS, stack="prod", cloud=Models)
    return run_program(cfg or fleet(), secrets or SECRETS, stack="prod", mocks=mocks)


@pytest.fixture(scope="module")
def run():
    return run_fleet()


def changes(before: dict, after: dict) -> dict:
    return changed_inputs(run_fleet(before), run_fleet(after))


def names_of(run) -> set:
    return {r.name for r in run.registrations if r.custom}


def by_name(run, name):
    (found,) = [r for r in run.registrations if r.name == name and r.custom]
    return found


def test_each_replica_has_its_own_containers_and_steps_named_after_it(run):
    containers = {r.inputs["name"]: r for r in run.of_type(CONTAINER)}
    assert set(containers) == {
        "spark-vllm-big-spark-01", "spark-vllm-big-spark-02", "spark-vllm-coder-spark-03",
        "spark-vllm-small-spark-03", "spark-vllm-small-2-spark-03", "spark-vllm.guard", "spark-vllm.router",
        "spark-vllm.edge",
    }  # fmt: skip
    labels = {item["label"]: item["value"] for item in containers["spark-vllm-small-2-spark-03"].inputs["labels"]}
    assert labels["spark-vllm.replica"] == "small-2" and labels["spark-vllm.node"] == "spark-03"
    names = names_of(run)
    for replica in ("big", "coder", "small", "small-2"):
        assert {f"{replica}-serve", f"{replica}-ready", f"{replica}-smoke", f"{replica}-checks-passed",
                f"{replica}-router-drain", f"{replica}-router-undrain"} <= names, replica  # fmt: skip
    assert {
        "big-spark-02-joined",
        "big-spark-02-preflight",
        "spark-vllm-fabric-passed",
        "spark-vllm-placement",
    } <= names
    assert "spark-vllm-serve" not in names and "spark-01-container" not in names


def test_replicas_sharing_a_node_serve_on_ports_of_their_own(run):
    serves = {name: json.loads(json.loads(by_name(run, f"{name}-serve").inputs["stdin"].split("\n")[0][9:]))
              for name in ("small", "small-2")}  # fmt: skip
    argv = {name: params["argv"] for name, params in serves.items()}
    assert "--port=8001" in argv["small"] and "--port=8002" in argv["small-2"]


def test_the_router_runs_on_its_node_with_the_keeper_and_every_replica_declared(run):
    router = by_name(run, "spark-vllm-router")
    assert router.inputs["networkMode"] == "host" and router.inputs["restart"] == "unless-stopped"
    program = router.inputs["entrypoints"][-1]
    params = json.loads(json.loads(program.split("\n")[0][len("PARAMS = ") :]))
    assert params == {**params, "mode": "serve", "port": 8080, "policy": "round_robin", "version": "0.1.17",
                      "metrics_host": "192.168.200.12", "metrics_port": 29000}  # fmt: skip
    assert "spark-01-docker" in by_name(run, "spark-vllm-router").provider
    workers = by_name(run, "spark-vllm-router-workers").inputs["stdin"]
    declared = json.loads(json.loads(workers.split("\n")[0][len("PARAMS = ") :]))["workers"]
    assert [(w["url"], w["model"], w["replica"]) for w in declared] == [
        ("http://192.168.200.12:30000", "/models/Qwen3.5-122B-A10B-FP8", "big"),
        ("http://192.168.200.14:8000", "/models/Qwen3-Coder", "coder"),
        ("http://192.168.200.14:8001", "/models/Qwen3-0.6B", "small"),
        ("http://192.168.200.14:8002", "/models/Qwen3-0.6B", "small-2"),
    ]


def deps(run, name) -> set:
    return {urn.rsplit("::", 1)[1] for urn in by_name(run, name).dependencies}


def test_a_replica_leaves_the_router_before_it_changes_and_the_next_waits_for_it_to_come_back(run):
    assert "small-router-drain" in deps(run, "small-spark-03-container")  # containers after the drain
    assert "small-router-drain" in deps(run, "small-serve")  # a vLLM-only change too
    assert "big-router-drain" in deps(run, "big-cluster-ready")  # with Ray, before the group is waited for
    assert {"small-smoke", "small-router-drain"} <= deps(run, "small-router-undrain")
    assert "small-router-undrain" in deps(run, "small-2-router-drain")  # one replica at a time
    assert "small-router-undrain" not in deps(run, "coder-router-drain")  # other deployments change at once
    undrains = {f"{r}-router-undrain" for r in ("big", "coder", "small", "small-2")}
    assert undrains <= deps(run, "spark-vllm-router-workers")
    assert "spark-vllm-router-workers" in deps(run, "spark-vllm-router-smoke")


def test_a_change_to_one_deployment_touches_only_its_resources():
    after = fleet()
    after["deployments"][1]["vllm"]["extraArgs"] = ["--max-num-seqs", "8"]
    result = changes(fleet(), after)
    assert result and all(name.startswith("coder-") for name in result), result
    assert result["coder-serve"] == {"stdin"}  # restarted in place: no container
    assert {"coder-router-drain", "coder-router-undrain"} <= set(result)  # out of the router, then back


def test_adding_a_deployment_touches_no_other_deployment():
    before = fleet()
    before["deployments"].pop(1)
    result = changes(before, fleet())
    assert not [name for name in result if name.startswith(("big", "small"))], result
    created = {name for name, what in result.items() if what == "create"}
    assert {"coder-spark-03-container", "coder-serve", "coder-router-undrain"} <= created
    # the edge's configuration lists the new model: a reload, no container
    assert set(result) - created <= {"spark-vllm-router-workers", "spark-vllm-router-smoke", "spark-03-guard",
                                     "spark-03-guard-host", "spark-03-guard-ready", "spark-vllm-edge-config"}  # fmt: skip
    removed = changes(fleet(), before)
    assert {name for name, what in removed.items() if what == "delete"} >= {"coder-serve", "coder-spark-03-container"}


def test_the_outputs_name_every_deployment_and_the_router_is_the_endpoint(run):
    exports = run.exports
    assert exports["endpoint"] == "http://spark-01.lan:8080/v1"
    small = exports["deployments"]["small"]
    assert [(r["name"], r["endpoint"]) for r in small["replicas"]] == [
        ("small", "http://192.168.200.14:8001/v1"),  # on the fabric: the router's way in, not the network's
        ("small-2", "http://192.168.200.14:8002/v1"),
    ]
    assert exports["containers"]["big"] == {
        "spark-01": "spark-vllm-big-spark-01",
        "spark-02": "spark-vllm-big-spark-02",
    }
    assert exports["metrics"]["targets"]["router"] == ["192.168.200.12:29000"]
    assert exports["metrics"]["targets"]["vllm"] == [
        "192.168.200.12:30000", "192.168.200.14:8000", "192.168.200.14:8001", "192.168.200.14:8002",
    ]  # fmt: skip
    assert set(exports["memoryPlan"]) == {"big", "coder", "small", "small-2"}
    assert "spark-vllm-small-2-spark-03" in exports["statusCommand"]
    (node3,) = [n for n in exports["diagnostics"]["nodes"] if n["name"] == "spark-03"]
    assert node3["containers"][:3] == ["spark-vllm-coder-spark-03", "spark-vllm-small-spark-03",
                                       "spark-vllm-small-2-spark-03"]  # fmt: skip
    release = exports["release"]
    assert release["validated"] is True and release["image"].startswith("hellohal2064/vllm-qwen3.5-gb10@sha256:")
    assert set(release["deployments"]) == {"big", "coder", "small"}
    assert release["deployments"]["coder"]["model"] == "/models/Qwen3-Coder"
    assert "routerSmoke" in exports


def test_deployments_that_do_not_fit_a_shared_node_together_are_refused_before_any_container():
    cfg = fleet()
    cfg["deployments"][1]["vllm"]["gpuMemoryUtilization"] = 0.55
    cfg["deployments"][2]["vllm"]["gpuMemoryUtilization"] = 0.2  # 0.55 + 0.2 + 0.2 = 0.95 of 119.21 GiB, 8 reserved
    mocks = Models()
    with pytest.raises(Exception) as caught:
        run_fleet(cfg, mocks)
    message = str(caught.value)
    assert "the deployments sharing a node do not fit there together" in message
    assert "node spark-03: coder 65.57 GiB + small 23.84 GiB + small-2 23.84 GiB = 113.25 GiB" in message
    assert "more than its 119.21 GiB" in message
    assert "less the OS's reserve of 8 GiB" in message
    assert not [name for name in mocks.containers if name.startswith("spark-vllm-") and "." not in name]


def test_the_three_spark_example_stack_file_deploys_as_the_docs_say():
    from tests.program.test_program import HOST_KEY, stack_file

    cfg = stack_file("fleet")
    for node in cfg["nodes"]:
        node["hostKey"] = HOST_KEY
    run = run_program(cfg, SECRETS, stack="fleet", mocks=Models())
    assert run.exports["endpoint"] == "http://spark-01.lan:8080/v1"
    assert set(run.exports["deployments"]) == {"qwen", "coder", "small"}
    assert run.exports["deployments"]["qwen"]["executor"] == "ray"  # two nodes, a Spark image: Ray
    assert run.exports["deployments"]["coder"]["executor"] == "mp"  # one node: no Ray
    plans = run.exports["memoryPlan"]
    assert plans["coder"]["fits"] and plans["small"]["fits"] and plans["qwen"]["fits"]


def staging_release() -> dict:
    run = run_fleet()
    return run.exports["release"]


def test_a_release_with_deployments_is_promoted_deployment_by_deployment():
    source = staging_release()
    cfg = fleet(promoteFrom="organization/spark-vllm/staging")
    cfg.pop("image")
    for each in cfg["deployments"]:
        each.pop("model")
    mocks = Models(stack_outputs={"organization/spark-vllm/staging": {"release": source}})
    promoted = run_fleet(cfg, mocks).exports["release"]
    assert promoted["promotedFrom"] == "organization/spark-vllm/staging"
    assert {name: each["model"] for name, each in promoted["deployments"].items()} == {
        name: each["model"] for name, each in source["deployments"].items()
    }
    cfg["deployments"].append(
        {"name": "new", "nodes": ["spark-01"], "vllm": {"port": 8500, "gpuMemoryUtilization": 0.1}}
    )
    cfg["deployments"][0]["vllm"]["gpuMemoryUtilization"] = 0.8
    with pytest.raises(Exception, match="its release has no deployment 'new'"):
        run_fleet(cfg, Models(stack_outputs={"organization/spark-vllm/staging": {"release": source}}))


def served_lengths(run) -> dict[str, int]:
    """--max-model-len as each replica's vLLM is told it (its serve step's argv), by served model."""
    found = {}
    for r in run.registrations:
        if r.name.endswith("-serve"):
            length = re.search(r"--max-model-len=(\d+)", r.inputs["stdin"])
            model = re.search(r'\\"--served-model-name\\",\s*\\"([^\\]+)', r.inputs["stdin"])
            found[model.group(1) if model else r.name] = int(length.group(1)) if length else None
    return found


def card_lengths(run) -> dict[str, int]:
    """max_model_len as the endpoint's /v1/models/<id> card says it, by model."""
    from tests.program.test_edge_program import edge_config

    cards = re.findall(r'string "(\{.*?\})" if \{ path,url_dec', edge_config(run))
    return {card["id"]: card["max_model_len"] for card in (json.loads(c.replace('\\"', '"')) for c in cards)}


def test_what_vllm_runs_and_what_the_endpoint_says_of_it_come_from_the_release():
    """With promoteFrom, vLLM runs the release's maxModelLen: the model cards say that one, not the stack's
    (which may differ, or be unset)."""
    source = staging_release()
    cfg = fleet(promoteFrom="organization/spark-vllm/staging")
    cfg.pop("image")
    for each in cfg["deployments"]:
        each.pop("model")
        each["maxModelLen"] = 4096  # the stack says otherwise; the release wins
    cfg["deployments"][1].pop("maxModelLen")  # and unset
    run = run_fleet(cfg, Models(stack_outputs={"organization/spark-vllm/staging": {"release": source}}))
    cards = card_lengths(run)
    assert cards == {"/models/Qwen3.5-122B-A10B-FP8": 32768, "/models/Qwen3-Coder": 32768, "/models/Qwen3-0.6B": 8192}
    assert set(served_lengths(run).values()) == {32768, 8192}
    assert cards == card_lengths(run_fleet())  # the stack validated, as it serves


@pytest.mark.parametrize("variant", ["prod", "dev", "staging", "mp"])
def test_a_single_model_stack_keeps_every_resource_it_had_before_deployments(variant):
    """The URNs of these stacks as the program made them before deployments existed (recorded at 2ecc6e7):
    an existing stack previews with no resource removed or renamed; what is added is the edge, vLLM's own key and the
    smoke test through the edge, and each node's host check (#68)."""
    from tests.program.test_program import stack_file

    expected = json.loads((HERE / "single_model_urns.json").read_text())[variant]
    if variant == "prod":
        cfg, stack = prod(), "prod"
    elif variant == "mp":
        cfg = prod(executor="mp", memory={"dropPageCache": True}, network={"guard": True, "manage": True, "mtu": 9000})
        stack = "prod"
    else:
        cfg, stack = stack_file(variant), variant
        if variant == "staging":
            cfg = {**cfg, "nodes": [dict(n, hostKey=prod()["nodes"][0]["hostKey"]) for n in cfg["nodes"]]}
    found = sorted(r.urn for r in run_program(cfg, SECRETS, stack=stack, mocks=FakeCloud()).registrations)
    added = {urn.rsplit("::", 1)[1] for urn in set(found) - set(expected)}
    head = cfg["nodes"][0]["name"]
    assert set(expected) <= set(found)
    assert added == {
        "spark-vllm",
        "spark-vllm-edge-config",
        f"{head}-edge",
        f"{head}-edge-image",
        "vllm-api-key",
        "spark-vllm-endpoint-smoke",
        *(f"{node['name']}-host-check" for node in cfg["nodes"]),
    }


def handover(run, name: str) -> dict:
    return json.loads(json.loads(by_name(run, name).inputs["stdin"].split("\n")[0][len("PARAMS = ") :]))


def test_replicas_sharing_a_gpu_get_their_plans_kv_cache_in_bytes_and_a_turn_the_others_do_not(run):
    plans = run.exports["memoryPlan"]
    for name in ("coder", "small", "small-2"):  # spark-03: three vLLMs on one GPU
        plan, params = plans[name], handover(run, f"{name}-serve")
        pinned = plan["kvCache"]["pinnedBytes"]
        assert f"--kv-cache-memory-bytes={pinned}" in params["argv"]
        room = min(node["kv_room_gib"] for node in plan["nodes"].values())
        assert abs(plan["kvCache"]["pinnedGib"] - room) <= 0.01 and pinned % (1024 * 1024) == 0
        others = {"coder", "small", "small-2"} - {name}
        assert set(plan["coTenants"]["spark-03"]) == others
        assert params["spec"]["tenancy"] == {"replica": name, "turn_hold_seconds": 1800}
        assert "--gpu-memory-utilization=" in " ".join(params["argv"])  # vLLM's start check still reads it
    big = handover(run, "big-serve")
    assert "kvCache" not in plans["big"] and "coTenants" not in plans["big"]
    assert not any(arg.startswith("--kv-cache-memory-bytes") for arg in big["argv"]) and "tenancy" not in big["spec"]


def test_a_single_model_stack_keeps_its_profiled_kv_cache_and_its_spec():
    run = shared_run(prod(), SECRETS, stack="prod")
    params = handover(run, "spark-vllm-serve")
    assert not any(arg.startswith("--kv-cache-memory-bytes") for arg in params["argv"])
    assert "tenancy" not in params["spec"] and "kvCache" not in run.exports["memoryPlan"]


def test_a_small_model_beside_the_worker_half_of_a_tp2_model_pins_both_and_hands_the_worker_rank_a_turn():
    cfg = fleet()
    cfg["deployments"] = [cfg["deployments"][0], {"name": "coder", "model": "/models/Qwen3-Coder",
                          "nodes": ["spark-02"], "maxModelLen": 8192, "vllm": {"port": 8000,
                          "gpuMemoryUtilization": 0.1}}]  # fmt: skip
    cfg["deployments"][0]["vllm"]["gpuMemoryUtilization"] = 0.8
    cfg["deployments"][0]["executor"] = "mp"  # spark-02 runs big's rank 1 itself (with Ray, big's head starts it)
    run = run_fleet(cfg)
    plans = run.exports["memoryPlan"]
    assert plans["big"]["coTenants"] == {"spark-02": ["coder"]} and plans["coder"]["coTenants"] == {"spark-02": ["big"]}
    worker = handover(run, "big-spark-02-serve")
    assert "--headless" in worker["argv"] and worker["spec"]["tenancy"]["replica"] == "big"
    assert f"--kv-cache-memory-bytes={plans['big']['kvCache']['pinnedBytes']}" in worker["argv"]
    assert "tenancy" not in handover(run, "big-serve")["spec"]  # spark-01 is big's alone


def test_adding_a_neighbour_to_a_replica_alone_on_its_node_pins_its_kv_cache_and_restarts_only_its_vllm():
    before = fleet()
    before["deployments"] = [d for d in before["deployments"] if d["name"] != "small"]  # coder alone on spark-03
    after = copy.deepcopy(before)
    after["deployments"].append({"name": "small", "model": "/models/Qwen3-0.6B", "nodes": ["spark-03"],
                                 "maxModelLen": 8192, "vllm": {"port": 8001, "gpuMemoryUtilization": 0.15}})  # fmt: skip
    result = changes(before, after)
    assert result.get("coder-serve") == {"stdin"}  # its settings: pinned, and its turn; no container
    assert not [name for name in result if name.startswith("big")]
    assert "coder-spark-03-container" not in result


def test_with_the_guard_vllm_router_waits_for_the_rules_in_this_boot(run):
    """Its metrics port is fenced (#58): its keeper starts behind guard_gate.sh; without the guard, as it was."""
    router = by_name(run, "spark-vllm-router").inputs
    plain = by_name(run_fleet(fleet(network={"guard": False})), "spark-vllm-router").inputs
    assert router["entrypoints"][3:5] == ["guard_gate", "/run/spark-vllm-guard/applied.json"]
    assert router["entrypoints"][5:] == plain["entrypoints"] and plain["entrypoints"][0] == "python3"
    assert {"type": "volume", "source": "spark-vllm-guard", "target": "/run/spark-vllm-guard", "readOnly": True} in (
        router["mounts"]
    )
