"""Config rules: each bad input and the exact problem it must report."""

import copy

import pytest

from components.config import ConfigError, load_cluster_config
from tests.keys import openssh_private_key

BASE = {
    "nodes": [
        {"name": "spark-01", "host": "10.0.0.1", "fabricAddress": "10.9.0.1", "fabricInterface": "enp1s0f1np1"},
        {"name": "spark-02", "host": "10.0.0.2", "fabricAddress": "10.9.0.2", "fabricInterface": "enp1s0f1np1"},
    ],
    "image": "vllm/vllm-openai:v0.33.0",
    "model": "/models/Qwen3-0.6B",
    "tensorParallelSize": 2,
    # named: with executor auto the stock image would run mp (tests/unit/test_config_inputs.py covers auto)
    "executor": "ray",
    "vllm": {"allowUnauthenticated": True},
}


def config(**changes):
    raw = copy.deepcopy(BASE)
    for path, value in changes.items():
        target = raw
        keys = path.split("__")
        for key in keys[:-1]:
            target = target[int(key)] if key.isdigit() else target.setdefault(key, {})
        last = keys[-1]
        if value is DELETE:
            del target[last]
        elif last.isdigit():
            target[int(last)] = value
        else:
            target[last] = value
    return raw


DELETE = object()


def problems_of(raw):
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw)
    return caught.value.problems


def test_the_base_config_is_valid_and_fills_defaults():
    cfg = load_cluster_config(config())
    assert cfg.head_node.name == "spark-01"
    assert [w.name for w in cfg.workers] == ["spark-02"]
    assert cfg.nodes[0].user == "root" and cfg.nodes[0].ssh_port == 22 and cfg.nodes[0].gpus == 1
    assert cfg.vllm.port == 8000 and cfg.vllm.gpu_memory_utilization == 0.9
    assert cfg.ray.port == 6379 and cfg.ray.join_timeout_seconds == 300
    assert cfg.vllm.ready_timeout_seconds == 1800
    assert cfg.served_model_name == "/models/Qwen3-0.6B"


def test_copies_come_from_the_head_unless_a_source_is_named():
    cfg = load_cluster_config(config(imageTransfer__method="copy"))
    assert cfg.copy_source.name == "spark-01" and cfg.uses_depot and not load_cluster_config(config()).uses_depot
    cfg = load_cluster_config(config(modelSync__enabled="true", fabricCopy__source="spark-02"))
    assert cfg.copy_source.name == "spark-02" and cfg.uses_depot and cfg.fabric_copy.port == 29650
    # the same port is fine while nothing is copied
    assert load_cluster_config(config(fabricCopy__port=8000)).fabric_copy.port == 8000


def test_pulumi_string_values_are_coerced():
    cfg = load_cluster_config(config(tensorParallelSize="2", maxModelLen="32768", smokeTest="false"))
    assert cfg.tensor_parallel_size == 2 and cfg.max_model_len == 32768 and cfg.smoke_test is False


