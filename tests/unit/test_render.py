"""Renderers: golden argv and env, and hostile values that must stay single quoted words."""

import json
import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from components.config import load_cluster_config, node_listeners
from components.plan import container, programs, serving, shell
from tests.harness import ROOT
from tests.unit.test_config import config


@pytest.fixture
def cfg():
    return load_cluster_config(
        config(
            nodes__0__rdmaDevices=["rocep1s0f1", "roceP2p1s0f1"],
            maxModelLen=32768,
            vllm={
                "port": 30000,
                "trustRemoteCode": True,
                "reasoningParser": "qwen3",
                "toolCallParser": "qwen3_coder",
                "enableAutoToolChoice": True,
                "extraArgs": ["--max-num-seqs", "8"],
                "allowUnauthenticated": True,
            },
            nccl={"debug": "INFO"},
        )
    )


def test_serve_argv_golden(cfg):
    assert serving.serve_argv(cfg, cfg.model) == [
        "vllm", "serve", "/models/Qwen3-0.6B",
        "--tensor-parallel-size=2", "--pipeline-parallel-size=1",
        "--distributed-executor-backend=ray",
        "--max-model-len=32768",
        "--gpu-memory-utilization=0.9", "--host=10.9.0.1", "--port=29002",  # behind the edge, on the fabric
        "--served-model-name=/models/Qwen3-0.6B",
        "--enable-server-load-tracking",
        "--trust-remote-code", "--reasoning-parser=qwen3", "--tool-call-parser=qwen3_coder",
        "--enable-auto-tool-choice",
        "--max-num-seqs", "8",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "vllm,router,expected",
    [
        ({}, False, ("10.9.0.1", 29002)),  # the edge takes vllm.port on every address; vLLM the fabric
        ({"host": "127.0.0.1"}, False, ("127.0.0.1", 29002)),  # an endpoint on loopback: vLLM there too
        ({"host": "10.9.0.1", "port": 9000}, False, ("10.9.0.1", 29002)),
        ({}, True, ("10.9.0.1", 30000)),  # behind the router: vllm.port, on the fabric only
        ({"host": "127.0.0.1"}, True, ("127.0.0.1", 30000)),
    ],
)
def test_vllm_never_listens_on_every_address(cfg, vllm, router, expected):
    raw = config(vllm={"port": 30000, "allowUnauthenticated": True, **vllm})
    if router:
        raw["router"] = {"enabled": True, "allowUnauthenticated": True}
    argv = serving.serve_argv(load_cluster_config(raw), "org/model")
    assert (f"--host={expected[0]}", f"--port={expected[1]}") == tuple(
        a for a in argv if a.startswith(("--host", "--port"))
    )


def test_single_node_serve_names_its_executor_and_has_no_optional_flags():
    one = config(nodes=[config()["nodes"][0]], tensorParallelSize=1)
    argv = serving.serve_argv(load_cluster_config(one), "org/model")
    # vLLM would otherwise run its uniprocessor executor beside an unused Ray
    assert "--distributed-executor-backend=ray" in argv
    mp = serving.serve_argv(load_cluster_config({**one, "executor": "mp"}), "org/model")
    assert not any(a.startswith(("--distributed-executor-backend", "--nnodes", "--headless")) for a in mp)
    optional = ("--max-model-len", "--trust", "--reasoning", "--tool", "--enable-auto", "--max-num-seqs")
    assert not any(a.startswith(optional) for a in argv)
    assert "--enable-server-load-tracking" in argv  # always: the stall rule reads /load
    assert "--api-key" not in " ".join(argv)


def test_ray_start_head_and_worker_golden(cfg):
    head, worker = cfg.nodes
    pinned = ["--min-worker-port=10002", "--max-worker-port=19999"]
    assert container.ray_start_args(cfg, head) == [
        "start", "--block", "--node-ip-address=10.9.0.1", "--num-gpus=1", "--disable-usage-stats", *pinned,
        "--head", "--port=6379",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--dashboard-port=8265",
    ]  # fmt: skip
    assert container.ray_start_args(cfg, worker) == [
        "start", "--block", "--node-ip-address=10.9.0.2", "--num-gpus=1", "--disable-usage-stats", *pinned,
        "--address=10.9.0.1:6379",
    ]  # fmt: skip


