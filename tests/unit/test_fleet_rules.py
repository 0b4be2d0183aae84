"""Several deployments: configs a user could write that would expose, misroute, collide or leak, each refused
before the first resource with its key named; and the layouts three Sparks allow, which must load."""

import copy

import pytest

from components.config import ConfigError, load_cluster_config
from components.config.replicas import replicas_of, stack_listeners
from components.plan.memory import GIB, ModelShape, NodeMemory, plan_memory
from components.resources.placement import together

NODES = [
    {"name": f"spark-0{i}", "host": f"10.0.0.{i}", "fabricAddress": f"10.9.0.{i}", "fabricInterface": "enp1s0f1np1"}
    for i in (1, 2, 3, 4)
]
KEY = "sk-fleet-rules-test-key-0123"


def fleet(*deployments, **top):
    raw = {"nodes": copy.deepcopy(NODES), "image": "vllm/vllm-openai:v0.25.0", "apiKey": KEY,
           "deployments": copy.deepcopy(list(deployments))}  # fmt: skip
    raw.update(copy.deepcopy(top))
    return raw


def dep(name, nodes, port=8000, share=0.3, **more):
    vllm = {"port": port, "gpuMemoryUtilization": share, **more.pop("vllm", {})}
    return {"name": name, "model": f"/models/{name}", "nodes": list(nodes), "vllm": vllm, **more}


BIG = dep("big", ["spark-01", "spark-02"], 30000, 0.6, tensorParallelSize=2)
SMALL = dep("small", ["spark-03"], 8001, 0.3)


def problems_of(raw):
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw)
    return caught.value.problems


def only(raw, key):
    """The one problem under `key`, whatever else the config has."""
    found = [line for line in problems_of(raw) if line.startswith(f"{key}: ")]
    assert len(found) == 1, problems_of(raw)
    return found[0]


# --- layouts three (and four) Sparks allow -----------------------------------------------------------------