BAD = [
    (config(nodes=[]), "nodes: [] — List should have at least 1 item after validation, not 0"),
    (config(nodes__1__name="spark-01"), "nodes[1].name: 'spark-01' — a unique name (nodes[0] has it)"),
    (config(nodes__1__name="Spark_02"), "nodes[1].name: 'Spark_02' — expected a DNS label"),
    (
        config(nodes__1__fabricAddress="10.9.0.1"),
        "nodes[1].fabricAddress: '10.9.0.1' — a unique address (nodes[0] has it)",
    ),
    (
        config(nodes__1__fabricAddress="10.9.0.300"),
        "nodes[1].fabricAddress: '10.9.0.300' — Input is not a valid IPv4 address",
    ),
    (
        config(nodes__0__fabricInterface="eth0;reboot"),
        "nodes[0].fabricInterface: 'eth0;reboot' — expected a network interface name",
    ),
    (
        config(nodes__0__fabricInterface="averyveryverylongname"),
        "nodes[0].fabricInterface: 'averyveryverylongname' — expected a network interface name",
    ),
    (config(nodes__0__host="$(reboot)"), "nodes[0].host: '$(reboot)' — expected a host name or IPv4 address"),
    (config(nodes__0__user="root\nx"), "nodes[0].user: 'root\\nx' — expected a user name"),
    (config(nodes__0__sshPort=0), "nodes[0].sshPort: 0 — Input should be greater than or equal to 1"),
    (config(nodes__0__sshPort=70000), "nodes[0].sshPort: 70000 — Input should be less than or equal to 65535"),
    (
        config(nodes__0__rdmaDevices=["rocep1s0f1", "x y"]),
        "nodes[0].rdmaDevices[1]: 'x y' — expected an RDMA device name",
    ),
    (config(nodes__0__gpus=0), "nodes[0].gpus: 0 — Input should be greater than or equal to 1"),
    (
        config(nodes__0__fabricAdress="10.9.0.1"),
        "nodes[0].fabricAdress: '10.9.0.1' — no such key: did you mean 'fabricAddress'?",
    ),
    (config(nodes__1__sshUser="aurora"), "nodes[1].sshUser: 'aurora' — no such key: did you mean 'user'?"),
    (
        config(vllm__maxModelLen=4096),
        "vllm.maxModelLen: 4096 — no such key here: 'maxModelLen' belongs at the top level",
    ),
    (config(gpus=2), "gpus: 2 — no such key here: 'gpus' belongs at nodes[].gpus"),
    (config(vllm__stallSeconds=10), "vllm.stallSeconds: 10 — Input should be greater than or equal to 30"),
    (config(vllm__canarySeconds=-1), "vllm.canarySeconds: -1 — Input should be greater than or equal to 0"),
    (config(vllm__stallSeconds="soon"), "vllm.stallSeconds: 'soon' — Input should be a valid integer"),
    (
        config(container__shmSizeMb=256),
        "container.shmSizeMb: 256 — no longer a key: Docker ignores a shared-memory size when the container shares",
    ),
    (config(nodes__0__wat=1), "nodes[0].wat: 1 — no such key (known here: name, host, user, sshPort, fabricAddress, "),
    (
        config(nodes__0__hostKey="ssh-ed25519 AAAA; rm -rf /"),
        "nodes[0].hostKey: 'ssh-ed25519 AAAA; rm -rf /' — expected a public host key line",
    ),
    (
        config(nodes__0__hostKey="ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ"),
        "nodes[0].hostKey: 'ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ' — an ed25519 (or ecdsa) key: an ssh-rsa host key "
        "makes the remote commands offer SHA-1 RSA, which OpenSSH 8.8 and later refuse (get the ed25519 one: "
        "`ssh-keyscan -t ed25519 HOST`)",
    ),
    (config(executor="slurm"), "executor: 'slurm' — Input should be 'auto', 'ray' or 'mp'"),
    (
        config(executor="mp", nodes__0__gpus=2, tensorParallelSize=3),
        "nodes[].gpus: 'spark-01: 2, spark-02: 1' — the same number on every node with executor mp",
    ),
    (
        config(executor="mp", vllm__masterPort=8000),
        "vllm.masterPort: 8000 — a port nothing else on node spark-01 listens on: vllm.port 8000 (the endpoint's edge) "
        "and vllm.masterPort 8000 (vLLM rank 0 with executor mp) collide",
    ),
    (
        config(ray__port=8000),
        "ray.port: 8000 — a port nothing else on node spark-01 listens on: vllm.port 8000 (the endpoint's edge) and "
        "ray.port 8000 (Ray GCS) collide (ports in use there: nodes[0].sshPort 22 (sshd, never touched); vllm.port",
    ),
    (
        config(vllm__port=6379),
        "vllm.port: 6379 — a port nothing else on node spark-01 listens on: vllm.port 6379 (the endpoint's edge) and "
        "ray.port 6379 (Ray GCS) collide",
    ),
    (
        config(vllm__port=12000),
        "vllm.port: 12000 — a port nothing else on node spark-01 listens on: vllm.port 12000 (the endpoint's edge) and "
        "ray.minWorkerPort-maxWorkerPort 10002-19999 (Ray worker processes) collide",
    ),
    (
        config(ray__dashboardPort=2222, nodes__0__sshPort=2222),
        "ray.dashboardPort: 2222 — a port nothing else on node spark-01 listens on: nodes[0].sshPort 2222 (sshd, "
        "never touched) and ray.dashboardPort 2222 (Ray dashboard) collide",
    ),
    (
        config(vllm__port=40000),
        "vllm.port: 40000 — a port nothing else on node spark-01 listens on: vllm.port 40000 (the endpoint's edge) and "
        "the kernel's ephemeral range 32768-60999 (Ray's raylet, object manager and agents, NCCL, Gloo) collide",
    ),
    (
        config(ray__minWorkerPort=20000, ray__maxWorkerPort=19000),
        "ray.maxWorkerPort: 19000 — at least ray.minWorkerPort (20000)",
    ),
    (
        config(nodes__0__host="spark-01.lan", nodes__1__host="SPARK-01.LAN"),
        "nodes[1].host: 'SPARK-01.LAN' — a machine no other node has: nodes[0] (spark-01) is SPARK-01.LAN port 22 too, "
        "and two Ray nodes on one machine claim the same GPU and ports (a machine with several GPUs is one node "
        "with gpus: N)",
    ),
    (
        config(recovery__backoffSeconds=30, recovery__maxBackoffSeconds=10),
        "recovery.maxBackoffSeconds: 10 — at least recovery.backoffSeconds (30)",
    ),
    (config(imageTransfer__method="scp"), "imageTransfer.method: 'scp' — Input should be 'pull' or 'copy'"),
    (config(fabric__peerWaitSeconds=0), "fabric.peerWaitSeconds: 0 — Input should be greater than or equal to 1"),
    (
        config(fabricCopy__source="spark-09"),
        "fabricCopy.source: 'spark-09' — one of the node names ['spark-01', 'spark-02']",
    ),
    (
        config(imageTransfer__method="copy", fabricCopy__port=8000),
        "fabricCopy.port: 8000 — a port nothing else on node spark-01 listens on: vllm.port 8000 (the endpoint's edge) "
        "and fabricCopy.port 8000 (fabric copy depot) collide",
    ),
    (
        config(modelSync__enabled=True, model="Qwen/Qwen3-0.6B"),
        "container.hfCacheDir: None — a host directory, because modelSync copies model 'Qwen/Qwen3-0.6B', a Hugging "
        "Face repo id: the copy source downloads it there once",
    ),
    (
        config(container__hfEndpoint="http://mirror.lan/$(reboot)"),
        "container.hfEndpoint: 'http://mirror.lan/$(reboot)' — expected an http(s) URL",
    ),
    (config(modelSync__timeoutSeconds=0), "modelSync.timeoutSeconds: 0 — Input should be greater than or equal to 1"),
    (config(recovery__maxRestarts=0), "recovery.maxRestarts: 0 — Input should be greater than or equal to 1"),
    (config(recovery__backoffSeconds=-1), "recovery.backoffSeconds: -1 — Input should be greater than or equal to 1"),
    (
        config(executor="mp", vllm__extraArgs=["--headless"]),
        "vllm.extraArgs[0]: '--headless' — a flag the program does not set itself",
    ),
    (config(head="spark-09"), "head: 'spark-09' — one of the node names ['spark-01', 'spark-02']"),
    (
        config(tensorParallelSize=4),
        "tensorParallelSize × pipelineParallelSize: '4 × 1 = 4' — the GPUs of the listed nodes (2): or use TP 1 × PP 2 or TP 2 × PP 1",
    ),
    (
        config(tensorParallelSize=1),
        "tensorParallelSize × pipelineParallelSize: '1 × 1 = 1' — the GPUs of the listed nodes (2): drop nodes ['spark-02']; or use TP 1 × PP 2 or TP 2 × PP 1",
    ),
    (config(tensorParallelSize=0), "tensorParallelSize: 0 — Input should be greater than or equal to 1"),
    (config(maxModelLen=0), "maxModelLen: 0 — Input should be greater than or equal to 1"),
    (config(vllm__gpuMemoryUtilization=0), "vllm.gpuMemoryUtilization: 0 — Input should be greater than 0"),
    (
        config(vllm__gpuMemoryUtilization=1.2),
        "vllm.gpuMemoryUtilization: 1.2 — Input should be less than or equal to 1",
    ),
    (config(vllm__port=0), "vllm.port: 0 — Input should be greater than or equal to 1"),
    (config(ray__port=65536), "ray.port: 65536 — Input should be less than or equal to 65535"),
    (
        config(vllm__enableAutoToolChoice=True),
        "vllm.toolCallParser: None — a parser (e.g. qwen3_coder) because enableAutoToolChoice is true",
    ),
    (
        config(vllm__extraArgs=["--api-key", "x"]),
        "vllm.extraArgs[0]: '--api-key' — no secret in extraArgs, where it sits in plain text in the stack file",
    ),
    (
        config(vllm__extraArgs=["--max-model-len=9"]),
        "vllm.extraArgs[0]: '--max-model-len=9' — a flag the program does not set itself",
    ),
    (
        config(vllm__extraArgs=["--x\nrm -rf /"]),
        "vllm.extraArgs[0]: '--x\\nrm -rf /' — expected a non-empty argument without control characters",
    ),
    (
        config(vllm__allowUnauthenticated=False),
        "apiKey: None — a secret (`pulumi config set --secret apiKey …`, or apiKeys per client) because the endpoint "
        "listens on 0.0.0.0",
    ),
    (config(image=DELETE), "image: None — a value (or promoteFrom: a stack whose release to deploy)"),
    (config(image="Vllm/Bad Image"), "image: 'Vllm/Bad Image' — expected an image reference"),
    (
        config(model="models/../$(x)"),
        "model: 'models/../$(x)' — expected an absolute path (/models/Name) or a Hugging Face repo id",
    ),
    (
        config(promoteFrom="organization/spark-vllm/staging"),
        "image: 'vllm/vllm-openai:v0.33.0' — no value: promoteFrom 'organization/spark-vllm/staging' decides it",
    ),
    (
        config(security={"requireHostKeys": True}),
        "nodes[0].hostKey: None — the node's public host key, because security.requireHostKeys is true",
    ),
    (config(nccl={"debug": "LOUD"}), "nccl.debug: 'LOUD' — Input should be 'VERSION', 'WARN', 'INFO' or 'TRACE'"),
    (config(network={"mtu": 100}), "network.mtu: 100 — Input should be greater than or equal to 576"),
    (config(modle="/models/x"), "modle: '/models/x' — no such key: did you mean 'model'?"),
    (
        config(edge={"maxConnections": 100, "perSourceConnections": 101}),
        "edge.perSourceConnections: 101 — at most edge.maxConnections (100): one address could hold every connection",
    ),
    (config(edge={"keylessPerSource": 0}), "edge.keylessPerSource: 0 — Input should be greater than or equal to 1"),
    (config(edge={"drainSeconds": 0}), "edge.drainSeconds: 0 — Input should be greater than or equal to 1"),
]


