"""Several models on one cluster: the `deployments` and `router` config, its rules, the replicas it
makes (components/config/replicas.py), and the check that replicas sharing a node fit there together
(components/resources/placement.py)."""

import copy

import pytest

from components.config import ConfigError, load_cluster_config
from components.config.deployments import node_groups
from components.config.replicas import replicas_of, stack_listeners
from components.resources.placement import together

NODES = [
    {"name": f"spark-0{i}", "host": f"10.0.0.{i}", "fabricAddress": f"10.9.0.{i}", "fabricInterface": "enp1s0f1np1"}
    for i in (1, 2, 3)
]
BIG = {
    "name": "big",
    "model": "/models/Qwen3.5-122B-A10B-FP8",
    "nodes": ["spark-01", "spark-02"],
    "tensorParallelSize": 2,
    "vllm": {"gpuMemoryUtilization": 0.85, "port": 30000},
}
CODER = {"name": "coder", "model": "/models/coder", "nodes": ["spark-03"], "vllm": {"gpuMemoryUtilization": 0.5}}
EMBED = {
    "name": "embed",
    "model": "/models/embed",
    "nodes": ["spark-03"],
    "vllm": {"gpuMemoryUtilization": 0.25, "port": 8001},
}
BASE = {
    "nodes": NODES,
    "image": "vllm/vllm-openai:v0.25.0",
    "apiKey": "sk-deployments-test-key-0123",
    "deployments": [BIG, CODER, EMBED],
}


def config(**top):
    raw = copy.deepcopy(BASE)
    raw.update(copy.deepcopy(top))
    return raw


def with_deployment(index, **changes):
    raw = config()
    raw["deployments"][index].update(copy.deepcopy(changes))
    return raw


def problems_of(raw):
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw)
    return caught.value.problems


def test_three_deployments_make_their_replicas_each_a_single_model_view():
    cfg = load_cluster_config(config())
    replicas = replicas_of(cfg)
    assert [(r.name, [n.name for n in r.config.nodes]) for r in replicas] == [
        ("big", ["spark-01", "spark-02"]),
        ("coder", ["spark-03"]),
        ("embed", ["spark-03"]),
    ]
    big = replicas[0].config
    assert big.head_node.name == "spark-01" and [w.name for w in big.workers] == ["spark-02"]
    assert big.tensor_parallel_size == 2 and big.vllm.port == 30000 and big.called() == "big"
    assert big.executor == "mp"  # the stock image: vLLM's own executor across the two nodes
    assert replicas[1].config.executor == "mp"  # one node: no Ray to start
    assert cfg.router.enabled is True and cfg.router.node == "spark-01"  # several deployments: the router on


def test_a_stack_without_deployments_is_one_replica_named_nothing_and_no_router():
    raw = {k: v for k, v in config().items() if k != "deployments"}
    cfg = load_cluster_config({**raw, "model": "/models/m", "tensorParallelSize": 3, "executor": "ray"})
    (only,) = replicas_of(cfg)
    assert only.name == "" and only.deployment is None and only.config is cfg
    assert cfg.router.enabled is False and cfg.router.node == "spark-01"


def test_replicas_split_the_nodes_or_share_one_node_on_ports_of_their_own():
    raw = config(
        deployments=[
            {**BIG, "nodes": ["spark-01", "spark-02"], "tensorParallelSize": 1, "replicas": 2},
            {**CODER, "replicas": 2, "vllm": {"gpuMemoryUtilization": 0.4, "port": 8000, "masterPort": 29600}},
        ]
    )
    cfg = load_cluster_config(raw)
    found = [(r.name, [n.name for n in r.config.nodes], r.config.vllm.port) for r in replicas_of(cfg)]
    assert found == [
        ("big", ["spark-01"], 30000),
        ("big-2", ["spark-02"], 30000),
        ("coder", ["spark-03"], 8000),
        ("coder-2", ["spark-03"], 8001),
    ]
    assert replicas_of(cfg)[3].config.vllm.master_port == 29601
    assert node_groups(["a", "b", "c", "d"], 2) == [["a", "b"], ["c", "d"]]


@pytest.mark.parametrize(
    "key, value",
    [
        ("model", "/models/x"),
        ("tensorParallelSize", 2),
        ("pipelineParallelSize", 2),
        ("maxModelLen", 4096),
        ("executor", "ray"),
        ("head", "spark-01"),
        ("vllm", {"port": 9000}),
        ("ray", {"port": 6380}),
    ],
)
def test_a_single_model_key_beside_deployments_is_refused_naming_it(key, value):
    (line,) = [p for p in problems_of(config(**{key: value})) if p.startswith(f"{key}:")]
    assert "no value beside deployments: each deployment sets its own" in line