LAYOUTS = {
    # a small model beside the worker half of a TP=2 model: listeners are the node's, not a place in a replica
    "beside a worker half": [BIG, dep("small", ["spark-02"], 8001, 0.3)],
    "beside both halves": [BIG, dep("a", ["spark-01"], 8001, 0.2), dep("b", ["spark-02"], 8001, 0.2)],
    "two TP=2 over the same pair, heads apart": [
        dep("big", ["spark-01", "spark-02"], 30000, 0.45, tensorParallelSize=2),
        dep("other", ["spark-02", "spark-01"], 30001, 0.45, tensorParallelSize=2, vllm={"masterPort": 29600}),
    ],
    "replicas over three nodes beside a big one": [
        dep("big", ["spark-01", "spark-02"], 30000, 0.5, tensorParallelSize=2),
        dep("small", ["spark-01", "spark-02", "spark-03"], 8001, 0.3, replicas=3),
    ],
    "replicas sharing one node": [BIG, dep("small", ["spark-03"], 8001, 0.2, replicas=3)],
    "a node with only the router": [BIG, SMALL],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_a_user_writes_load(layout):
    router = {"node": "spark-04"} if layout == "a node with only the router" else {}
    cfg = load_cluster_config(fleet(*LAYOUTS[layout], router=router))
    assert replicas_of(cfg)


def test_a_node_shared_with_another_deployments_worker_lists_sshd_once_under_its_own_index():
    cfg = load_cluster_config(fleet(*LAYOUTS["beside a worker half"]))
    keys = [item.key for item in stack_listeners(cfg, 1)]
    assert keys.count("nodes[1].sshPort") == 1 and "nodes[0].sshPort" not in keys
    assert "deployments[1].vllm.port" in keys  # small's API server, beside big's worker rank


# --- every node's ports, the router's, Prometheus's and Grafana's alone on a node ------------------------------

PORT_CLASHES = [
    ({"router": {"node": "spark-04", "port": 9090}, "metrics": {"prometheusNode": "spark-04"}}, "router.port", 9090),
    ({"router": {"node": "spark-04", "port": 9100, "metricsPort": 9100}}, "router.metricsPort", 9100),
    (
        {
            "router": {"node": "spark-04", "port": 3000},
            "grafanaAdminPassword": "a-long-grafana-password",
            "metrics": {"prometheusNode": "spark-04", "grafanaNode": "spark-04"},
        },
        "router.port",
        3000,
    ),
    ({"router": {"node": "spark-04", "port": 22}}, "router.port", 22),
    ({"metrics": {"prometheusNode": "spark-04", "prometheusPort": 22}}, "metrics.prometheusPort", 22),
]


@pytest.mark.parametrize(("top", "key", "port"), PORT_CLASHES)
def test_ports_are_checked_on_a_node_that_runs_no_replica(top, key, port):
    line = [p for p in problems_of(fleet(BIG, SMALL, **top)) if "collide" in p]
    assert line and any("node spark-04" in each and f" {port} " in each for each in line), line


def test_a_replicas_port_beyond_the_last_port_is_refused_with_the_highest_that_fits():
    line = only(fleet(BIG, dep("small", ["spark-03"], 65534, 0.2, replicas=3)), "deployments[1].vllm.port")
    assert "at most 65533" in line and "small-3 would take 65536" in line
    load_cluster_config(fleet(BIG, dep("small", ["spark-03"], 65533, 0.2, replicas=3)))
    load_cluster_config(fleet(BIG, dep("small", ["spark-03", "spark-04"], 65535, 0.2, replicas=2)))  # a node each


# --- the router: what it exposes, what it reaches ------------------------------------------------------------

LOOPBACK = {"host": "127.0.0.1"}


@pytest.mark.parametrize(
    "raw",
    [
        # every vLLM on loopback needs no key of its own; the router in front still serves the network
        fleet(dep("a", ["spark-01"], 8001, vllm=LOOPBACK), dep("b", ["spark-01"], 8002, vllm=LOOPBACK)),
        # every vLLM allowed to serve without a key, each on its own address: the router is another exposure
        fleet(*[dep(n, ["spark-01"], p, vllm={"allowUnauthenticated": True}) for n, p in (("a", 8001), ("b", 8002))]),
        # the fabric address is a network too
        fleet(
            dep("a", ["spark-01"], 8001, vllm=LOOPBACK),
            dep("b", ["spark-01"], 8002, vllm=LOOPBACK),
            router={"host": "fabric"},
        ),
    ],
    ids=["loopback vLLMs", "vLLMs allowed without a key", "router on the fabric"],
)
def test_a_router_beyond_loopback_without_the_api_key_is_refused(raw):
    del raw["apiKey"]
    line = only(raw, "apiKey")
    assert "the router serves every model behind it" in line and "router.allowUnauthenticated" in line
    raw["router"] = {**raw.get("router", {}), "allowUnauthenticated": True}
    load_cluster_config(raw)


def test_several_replicas_without_the_router_are_refused():
    """No vLLM listens on the network by itself: the edge's one upstream is the router in front of them."""
    raw = fleet(dep("a", ["spark-01"], 8001), dep("b", ["spark-01"], 8002), router={"enabled": False})
    assert "on (its default here) with 2 replicas" in only(raw, "router.enabled")
    one = fleet(dep("a", ["spark-01"], 8001, replicas=2), router={"enabled": False})
    assert "with 2 replicas" in only(one, "router.enabled")
    load_cluster_config(fleet(dep("a", ["spark-01"], 8001), router={"enabled": False}))


def test_a_replica_on_loopback_of_another_node_than_the_routers_is_refused():
    raw = fleet(BIG, dep("small", ["spark-03"], 8001, vllm=LOOPBACK))
    line = only(raw, "deployments[1].vllm.host")
    assert "'127.0.0.1'" in line and "router.node spark-01 reaches" in line and "node spark-03" in line
    load_cluster_config(fleet(BIG, dep("small", ["spark-01"], 8001, vllm=LOOPBACK)))  # beside the router: fine


def test_one_replica_away_from_the_router_is_enough_to_refuse_a_loopback_deployment():
    raw = fleet(BIG, dep("small", ["spark-01", "spark-03"], 8001, 0.2, replicas=2, vllm=LOOPBACK))
    assert "node spark-03" in only(raw, "deployments[1].vllm.host")


def test_api_sources_limit_the_edge_and_never_fence_the_router_out_of_a_replica():
    """A replica's vLLM listens on its head's fabric address, which the guard opens to every node's fabric
    address: the clients' network in apiSources is the edge's matter alone."""
    cfg = load_cluster_config(fleet(BIG, SMALL, network={"guard": True, "apiSources": ["10.0.0.0/24"]}))
    from components.resources.guard import guard_spec

    small_head = next(node for node in cfg.nodes if node.name == "spark-03")
    spec = guard_spec(cfg, small_head)
    assert [8001, 8001] in spec.guarded and 8001 not in spec.public and spec.api is None
    assert "10.9.0.1" in spec.peers  # the router's node


# --- what the router routes by -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("second", "key"),
    [
        (dep("copy", ["spark-03"], 8001, model="/models/big"), "deployments[1].model"),
        (dep("copy", ["spark-03"], 8001, vllm={"servedModelName": "big-model"}), "deployments[1].vllm.servedModelName"),
        (
            dep("copy", ["spark-03"], 8001, vllm={"servedModelName": "Qwen/Qwen3-8B"}),
            "deployments[1].vllm.servedModelName",
        ),
    ],
    ids=["same model", "same served name", "a served name that is another's model"],
)
def test_two_deployments_serving_one_name_are_refused(second, key):
    first = copy.deepcopy(BIG)
    if "big-model" in str(second):
        first["vllm"]["servedModelName"] = "big-model"
    if "Qwen/" in str(second):
        first["model"] = "Qwen/Qwen3-8B"  # a repo id: served under that name
    line = only(fleet(first, second), key)
    assert "deployments[0] serves" in line and "servedModelName" in line