@pytest.mark.parametrize(("raw", "expected"), BAD, ids=[e.split(":")[0] + "-" + str(i) for i, (_, e) in enumerate(BAD)])
def test_each_bad_value_is_reported_with_path_value_and_expectation(raw, expected):
    problems = problems_of(raw)
    assert any(p.startswith(expected) for p in problems), problems


def test_the_same_host_on_another_ssh_port_is_another_machine():
    load_cluster_config(config(nodes__1__host="10.0.0.1", nodes__1__sshPort=2222))  # e.g. a port forward each


@pytest.mark.parametrize("key", ["apiKey", "hfToken", "sshPrivateKey"])
def test_a_secret_set_in_plain_text_is_refused_with_the_command_that_fixes_it(key):
    value = "sk-do-not-print-" + key
    problems = problems_of_plain(config(**{key: value}), {key})
    expected = (
        f"{key}: '[set in plain text]' — a Pulumi secret: as it is, the value sits readable in Pulumi.<stack>.yaml, "
        f"which gets committed; run `pulumi config rm {key}` then `pulumi config set --secret {key} "
    )
    assert [p for p in problems if p.startswith(expected)], problems
    assert value not in "\n".join(problems)


def test_the_same_secrets_set_with_secret_pass():
    keys = {"apiKey": "sk-1-0123456789ab", "hfToken": "hf_1", "sshPrivateKey": openssh_private_key("plain")}
    load_cluster_config(config(**keys), plain={"image", "model", "nodes"})