def test_single_model_keys_at_their_defaults_are_as_good_as_absent():
    """Pulumi passes the defaults Pulumi.yaml declares (tensorParallelSize 1, executor auto, vllm {} …)."""
    defaults = {"tensorParallelSize": 1, "pipelineParallelSize": 1, "executor": "auto", "vllm": {}, "ray": {}}
    assert len(replicas_of(load_cluster_config(config(**defaults)))) == 3


def test_names_nodes_and_replicas_are_checked_together_in_one_message():
    raw = config()
    raw["deployments"][1]["name"] = "big"  # twice
    raw["deployments"][2]["nodes"] = ["spark-03", "spark-09", "spark-03"]
    raw["deployments"][0]["replicas"] = 3  # two nodes do not split in three
    problems = problems_of(raw)
    assert "deployments[1].name: 'big' — a unique name (deployments[0] has it)" in problems
    assert any(p.startswith("deployments[2].nodes:") and "['spark-09'] is not one" in p for p in problems)
    assert any(p.startswith("deployments[2].nodes:") and "each node once (['spark-03'] twice)" in p for p in problems)
    assert any(p.startswith("deployments[0].replicas: 3") and "divides its 2 nodes" in p for p in problems)


def test_a_deployment_named_as_another_ones_replica_is_refused():
    raw = config(deployments=[{**CODER, "replicas": 2}, {**EMBED, "name": "coder-2"}])
    assert any(p.startswith("deployments[1].name: 'coder-2'") and "names its replica 2 coder-2" in p
               for p in problems_of(raw))  # fmt: skip


@pytest.mark.parametrize(
    "changes, path, expected",
    [
        ({"tensorParallelSize": 4}, "deployments[0].tensorParallelSize × pipelineParallelSize", "the GPUs of the listed nodes (2)"),
        ({"vllm": {"extraArgs": ["--tensor_parallel", "2"]}}, "deployments[0].vllm.extraArgs[0]", "--tensor-parallel-size"),
        ({"vllm": {"enableAutoToolChoice": True}}, "deployments[0].vllm.toolCallParser", "enableAutoToolChoice is true"),
        ({"ray": {"minWorkerPort": 20000, "maxWorkerPort": 19000}}, "deployments[0].ray.maxWorkerPort", "at least ray.minWorkerPort"),
        ({"vllm": {"port": 22}}, "deployments[0].vllm.port", "nothing else on node spark-01 listens on"),
    ],
)  # fmt: skip
def test_every_single_model_rule_holds_for_each_deployment_under_its_own_path(changes, path, expected):
    problems = problems_of(with_deployment(0, **changes))
    assert any(p.startswith(f"{path}:") and expected in p for p in problems), problems


def test_a_public_bind_without_an_api_key_is_refused_once_for_the_stack():
    raw = config()
    del raw["apiKey"]
    (line,) = [p for p in problems_of(raw) if p.startswith("apiKey:")]
    assert "because the endpoint listens on 0.0.0.0" in line
    for index in range(3):  # or each deployment serves openly, said where it is said
        raw["deployments"][index]["vllm"]["allowUnauthenticated"] = True
    (line,) = problems_of(raw)  # and the router in front of them, which listens beyond loopback, too
    assert line.startswith("apiKey: None — a secret") and "router.allowUnauthenticated: true" in line
    raw["router"] = {"allowUnauthenticated": True}
    load_cluster_config(raw)


def test_deployments_sharing_a_node_need_their_own_ports_there():
    raw = with_deployment(2, vllm={"gpuMemoryUtilization": 0.25, "port": 8000})  # coder has 8000 on spark-03
    (line,) = [p for p in problems_of(raw) if "collide" in p]
    assert line.startswith("deployments[2].vllm.port: 8000 — a port nothing else on node spark-03 listens on")
    assert "deployments[1].vllm.port 8000 (vLLM API server of coder)" in line


def test_two_ray_heads_on_one_node_need_their_own_ray_ports():
    base = config(deployments=[{**BIG, "executor": "ray"}, {**CODER, "nodes": ["spark-01", "spark-02"],
                                                           "tensorParallelSize": 2, "executor": "ray"}])  # fmt: skip
    base["deployments"][0]["vllm"]["gpuMemoryUtilization"] = 0.45
    base["deployments"][1]["vllm"]["gpuMemoryUtilization"] = 0.45
    problems = problems_of(base)
    for key in ("ray.port", "ray.dashboardPort", "ray.minWorkerPort-maxWorkerPort"):
        assert any(p.startswith(f"deployments[1].{key}:") and "collide" in p for p in problems), key
    # their own ports: Ray's client port, which Ray fixes, still takes one Ray head a node
    fixed = copy.deepcopy(base)
    fixed["deployments"][1]["ray"] = {"port": 6380, "dashboardPort": 8266, "minWorkerPort": 20002,
                                      "maxWorkerPort": 24999}  # fmt: skip
    (left,) = problems_of(fixed)
    assert left.startswith("deployments[1].executor: 'ray' — one Ray head on node spark-01")
    assert "run one of them with executor mp" in left
    fixed["deployments"][1]["executor"] = "mp"
    load_cluster_config(fixed)