# --- names ---------------------------------------------------------------------------------------------------


def test_names_that_spell_the_same_once_joined_with_a_node_are_refused():
    nodes = copy.deepcopy(NODES)
    nodes[0]["name"], nodes[1]["name"] = "big-spark", "spark"
    raw = fleet(dep("qwen", ["big-spark"], 8001), dep("qwen-big", ["spark"], 8002), nodes=nodes)
    line = only(raw, "deployments[1].name")
    assert "qwen-big-spark" in line and "deployments[0]" in line


def test_a_replicas_joined_name_is_checked_too():
    nodes = copy.deepcopy(NODES)
    nodes[2]["name"], nodes[3]["name"] = "2-spark", "spark"
    # replica small on node 2-spark and replica small-2 on node spark: both small-2-spark
    raw = fleet(BIG, dep("small", ["2-spark", "spark"], 8001, replicas=2), nodes=nodes)
    line = only(raw, "deployments[1].name")
    assert "replica small-2 on node spark and replica small on node 2-spark" in line


@pytest.mark.parametrize("name", ["router", "spark-vllm", "spark-vllm-router", "router-1"])
def test_a_deployment_named_like_the_stacks_own_resources_is_refused(name):
    line = only(fleet(BIG, dep(name, ["spark-03"], 8001)), "deployments[1].name")
    assert "the stack's own resources" in line


# --- secrets never in a message ------------------------------------------------------------------------------

SECRET = "sk-leaked-0123456789abcdef"