def test_every_port_ray_listens_on_is_one_the_config_checks(cfg):
    """The ports pinned in `ray start` are exactly the Ray listeners the config's port rules know."""
    for index, node in enumerate(cfg.nodes):
        argv = container.ray_start_args(cfg, node)
        pinned = {int(arg.split("=")[1]) for arg in argv if arg.split("=")[0].endswith("port") and "=" in arg}
        known = node_listeners(cfg, index)
        ray_ports = {port for item in known if item.key.startswith("ray.") for port in (item.first, item.last)}
        if index == 0:
            assert any(item.first == 10001 for item in known)  # Ray Client's, not settable, still known
        assert any((item.first, item.last) == (32768, 60999) for item in known)  # Ray's random picks
        assert pinned == ray_ports, (node.name, pinned ^ ray_ports)


def test_node_env_binds_everything_to_the_fabric(cfg):
    env = dict(item.split("=", 1) for item in container.node_env(cfg, cfg.nodes[0]))
    assert env == {
        "VLLM_HOST_IP": "10.9.0.1",
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "TP_SOCKET_IFNAME": "enp1s0f1np1",
        "UCX_NET_DEVICES": "enp1s0f1np1",
        "OMPI_MCA_btl_tcp_if_include": "enp1s0f1np1",
        "RAY_memory_monitor_refresh_ms": "0",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "rocep1s0f1,roceP2p1s0f1",
        "NCCL_DEBUG": "INFO",
        "RAY_AUTH_MODE": "token",
    }
    worker = dict(item.split("=", 1) for item in container.node_env(cfg, cfg.nodes[1]))
    assert worker["VLLM_HOST_IP"] == "10.9.0.2" and "NCCL_IB_HCA" not in worker


def test_script_program_carries_params_as_data_not_code():
    hostile = {"argv": ["vllm", "serve", "x", "--chat-template=$(reboot)", "'; rm -rf / #", '"""'], "key": "a\nb"}
    program = programs.script_program("serve_stop.py", hostile)
    namespace: dict = {}
    exec(program.split("\n", 1)[0], namespace)  # only the PARAMS line
    assert json.loads(namespace["PARAMS"]) == hostile


HOSTILE_WORDS = ["$(touch pwned)", ";touch pwned", "`id`", "a;b", "a&&b", "'quoted'", '"dq"', "x y", "*", "~root", "\\"]


@pytest.mark.parametrize("word", HOSTILE_WORDS)
def test_shell_line_keeps_each_hostile_word_whole(word):
    argv = ["docker", "exec", "-i", word, "python3", "-"]
    assert shlex.split(shell.shell_line(argv)) == argv