def test_a_plain_secret_is_listed_with_every_other_problem():
    problems = problems_of_plain(config(apiKey="sk-1-0123456789ab", vllm__port=0, nodes__0__gpus=0), {"apiKey"})
    assert [p.split(":")[0] for p in problems] == ["nodes[0].gpus", "vllm.port", "apiKey"]


def problems_of_plain(raw, plain):
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw, plain=plain)
    return caught.value.problems


def test_every_problem_is_listed_in_one_error():
    raw = config(nodes__0__sshPort=0, nodes__1__fabricAddress="nope", vllm__port=99999, modle="x")
    error = pytest.raises(ConfigError, load_cluster_config, raw).value
    assert len(error.problems) == 4
    text = str(error)
    assert text.startswith("spark-vllm: the stack config has 4 problem(s):")
    for path in ("nodes[0].sshPort", "nodes[1].fabricAddress", "vllm.port", "modle"):
        assert f"  - {path}: " in text


def test_cross_field_problems_are_listed_together():
    raw = config(head="nope", tensorParallelSize=3, nodes__1__fabricAddress="10.9.0.1")
    problems = problems_of(raw)
    assert [p.split(":")[0] for p in problems] == [
        "nodes[1].fabricAddress",
        "head",
        "tensorParallelSize × pipelineParallelSize",
    ]