@pytest.mark.parametrize(
    "vllm",
    [
        {"extraArgs": ["--api-key", SECRET]},
        {"extraArgs": ["--api-key=" + SECRET]},
        {"extraArgs": ["--api_key", SECRET]},
        {"extraArgs": ["--api-k", SECRET]},
        {"extraArgs": ["--enforce-eager", "--api-key " + SECRET]},
        {"extraArgs": ["--hf-token", SECRET], "port": 8000},
    ],
)
def test_a_leftover_top_level_vllm_with_a_secret_flag_is_named_without_its_value(vllm):
    raw = fleet(BIG, SMALL, vllm=vllm)
    problems = problems_of(raw)
    assert any(line.startswith("vllm: ") for line in problems)
    assert not any(SECRET in line for line in problems), problems


@pytest.mark.parametrize(
    "url",
    [
        f"https://user:{SECRET}@pypi.example/simple",
        f"https://{SECRET}@pypi.example/simple",
        f"http://__token__:{SECRET}@10.0.0.9:3141/root/pypi/+simple/",
    ],
)
def test_an_index_url_with_credentials_is_refused_without_showing_them(url):
    line = only(fleet(BIG, SMALL, router={"indexUrl": url}), "router.indexUrl")
    assert SECRET not in line and "[secret]@" in line and "without credentials" in line


def test_a_deployments_secret_flag_is_named_without_its_value_either():
    problems = problems_of(fleet(BIG, dep("small", ["spark-03"], 8001, vllm={"extraArgs": ["--api-key", SECRET]})))
    assert any(line.startswith("deployments[1].vllm.extraArgs[0]") for line in problems)
    assert not any(SECRET in line for line in problems)


# --- memory.osReserveGib beyond a node's memory --------------------------------------------------------------

SPARK_BYTES = int(119.2 * GIB)
SHAPE = ModelShape(layers=36, kv_layers=36, kv_heads=8, head_dim=128, dtype_bytes=2, max_position=40960)


def test_a_reserve_beyond_the_nodes_memory_is_named_not_blamed_on_max_model_len():
    nodes = [NodeMemory("spark-03", 1, SPARK_BYTES, unified=True)]
    plan = plan_memory(nodes, 16 * 10**9, SHAPE, 1, 1, 8192, 0.3, os_reserve_bytes=200 * GIB)
    (line,) = plan.problems
    assert line.startswith("spark-03: memory.osReserveGib 200 is the whole of its 119.2 GiB")
    assert plan.suggestions == ["memory.osReserveGib under 119.2 GiB (spark-03's memory)"]
    assert not any("maxModelLen" in way for way in plan.suggestions)


def test_replicas_sharing_a_node_are_refused_for_a_reserve_beyond_its_memory_by_that_key():
    cfg = load_cluster_config(fleet(BIG, SMALL, dep("other", ["spark-03"], 8002), memory={"osReserveGib": 130}))
    plans = {name: {"checked": True, "nodes": {"spark-03": {"memory_gib": 119.2, "budget_gib": 35.8,
                                                            "os_left_gib": 83.4}}} for name in ("small", "other")}  # fmt: skip
    (line,) = together(cfg, plans)[0]
    assert "memory.osReserveGib 130 is the whole of its 119.2 GiB" in line


# --- a pinned KV cache is the memory plan's ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["--kv-cache-memory-bytes", "17000000000"], ["--kv_cache_memory_bytes=17000000000"], ["--kv-cache-mem=1"]],
)
def test_a_replica_sharing_a_gpu_may_not_set_its_kv_cache_in_bytes_itself(args):
    shared = dep("small", ["spark-03"], 8001, 0.2, replicas=2, vllm={"extraArgs": args})
    line = only(fleet(BIG, shared), "deployments[1].vllm.extraArgs[0]")
    assert "shares a GPU with another replica" in line
    alone = dep("small", ["spark-03"], 8001, 0.2, vllm={"extraArgs": args})  # its GPU its own: its choice
    load_cluster_config(fleet(BIG, alone))
    load_cluster_config(fleet(BIG, dep("small", ["spark-03"], 8001, 0.2, vllm={"extraArgs": ["--kv-cache-metrics"]})))