def _fake_docker(tmp_path: Path) -> Path:
    """A `docker` on PATH that records its argv as JSON lines and fails for `exec`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        "open(os.environ['RECORD'], 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "sys.exit(0 if sys.argv[1] in ('logs', 'inspect') else 3)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize("word", HOSTILE_WORDS)
def test_remote_command_lines_run_hostile_words_as_data(tmp_path, word, cfg):
    """The exact strings given to pulumi-command, run by a real shell: nothing is interpreted."""
    record = tmp_path / "argv.jsonl"
    env = {**os.environ, "PATH": f"{_fake_docker(tmp_path)}:{os.environ['PATH']}", "RECORD": str(record)}
    line = shell.with_log_tail_on_failure(shell.exec_python(word, 30), cfg.nodes[0], word)
    result = subprocess.run(["bash", "-c", line], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 3  # the failing exec's code is kept
    calls = [json.loads(x) for x in record.read_text().splitlines()]
    assert calls == [["exec", "-i", word, "python3", "-"], ["logs", "--tail", "60", word]]
    assert "node spark-01" in result.stderr
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("answer, runs", [("exit 1", False), ("echo false", False), ("echo true", True)])
def test_delete_runs_only_in_a_running_container(tmp_path, answer, runs):
    """Gone (inspect fails) or stopped (crashed, stopped by hand): nothing to stop, and destroy goes on."""
    record = tmp_path / "argv.jsonl"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f'#!/bin/sh\necho "$@" >> "$RECORD"\nif [ "$1" = inspect ]; then {answer}; fi\nexit 0\n'
    )
    (bin_dir / "docker").chmod(0o755)
    line = shell.if_container_running("head", ["docker", "exec", "head", "true"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record)}
    result = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True)
    assert result.returncode == 0
    calls = record.read_text().splitlines()
    assert calls[0] == "inspect --type container --format {{.State.Running}} head"
    assert calls[1:] == (["exec head true"] if runs else [])


def test_docker_host_url():
    raw = config(nodes__1__user="aurora", nodes__1__sshPort=2222)
    nodes = load_cluster_config(raw).nodes
    assert shell.docker_host_url(nodes[0]) == "ssh://root@10.0.0.1"
    assert shell.docker_host_url(nodes[1]) == "ssh://aurora@10.0.0.2:2222"


SCRIPT_CONTRACTS = [
    ("supervisor.py", "SupervisorParams", "json.loads(sys.argv[1])"),
    ("serve_spec.py", "HandoverParams", "given()"),
    ("wait_ready.py", "ReadyParams", "given()"),
    ("smoke.py", "SmokeParams", "given()"),
    ("node_answers.py", "AnswersParams", "given()"),
    ("ray_join.py", "ClusterWaitParams", "given()"),
    ("node_benchmark.py", "BenchmarkParams", "given()"),
    ("nccl_bandwidth.py", "NcclParams", "given()"),
    ("node_fabric_gate.py", "FabricGateParams", "given()"),
    ("hf_download.py", "HfDownloadParams", "given()"),
    ("node_guard.py", "GuardParams", "given()"),
    ("image_pull.py", "PullParams", "given()"),
    ("router_keeper.py", "KEEPER_MODES", "_GIVEN"),
    ("node_fabric_copy.py", "COPY_ROLES", "_GIVEN"),
]


def _p_reads(text: str) -> tuple[set[str], list[str]]:
    """The `P.<field>`s a script reads, and every read of P as a dict (`P[…]`, `P.get(…)`, `P.pop(…)`)."""
    import ast

    read, as_dict = set(), []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "P":
            read.add(node.attr)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "P":
            as_dict.append(ast.unparse(node))
    dict_methods = {"get", "pop", "keys", "items", "setdefault", "update"}
    return read - dict_methods, [*as_dict, *sorted(read & dict_methods)]


@pytest.mark.parametrize("script_name, contract, source", SCRIPT_CONTRACTS)
def test_each_node_step_reads_only_fields_of_its_contract_which_travels_with_it(script_name, contract, source):
    """node_contract.py travels with the script (it imports it), P is its contract class (`from_json`, the one way back
    from JSON), and every `P.<field>` the script and the modules it carries read is a field of it: a renamed field
    fails here, not on a node. The fabric copy's P is its role's (the depot's, an image's or a model's receiver)."""
    from components.plan.programs import ENTRY, node_modules
    from components.scripts import node_contract

    carried = node_modules(script_name)
    assert "components.scripts.node_contract" in carried
    text = (ROOT / "components/scripts" / script_name).read_text()
    by = {"COPY_ROLES": "role", "KEEPER_MODES": "mode"}.get(contract)  # a class per role or mode
    kinds = list(getattr(node_contract, contract).values()) if by else [getattr(node_contract, contract)]
    built = f'{contract}[_GIVEN["{by}"]].from_json({source})' if by else f"{contract}.from_json({source})"
    assert f"P = {built}" in text
    helpers = "".join(
        source for name, source in carried.items() if name not in (ENTRY, "components.scripts.node_contract")
    )
    read, as_dict = _p_reads(text + helpers)
    fields = {field.name for kind in kinds for field in node_contract.fields(kind)}
    assert read and read <= fields, read - fields
    assert as_dict == [], f"{script_name} reads its parameters as a dict: {as_dict}"


def test_no_script_reads_its_parameters_as_a_dict():
    """Every script under components/scripts reads its parameters through its contract's dataclass."""
    offenders = {}
    for path in sorted((ROOT / "components/scripts").glob("*.py")):
        _, as_dict = _p_reads(path.read_text())
        if as_dict:
            offenders[path.name] = as_dict
    assert offenders == {}
    every = {name for name, _, _ in SCRIPT_CONTRACTS}
    takes_params = {p.name for p in (ROOT / "components/scripts").glob("*.py") if "\nP = " in p.read_text()}
    assert takes_params <= every, takes_params - every