def test_the_router_port_must_not_collide_with_a_deployment_on_its_node():
    raw = config(router={"port": 30000})  # big's vLLM on spark-01
    assert any(
        p.startswith("router.port: 30000") and "vllm.port 30000 (vLLM API server)" in p for p in problems_of(raw)
    )


def test_deployments_whose_memory_fractions_exceed_a_shared_node_are_refused_with_both_budgets():
    raw = with_deployment(2, vllm={"gpuMemoryUtilization": 0.6, "port": 8001})  # coder 0.5 + embed 0.6
    (line,) = [p for p in problems_of(raw) if "budgets that fit node spark-03" in p]
    assert line.startswith("deployments[2].vllm.gpuMemoryUtilization: 0.6")
    assert "coder 0.5 (deployments[1].vllm.gpuMemoryUtilization) + embed 0.6 (deployments[2]" in line
    assert "= 1.1 of its GPU memory" in line


def test_model_sync_and_the_nccl_test_are_refused_with_deployments():
    assert any(p.startswith("modelSync.enabled: True") for p in problems_of(config(modelSync={"enabled": True})))
    assert any(
        p.startswith("fabric.bandwidthTest: 'nccl'") for p in problems_of(config(fabric={"bandwidthTest": "nccl"}))
    )


def test_the_router_node_must_be_a_node():
    assert "router.node: 'spark-09' — one of the node names ['spark-01', 'spark-02', 'spark-03']" in problems_of(
        config(router={"node": "spark-09"})
    )


def test_a_prometheus_on_a_node_of_no_replica_must_reach_each_head():
    fenced = config(metrics={"prometheusNode": "spark-03"}, network={"guard": True, "apiSources": ["10.0.0.0/24"]})
    load_cluster_config(fenced)  # the guard lets every node's fabric address reach vLLM: apiSources are the edge's
    raw = config(metrics={"prometheusNode": "spark-03"})
    raw["deployments"][0]["vllm"]["host"] = "127.0.0.1"
    assert any(p.startswith("deployments[0].vllm.host:") and "spark-03" in p for p in problems_of(raw))


def test_problems_of_deployments_are_listed_with_every_other_problem():
    raw = with_deployment(0, tensorParallelSize=3)
    raw["nodes"][2]["sshPort"] = 0
    raw["model"] = "/models/x"
    paths = [p.split(":")[0] for p in problems_of(raw)]
    assert "nodes[2].sshPort" in paths and "model" in paths
    assert "deployments[0].tensorParallelSize × pipelineParallelSize" in paths


def test_the_guard_fences_every_replicas_ports_on_a_node_and_leaves_the_api_ports_public():
    cfg = load_cluster_config(config(network={"guard": True}))
    keys = [item.key for item in stack_listeners(cfg, 2)]  # spark-03: coder and embed
    assert "deployments[1].vllm.port" in keys and "deployments[2].vllm.port" in keys
    keys = [item.key for item in stack_listeners(cfg, 0)]  # spark-01: big's head, the router
    assert {"deployments[0].vllm.port", "deployments[0].vllm.masterPort", "router.port", "router.metricsPort"} <= set(
        keys
    )


def plan(node, budget, memory=119.21, unified=True):
    figures = {"memory_gib": memory, "budget_gib": budget, "os_left_gib": memory - budget if unified else None}
    return {"checked": True, "nodes": {node: figures}}


def test_replicas_sharing_a_node_fit_within_its_memory_less_the_os_reserve_on_unified_memory():
    cfg = load_cluster_config(config())
    problems, figures = together(cfg, {"coder": plan("spark-03", 59.6), "embed": plan("spark-03", 29.8)})
    assert problems == [] and figures["spark-03"]["budgetsGib"] == 89.4
    problems, _ = together(cfg, {"coder": plan("spark-03", 59.6), "embed": plan("spark-03", 53.64)})
    (line,) = problems
    assert line.startswith("node spark-03: coder 59.6 GiB + embed 53.64 GiB = 113.24 GiB, more than its 119.21 GiB")
    assert "less the OS's reserve of 8 GiB (memory.osReserveGib)" in line
    # discrete GPUs: no reserve taken from the GPU's memory
    problems, _ = together(cfg, {"a": plan("n", 40, 80, False), "b": plan("n", 39, 80, False)})
    assert problems == []
    # a plan that was not made (memoryCheck off, a repo id) is not judged
    assert together(cfg, {"a": {"checked": False}, "b": plan("n", 90, 80, False)}) == ([], {})