def test_secrets_never_appear_in_errors():
    raw = config(apiKey={"not": "a string"}, hfToken="hf_abcdefSECRET", nodes__0__sshPort=0)
    error = pytest.raises(ConfigError, load_cluster_config, raw).value
    assert "hf_abcdefSECRET" not in str(error)
    assert "apiKey: '[secret]'" in str(error)


def test_head_can_be_any_node_and_workers_are_the_rest():
    cfg = load_cluster_config(config(head="spark-02"))
    assert cfg.head_node.name == "spark-02" and [w.name for w in cfg.workers] == ["spark-01"]


def test_loopback_bind_needs_no_api_key():
    cfg = load_cluster_config(config(vllm={"host": "127.0.0.1"}))
    assert str(cfg.vllm.host) == "127.0.0.1"


def test_promote_from_replaces_image_and_model():
    cfg = load_cluster_config(config(image=DELETE, model=DELETE, promoteFrom="organization/spark-vllm/staging"))
    assert cfg.promote_from == "organization/spark-vllm/staging" and cfg.image is None


def test_field_errors_and_cross_field_rules_are_reported_together():
    raw = config(tensorParallelSize=3, nodes__1__fabricInterface="fab0;reboot", nodes__0__name="spark-02", head="x")
    problems = problems_of(raw)
    paths = [p.split(":")[0] for p in problems]
    assert paths == ["nodes[1].fabricInterface", "nodes[1].name", "head", "tensorParallelSize × pipelineParallelSize"]


def test_an_invalid_node_name_does_not_hide_the_head_and_parallelism_problems():
    raw = config(nodes__0__name="Spark_01", head="spark-09", tensorParallelSize=1)
    problems = problems_of(raw)
    assert [p.split(":")[0] for p in problems] == ["nodes[0].name", "head", "tensorParallelSize × pipelineParallelSize"]
    assert "one of the node names ['spark-02']" in problems[1]
    assert "drop nodes ['spark-02']" in problems[2]


def test_a_head_naming_an_invalid_node_is_left_to_that_nodes_message():
    problems = problems_of(config(nodes__1__name="Spark_02", head="Spark_02"))
    assert [p.split(":")[0] for p in problems] == ["nodes[1].name", "head"]
    assert "expected a DNS label" in problems[1]  # the head's own rule, not "one of the node names"


def test_an_empty_config_lists_what_is_missing():
    problems = problems_of({})
    assert [p.split(":")[0] for p in problems] == ["nodes", "image", "model", "apiKey"]
    assert problems[0] == "nodes: None — Field required"


def test_no_nodes_is_one_problem_not_a_parallelism_riddle():
    problems = problems_of(config(nodes=[]))
    assert [p.split(":")[0] for p in problems] == ["nodes"]