# --- the router in front of a single-model stack ------------------------------------------------------------

SINGLE = {"nodes": copy.deepcopy(NODES[:2]), "image": "vllm/vllm-openai:v0.25.0", "model": "/models/m",
          "tensorParallelSize": 2, "router": {"enabled": True}}  # fmt: skip


def test_a_single_model_stacks_router_needs_the_key_and_must_reach_vllm_too():
    line = only({**copy.deepcopy(SINGLE), "vllm": {"host": "127.0.0.1"}}, "apiKey")
    assert "the router serves every model behind it" in line
    elsewhere = {**copy.deepcopy(SINGLE), "apiKey": KEY, "vllm": {"host": "127.0.0.1"}}
    elsewhere["router"]["node"] = "spark-02"
    assert "router.node spark-02 reaches" in only(elsewhere, "vllm.host")
    fenced = {**copy.deepcopy(SINGLE), "apiKey": KEY, "network": {"guard": True, "apiSources": ["10.0.0.0/24"]}}
    fenced["router"]["node"] = "spark-02"
    load_cluster_config(fenced)  # vLLM on the fabric: the guard lets the router's node in whatever apiSources say
    load_cluster_config({**copy.deepcopy(SINGLE), "apiKey": KEY})


def test_the_router_reaching_vllm_is_one_registered_rule_for_one_model_and_for_each_replica():
    """One rule judges it (rules.router_reaches_vllm, in the registry): on the single-model keys, and on a
    replica's view where router.node is one of its nodes but not its head, one line under deployments[i]."""
    from components.config import rules
    from components.config.runner import RULES

    assert rules.router_reaches_vllm in {each.check for each in RULES}
    worker = fleet(dep("big", ["spark-01", "spark-02"], 30000, 0.6, tensorParallelSize=2, vllm=LOOPBACK),
                   router={"enabled": True, "node": "spark-02"})  # fmt: skip
    line = only(worker, "deployments[0].vllm.host")
    assert "router.node spark-02 reaches" in line and "spark-01" in line
    # its keys read invalid elsewhere: the rule still runs, and the other problem is listed beside it
    broken = {**copy.deepcopy(SINGLE), "apiKey": KEY, "vllm": {"host": "127.0.0.1"}, "maxModelLen": "long"}
    broken["router"]["node"] = "spark-02"
    assert "router.node spark-02 reaches" in only(broken, "vllm.host")
    assert only(broken, "maxModelLen")


def test_the_deployment_rules_are_registered_and_judge_what_their_keys_allow():
    """Deployment rules sit in the rule registry with the keys they read: a deployment whose other fields fail
    their own rules is still judged on those keys (its served name here), and its own problem is listed too."""
    from components.config import deployment_rules
    from components.config.runner import RULES

    registered = {each.check for each in RULES}
    for name in ("names_unique", "nodes_known_and_divided", "replica_names_free", "replica_ports_fit",
                 "served_names_unique", "names_apart", "router_exposes_nothing", "router_reaches_replicas",
                 "prometheus_reaches_replicas", "pinned_kv_cache_is_the_plans", "fabric_tested_once",
                 "models_already_there"):  # fmt: skip
        assert getattr(deployment_rules, name) in registered, name
    small = dep("small", ["spark-03"], 8001, 0.3, vllm={"servedModelName": "small"})
    twin = dep("twin", ["spark-03"], 8002, 0.3, vllm={"servedModelName": "small", "host": "not-an-address"})
    problems = problems_of(fleet(BIG, small, twin))
    assert any(line.startswith("deployments[2].vllm.host: ") for line in problems), problems
    assert any(
        line.startswith("deployments[2].vllm.servedModelName: 'small'") and "deployments[1] serves 'small'" in line
        for line in problems
    ), problems
