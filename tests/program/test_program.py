"""The real __main__.py under Pulumi's mocks: resources, options, dependencies, outputs, lifecycle."""

import asyncio
import copy
import gc
import json
import os
import stat
import threading
from pathlib import Path

import pulumi
import pytest
import yaml

from components.config import ConfigError
from tests.harness import (
    CONTAINER,
    DOCKER_PROVIDER,
    IMAGE,
    LOCAL_COMMAND,
    PROGRAM_KEY,
    REMOTE_COMMAND,
    ROOT,
    FakeCloud,
    changed_inputs,
    run_program,
    settle,
    shared_run,
    strip_secrets,
)
from tests.keys import host_key_line, openssh_private_key

HOST_KEY = host_key_line("pinned")
SECRETS = {
    "apiKey": "sk-live-7d1c9e40aa",
    "hfToken": "hf_tok_55aa",
    "sshPrivateKey": openssh_private_key("program-tests"),
}


def stack_file(stack: str) -> dict:
    doc = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())["config"]
    return {key.split(":", 1)[1]: value for key, value in doc.items()}


def prod(**changes) -> dict:
    cfg = copy.deepcopy(stack_file("prod"))
    for node in cfg["nodes"]:
        node["hostKey"] = HOST_KEY
    cfg.update(changes)
    return cfg


@pytest.fixture
def run():
    return shared_run(prod(), SECRETS, stack="prod")


def test_one_docker_provider_per_node_over_ssh_trusting_only_the_pinned_host_key(run):
    providers = {r.name: r for r in run.of_type(DOCKER_PROVIDER)}
    assert set(providers) == {"spark-01-docker", "spark-02-docker"}
    opts = json.loads(providers["spark-02-docker"].inputs["sshOpts"])  # provider config travels as JSON
    assert providers["spark-02-docker"].inputs["host"] == "ssh://aurora@spark-02.lan"
    # No known_hosts file: the key travels in the options, so destroy and refresh work anywhere.
    assert opts[opts.index("StrictHostKeyChecking=yes") - 1] == "-o"
    for option in ("UserKnownHostsFile=/dev/null", "GlobalKnownHostsFile=/dev/null", "BatchMode=yes"):
        assert option in opts
    assert f"KnownHostsCommand=/bin/echo spark-02.lan {HOST_KEY}" in opts
    # The key secret is written once, as ssh names it (~ is the account's home, not this machine's path).
    assert "IdentityFile=~/.spark-vllm/spark-vllm/prod/id_spark_vllm" not in opts  # SPARK_VLLM_HOME is set here
    identity = Path(next(o for o in opts if o.startswith("IdentityFile=")).split("=", 1)[1])
    assert identity.read_text() == SECRETS["sshPrivateKey"]
    assert stat.S_IMODE(os.stat(identity).st_mode) == 0o600
    assert "IdentitiesOnly=yes" in opts
    # every resource on a node uses that node's provider
    for reg in run.of_type(IMAGE) + run.of_type(CONTAINER):
        node = reg.name.split("-edge")[0].split("-image")[0].split("-container")[0].split("-guard")[0]
        assert reg.provider.startswith(providers[f"{node}-docker"].urn)
    # no host key scan when every hostKey is set: locally, only the Ray token, vLLM's key and the checks' gate
    assert {r.name for r in run.of_type(LOCAL_COMMAND)} == {
        "ray-auth-token",
        "vllm-api-key",
        "spark-vllm-fabric-passed",
        "spark-vllm-checks-passed",
    }


def test_the_program_runs_in_this_thread_with_the_garbage_collector_off_and_leaves_both_as_it_found_them():
    """tests/harness.py's run_program answers the SDK's monitor calls in the calling thread, not a pool's, and turns
    the collector off for the run (a test process's heap made each full collection cost more than the run's own work);
    after it, the loop's executor is the one it had and the collector on again only where it was on. quick=False leaves
    both as they are."""

    class Watching(FakeCloud):
        def new_resource(self, args):
            seen.append((gc.isenabled(), threading.get_ident() == here))
            return super().new_resource(args)

    seen: list[tuple[bool, bool]] = []
    here = threading.get_ident()
    loop = asyncio.get_event_loop()
    pool = loop._default_executor
    assert gc.isenabled()
    run_program(prod(), SECRETS, stack="prod", mocks=Watching())
    assert seen and set(seen) == {(False, True)} and gc.isenabled() and loop._default_executor is pool
    gc.disable()
    try:
        run_program(prod(), SECRETS, stack="prod", mocks=Watching())
        assert not gc.isenabled()
    finally:
        gc.enable()
    seen.clear()  # quick=False (benchmarks/program_scale.py): as `pulumi up` runs the SDK, the pool's threads and all
    run_program(prod(), SECRETS, stack="prod", mocks=Watching(), quick=False)
    assert seen and set(seen) == {(True, False)} and loop._default_executor is pool


def test_without_spark_vllm_home_the_key_file_is_named_from_home_as_ssh_expands_it(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARK_VLLM_HOME")
    monkeypatch.setattr("components.resources.ssh.login_home", lambda: tmp_path)
    run_ = run_program(prod(), SECRETS, stack="prod")
    opts = json.loads(run_.named("spark-01-docker").inputs["sshOpts"])
    assert "IdentityFile=~/.spark-vllm/spark-vllm/prod/id_spark_vllm" in opts
    assert (tmp_path / ".spark-vllm/spark-vllm/prod/id_spark_vllm").read_text() == SECRETS["sshPrivateKey"]


def test_remote_commands_pin_the_same_host_key(run):
    for reg in run.of_type(REMOTE_COMMAND):
        connection = reg.inputs["connection"]
        assert connection["hostKey"] == HOST_KEY
        assert connection["privateKey"] == SECRETS["sshPrivateKey"]
        assert "connection" in reg.secret_paths()


def test_remote_commands_retry_the_dial_as_ssh_dial_error_limit_says(run):
    assert {reg.inputs["connection"]["dialErrorLimit"] for reg in run.of_type(REMOTE_COMMAND)} == {20}
    fast = run_program(prod(ssh={"dialErrorLimit": 3}), SECRETS, stack="prod")
    assert {reg.inputs["connection"]["dialErrorLimit"] for reg in fast.of_type(REMOTE_COMMAND)} == {3}


def test_each_node_pulls_the_image_with_progress_and_a_timeout_and_keeps_it(run):
    images = [r for r in run.of_type(IMAGE) if not r.name.endswith("-edge-image")]
    assert {r.name for r in images} == {"spark-01-image", "spark-02-image"}
    # the edge's HAProxy only where the endpoint is: the head
    assert [(r.name, r.inputs["name"]) for r in run.of_type(IMAGE) if r.name.endswith("-edge-image")] == [
        ("spark-01-edge-image", "haproxy:3.0")
    ]
    assert all(r.inputs == {"name": "hellohal2064/vllm-qwen3.5-gb10", "keepLocally": True} for r in images)
    pull = run.named("spark-02-pull")
    assert pull.inputs["create"] == "timeout --kill-after=10 3630 python3 -"
    params = json.loads(json.loads(pull.inputs["stdin"].split("\n", 1)[0].split("=", 1)[1]))
    assert params == {
        "node": "spark-02",
        "image": "hellohal2064/vllm-qwen3.5-gb10",
        "timeout_seconds": 3600,
        "progress_seconds": 10,
    }
    assert pull.inputs["triggers"] == ["hellohal2064/vllm-qwen3.5-gb10"]
    assert pull.urn in run.named("spark-02-image").dependencies  # the provider then finds it on the node


def test_the_pull_timeout_is_a_setting():
    run_ = run_program(prod(imageTransfer={"timeoutSeconds": 7200, "progressSeconds": 5}), SECRETS, stack="prod")
    assert run_.named("spark-01-pull").inputs["create"] == "timeout --kill-after=10 7230 python3 -"


def supervisor_of(reg) -> dict:
    return json.loads(reg.inputs["command"][0])


def test_node_containers_are_wired_to_the_fabric(run):
    head, worker = run.named("spark-01-container"), run.named("spark-02-container")
    for reg, fabric in ((head, "192.168.200.12"), (worker, "192.168.200.13")):
        inputs = reg.inputs
        env = dict(e.split("=", 1) for e in inputs["envs"])
        assert env["VLLM_HOST_IP"] == fabric
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES"):
            assert env[key] == "enp1s0f1np1"
        assert env["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"
        assert env["RAY_memory_monitor_refresh_ms"] == "0"
        assert env["HF_TOKEN"] == SECRETS["hfToken"] and env["RAY_AUTH_MODE"] == "token"
        assert len(env["RAY_AUTH_TOKEN"]) == 64
        assert "envs" in reg.secret_paths()
        assert inputs["networkMode"] == "host" and inputs["ipcMode"] == "host"
        assert inputs["gpus"] == "all" and "shmSize" not in inputs and inputs["init"] is True
        assert inputs["restart"] == "unless-stopped" and inputs["mustRun"] is True
        assert {u["name"]: (u["soft"], u["hard"]) for u in inputs["ulimits"]} == {
            "memlock": (-1, -1),
            "stack": (67108864, 67108864),
            "nofile": (1048576, 1048576),
        }
        assert inputs["mounts"] == [
            {
                "type": "bind",
                "source": "/models/Qwen3.5-122B-A10B-FP8",
                "target": "/models/Qwen3.5-122B-A10B-FP8",
                "readOnly": True,
            },
            {"type": "volume", "source": "spark-vllm-hf-cache", "target": "/root/.cache/huggingface"},
            # container.compileCache (on by default): a new container starts from the node's compiled graphs
            {"type": "volume", "source": "spark-vllm-compile-cache", "target": "/root/.cache/vllm"},
            {"type": "volume", "source": "spark-vllm-flashinfer-cache", "target": "/root/.cache/flashinfer"},
            # the node's GPU turn: only the stack's containers reach it (node_gpu_turn.py)
            {"type": "volume", "source": "spark-vllm-gpu-turn", "target": "/run/spark-vllm-turn"},
            # network.guard (on in the prod stack): its marker, so Ray waits for the rules after a reboot
            {"type": "volume", "source": "spark-vllm-guard", "target": "/run/spark-vllm-guard", "readOnly": True},
        ]
        assert inputs.get("privileged") is False
        assert inputs["capabilities"] == {"adds": ["IPC_LOCK"]}
        assert inputs["devices"] == [{"hostPath": "/dev/infiniband", "containerPath": "/dev/infiniband"}]
        assert inputs["image"] == "sha256:" + "ab" * 32  # the pulled id, not the tag
        assert reg.delete_before_replace
        assert reg.replace_on_changes == ["mounts"]  # another model directory is a new container
    # the main process is the supervisor, which keeps Ray (and on the head vLLM) running
    assert head.inputs["entrypoints"][:3] == ["python3", "-u", "-c"]
    assert "/opt/spark-vllm/supervisor.py" in head.inputs["entrypoints"][3]  # the bootstrap, not the supervisor
    installed = run.named("spark-01-supervisor")
    assert "class Supervisor" in installed.inputs["stdin"]
    assert installed.inputs["create"].startswith("docker exec -i spark-vllm-spark-01 python3 -c")
    assert installed.inputs["triggers"] == [head.id]
    on_head, on_worker = supervisor_of(head), supervisor_of(worker)
    assert on_head["ray_argv"][:2] == ["ray", "start"] and "--head" in on_head["ray_argv"]
    assert "--dashboard-host=127.0.0.1" in on_head["ray_argv"]
    assert "--address=192.168.200.12:6379" in on_worker["ray_argv"]
    # nothing of vLLM's (nor the node count) in the container's definition: those change no container
    assert set(on_head) == {"node", "executor", "run_dir", "ray_argv", "stop_grace_seconds", "guard_marker",
                           "gpu_turn_dir"}  # fmt: skip
    assert head.inputs["name"] == "spark-vllm-spark-01"


def test_without_compile_cache_the_containers_keep_their_caches_inside_and_turning_it_off_replaces_them():
    cfg = prod()
    off = {**cfg, "container": {**cfg.get("container", {}), "compileCache": False}}
    mounts = run_program(off, SECRETS, stack="prod").named("spark-01-container").inputs["mounts"]
    assert not any(m["source"] in ("spark-vllm-compile-cache", "spark-vllm-flashinfer-cache") for m in mounts)
    result = changes(cfg, off)
    assert {name for name, keys in result.items() if "mounts" in keys} == {"spark-01-container", "spark-02-container"}


def test_workers_start_after_the_head_and_serve_after_every_node(run):
    head, worker = run.named("spark-01-container"), run.named("spark-02-container")
    assert head.urn in worker.dependencies
    joined = run.named("spark-02-joined")
    assert worker.urn in joined.dependencies
    ready = run.named("spark-vllm-cluster-ready")
    assert {head.urn, worker.urn, joined.urn} <= set(ready.dependencies)
    serve, up, smoke = run.named("spark-vllm-serve"), run.named("spark-vllm-ready"), run.named("spark-vllm-smoke")
    assert ready.urn in serve.dependencies and serve.urn in up.dependencies and up.urn in smoke.dependencies


def test_cluster_wait_expects_every_node_and_the_gpus(run):
    stdin = run.named("spark-vllm-cluster-ready").inputs["stdin"]
    params = json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1]))
    assert params["expected"] == [
        {"name": "spark-01", "fabric_address": "192.168.200.12"},
        {"name": "spark-02", "fabric_address": "192.168.200.13"},
    ]
    assert params["gpus_needed"] == 2 and params["timeout_seconds"] == 300


def params_of(reg) -> dict:
    return json.loads(json.loads(reg.inputs["stdin"].split("\n", 1)[0].split("=", 1)[1]))


def test_serve_hands_vllm_its_settings_in_the_head_container_with_the_key_off_the_command_line(run):
    serve = run.named("spark-vllm-serve")
    assert serve.inputs["create"].startswith("timeout --kill-after=10 180 docker exec -i spark-vllm-spark-01 python3 -")
    params = params_of(serve)
    assert "supervisor" in serve.inputs["stdin"] and params["run_dir"] == "/run/spark-vllm"
    assert params["spec"]["ray_ready"] == {"address": "192.168.200.12:6379", "nodes": 2, "gpus": 2}
    assert params["spec"]["health_url"] == "http://192.168.200.12:29002/health"  # behind the edge, on the fabric
    assert params["spec"]["recovery"] == {
        "max_restarts": 5, "window_seconds": 600, "backoff_seconds": 2, "max_backoff_seconds": 60, "gpu_wait_seconds": 180
    }  # fmt: skip
    assert params["argv"][:3] == ["vllm", "serve", "/models/Qwen3.5-122B-A10B-FP8"]
    assert "--distributed-executor-backend=ray" in params["argv"] and "--tensor-parallel-size=2" in params["argv"]
    assert params["env"]["VLLM_API_KEY"] == PROGRAM_KEY  # the program's own: no client's key reaches vLLM
    assert "stdin" in serve.secret_paths()
    assert {"stdin", "stdout", "stderr"} <= set(serve.additional_secret_outputs)
    assert {"stdin", "stdout", "stderr"} <= set(run.named("spark-vllm-ready").additional_secret_outputs)
    assert "docker exec -i spark-vllm-spark-01 python3 - /run/spark-vllm 30" in serve.inputs["delete"]
    assert serve.delete_before_replace
    assert not any(r.name.endswith("-serve") and r.name != "spark-vllm-serve" for r in run.registrations)


def test_executor_mp_runs_a_rank_on_every_node_without_ray(tmp_path):
    run_ = shared_run(prod(executor="mp"), SECRETS, stack="prod")
    head, worker = run_.named("spark-01-container"), run_.named("spark-02-container")
    assert supervisor_of(head)["ray_argv"] is None and supervisor_of(head)["executor"] == "mp"
    env = dict(e.split("=", 1) for e in worker.inputs["envs"])
    assert env["VLLM_HOST_IP"] == "192.168.200.13" and "RAY_AUTH_TOKEN" not in env and "RAY_AUTH_MODE" not in env
    assert not any(
        r.name.endswith(("-joined", "-cluster-ready")) or r.name == "ray-auth-token" for r in run_.registrations
    )
    rank0, rank1 = params_of(run_.named("spark-vllm-serve"))["argv"], params_of(run_.named("spark-02-serve"))["argv"]
    common = ["--distributed-executor-backend=mp", "--nnodes=2", "--master-addr=192.168.200.12", "--master-port=29501"]
    assert all(flag in rank0 for flag in common) and "--node-rank=0" in rank0 and "--headless" not in rank0
    assert all(flag in rank1 for flag in common) and "--node-rank=1" in rank1 and "--headless" in rank1
    assert params_of(run_.named("spark-vllm-serve"))["env"]["VLLM_API_KEY"] == PROGRAM_KEY
    assert "stdin" in run_.named("spark-vllm-serve").secret_paths()
    # the headless rank serves no API: no key there (it would land in its compile cache's metadata)
    assert "VLLM_API_KEY" not in params_of(run_.named("spark-02-serve"))["env"]
    assert PROGRAM_KEY not in run_.named("spark-02-serve").inputs["stdin"]
    ready = run_.named("spark-vllm-ready")
    assert {run_.named("spark-vllm-serve").urn, run_.named("spark-02-serve").urn} <= set(ready.dependencies)
    assert run_.exports["rayAddress"] is None and run_.exports["executor"] == "mp"
    assert run_.exports["logCommands"]["vllm:spark-02"] == (
        "ssh -t -p 22 aurora@spark-02.lan 'docker exec spark-vllm-spark-02 tail -n 200 -f /run/spark-vllm/vllm.log'"
    )


def test_switching_the_executor_replaces_the_containers_and_keeps_the_rest():
    result = changes(prod(), prod(executor="mp"))
    assert "command" in result["spark-01-container"] and "envs" in result["spark-02-container"]
    assert result["spark-02-serve"] == "create" and result["spark-vllm-cluster-ready"] == "delete"
    assert not any(name.endswith(("-docker", "-image", "-pull", "-preflight")) for name in result)


def test_the_status_command_asks_every_node_its_supervisor(run):
    command = run.exports["statusCommand"]
    assert command.startswith("echo '== spark-01'; ssh -p 22 aurora@spark-01.lan ")
    assert "echo '== spark-02'; ssh -p 22 aurora@spark-02.lan " in command
    assert "restarted by Docker {{.RestartCount}} time(s)" in command and "/run/spark-vllm/status.json" in command


def test_the_harness_reads_an_export_through_plain_containers_and_sees_a_secret_deep_in_it():
    def read(make):
        async def go():
            return await settle(make())

        loop = asyncio.new_event_loop()  # its own loop: asyncio.run would unset the one the mocks use
        try:
            return loop.run_until_complete(go())
        finally:
            loop.close()

    def nested():
        return {"a": [pulumi.Output.from_input("x"), {"b": pulumi.Output.secret("s")}], "c": 1}

    assert read(nested) == ({"a": ["x", {"b": "s"}], "c": 1}, True)
    assert read(lambda: pulumi.Output.from_input({"k": pulumi.Output.from_input("v")})) == ({"k": "v"}, False)
    assert read(lambda: pulumi.Output.secret("t").apply(lambda t: [t])) == (["t"], True)


def test_no_secret_appears_in_plain_inputs_or_outputs(run):
    plain = json.dumps([strip_secrets(r.wire) for r in run.registrations]) + json.dumps(run.plain_exports())
    assert run.secret_exports == set()  # vLLM's key is the program's own, in no output
    for name, value in {**SECRETS, "program key": PROGRAM_KEY}.items():
        assert value not in plain, name
        assert SECRETS["sshPrivateKey"].splitlines()[1] not in plain


def test_a_misspelt_namespace_and_a_self_promotion_stop_the_program_before_any_resource():
    foreign = {"spark_vllm:maxModelLen": "4096", "docker:host": "unix:///var/run/docker.sock"}
    cfg = prod(promoteFrom="prod")
    del cfg["image"], cfg["model"]
    with pytest.raises(ConfigError) as caught:
        run_program(cfg, SECRETS, stack="prod", foreign=foreign)
    paths = [p.split(": ", 1)[0] for p in caught.value.problems]
    assert paths == ["promoteFrom", "spark_vllm:maxModelLen"]  # docker:host is another namespace: allowed
    assert "another stack than this one (organization/spark-vllm/prod)" in caught.value.problems[0]


def test_outputs(run):
    assert run.exports["endpoint"] == "http://spark-01.lan:30000/v1"
    assert run.exports["servedModelName"] == "/models/Qwen3.5-122B-A10B-FP8"
    assert run.exports["headNode"] == "spark-01"
    assert run.exports["rayAddress"] == "192.168.200.12:6379"
    assert run.exports["containers"] == {"spark-01": "spark-vllm-spark-01", "spark-02": "spark-vllm-spark-02"}
    assert run.exports["logCommands"]["vllm"] == (
        "ssh -t -p 22 aurora@spark-01.lan 'docker exec spark-vllm-spark-01 tail -n 200 -f /run/spark-vllm/vllm.log'"
    )
    assert set(run.exports["logCommands"]) == {
        "vllm",
        "spark-01",
        "spark-02",
        "edge",
    }  # with Ray only the head runs vLLM
    assert run.exports["smoke"] == {"latencySeconds": 0.5, "completionTokens": 3, "promptTokens": 7}
    release = run.exports["release"]
    assert release["image"] == "hellohal2064/vllm-qwen3.5-gb10@sha256:" + "ab" * 32
    assert release["validated"] is True and release["engine"]["maxModelLen"] == 32768


def test_bad_config_error_lists_all_problems_before_any_resource():
    cloud = FakeCloud()
    with pytest.raises(ConfigError) as caught:
        run_program(prod(vllm={"port": 0}, nodes=[]), {}, stack="prod", mocks=cloud)
    assert cloud.created == []
    # No nodes is one problem: the GPU count of an empty list is not a second one.
    assert [p.split(":")[0] for p in caught.value.problems] == ["nodes", "vllm.port", "apiKey"]


def test_an_api_key_set_without_secret_stops_the_program_before_any_resource():
    cloud = FakeCloud()
    with pytest.raises(ConfigError) as caught:
        others = {key: value for key, value in SECRETS.items() if key != "apiKey"}
        run_program({**prod(), "apiKey": "sk-in-plain-text"}, others, stack="prod", mocks=cloud)
    assert cloud.created == []
    assert [p.split(":")[0] for p in caught.value.problems] == ["apiKey"]
    assert "sk-in-plain-text" not in str(caught.value)
    # The same value as a secret passes.
    run_program(prod(), {**SECRETS, "apiKey": "sk-in-plain-text"}, stack="prod")


def test_dev_stack_is_one_node_tp1():
    run_ = run_program(stack_file("dev"), {}, stack="dev")
    assert [r.name for r in run_.of_type(CONTAINER)] == ["spark-01-container", "spark-01-edge"]
    assert run_.exports["endpoint"] == "http://spark-01.lan:8000/v1"
    assert not any(r.name.endswith("-joined") for r in run_.registrations)


def test_image_ids_that_differ_between_nodes_stop_the_containers():
    class Drifting(FakeCloud):
        def new_resource(self, args):
            id_, outputs = super().new_resource(args)
            if args.typ == IMAGE and args.name.startswith("spark-02"):
                outputs["image_id"] = "sha256:" + "cd" * 32
            return id_, outputs

    with pytest.raises(
        Exception, match=r"the image differs between nodes \(spark-01: sha256:abab.*spark-02: sha256:cdcd"
    ):
        run_program(prod(), SECRETS, stack="prod", mocks=Drifting())


# --- what a change changes ---------------------------------------------------------------------
# Under mocks: which resources' inputs a config change touches. Whether the engine then updates or
# replaces them is the providers' call, seen through the real engine in the rehearsal (tests/e2e).


def changes(before: dict, after: dict, secrets=SECRETS) -> dict:
    """What `after` changes from `before`: the before-run shared (most are prod's), the after-run the program's own
    (so `changes(prod(), prod())` runs the program twice)."""
    return changed_inputs(
        shared_run(before, secrets, stack="prod"), shared_run(after, secrets, stack="prod", cached=False)
    )


def test_nothing_changed_means_nothing_to_do():
    assert changes(prod(), prod()) == {}


@pytest.mark.parametrize(
    "change",
    [
        {"maxModelLen": 16384},
        {"vllm": {**prod()["vllm"], "gpuMemoryUtilization": 0.8}},
        {"vllm": {**prod()["vllm"], "reasoningParser": "deepseek_r1"}},
        {"vllm": {**prod()["vllm"], "extraArgs": ["--max-num-seqs", "4"]}},
        {"tensorParallelSize": 1, "pipelineParallelSize": 2},
        {"recovery": {"maxRestarts": 9, "backoffSeconds": 2}},
    ],
    ids=["maxModelLen", "gpuMemoryUtilization", "parser", "extraArgs", "tp-pp", "recovery"],
)
def test_a_vllm_only_change_touches_only_the_serve_steps(change):
    result = changes(prod(), prod(**change))
    assert set(result) <= {"spark-vllm-serve", "spark-vllm-ready", "spark-vllm-smoke", "spark-vllm-benchmark",
                           "spark-vllm-cluster-ready"}  # fmt: skip
    assert result["spark-vllm-serve"] == {"stdin"}  # new arguments, same triggers: restarted in place


def test_with_mp_a_vllm_only_change_touches_only_every_node_s_serve_step():
    result = changes(prod(executor="mp"), prod(executor="mp", maxModelLen=16384))
    assert set(result) <= {"spark-vllm-serve", "spark-02-serve", "spark-vllm-ready", "spark-vllm-smoke",
                           "spark-vllm-benchmark"}  # fmt: skip
    assert result["spark-vllm-serve"] == result["spark-02-serve"] == {"stdin"}


def test_an_image_change_leaves_providers_alone():
    result = changes(prod(), prod(image="hellohal2064/vllm-qwen3.5-gb10:v2"))
    assert result["spark-01-image"] == result["spark-02-image"] == {"name"}
    assert not any(name.endswith("-docker") for name in result)


def test_adding_a_node_touches_that_node_and_the_serve():
    three = prod(tensorParallelSize=3)
    three["nodes"] = [
        *three["nodes"],
        {**three["nodes"][1], "name": "spark-03", "host": "spark-03.lan", "fabricAddress": "192.168.200.14"},
    ]
    result = changes(prod(), three)
    spark03 = {k: v for k, v in result.items() if k.startswith("spark-03")}
    assert set(spark03.values()) == {"create"}
    assert set(spark03) == {
        f"spark-03-{r}"
        for r in (
            "docker",
            "pull",
            "image",
            "container",
            "joined",
            "fabric-gate",
            "preflight",
            "model-fingerprint",
            "gpu-check",
            "image-check",
            "host-check",
            "supervisor",
        )
        + ("guard-host", "guard", "guard-ready")  # network.guard is on in the prod stack
    }
    others = {k: v for k, v in result.items() if not k.startswith("spark-03")}
    # The existing nodes' preflight and fabric gate run again because their peer list grew (can they
    # reach spark-03, how fast?), and their guard lets the new peer in (and its test port); no provider,
    # image or Ray container of theirs is touched.
    assert others == {
        "spark-01-preflight": {"create"},
        "spark-02-preflight": {"create"},
        "spark-01-fabric-gate": {"create"},
        "spark-02-fabric-gate": {"create"},
        **{f"{node}-guard": {"entrypoints"} for node in ("spark-01", "spark-02")},
        **{f"{node}-guard-host": {"create", "delete"} for node in ("spark-01", "spark-02")},
        **{f"{node}-guard-ready": {"stdin"} for node in ("spark-01", "spark-02")},
        "spark-vllm-checks-passed": {"create"},  # the gate records three nodes now
        "spark-vllm-fabric-passed": {"create"},  # and the fabric gate three nodes' figures
        "spark-vllm-cluster-ready": {"stdin", "triggers"},  # its triggers list every Ray container
        "spark-vllm-serve": {"stdin"},
        "spark-vllm-ready": {"triggers"},
        "spark-vllm-smoke": {"triggers"},
        "spark-vllm-benchmark": {"triggers"},
    }


def test_bumping_restart_generation_restarts_vllm_only():
    vllm = {**prod()["vllm"], "restartGeneration": 1}
    result = changes(prod(), prod(vllm=vllm))
    assert "triggers" in result["spark-vllm-serve"]  # a new trigger: stopped and started again
    assert not any(name.endswith(("-container", "-image", "-docker")) for name in result)


def test_a_node_without_host_key_is_pinned_on_first_use_on_both_transports(caplog):
    cfg = prod(security={"requireHostKeys": False})
    del cfg["nodes"][1]["hostKey"]
    with caplog.at_level("WARNING"):
        run_ = run_program(cfg, SECRETS, stack="prod")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(w.startswith("node spark-02: no hostKey, so the first `pulumi up` trusts the key") for w in warnings)
    assert not any(w.startswith("node spark-01: no hostKey") for w in warnings)
    assert any("trustRemoteCode is on" in w and "/models/Qwen3.5-122B-A10B-FP8" in w for w in warnings)
    scan = run_.named("spark-02-host-key")
    assert scan.typ == LOCAL_COMMAND and "ssh-keyscan -T 15 -p 22 -t ed25519 spark-02.lan" in scan.inputs["create"]
    assert not scan.inputs.get("triggers") and "update" not in scan.inputs  # read once, then kept
    # Both transports trust what the scan read (FakeCloud answers every command with ""), nothing else.
    opts = json.loads(run_.named("spark-02-docker").inputs["sshOpts"])
    assert "StrictHostKeyChecking=yes" in opts and "KnownHostsCommand=/bin/echo spark-02.lan " in opts
    assert scan.urn in run_.named("spark-02-docker").dependencies
    assert run_.named("spark-02-preflight").inputs["connection"]["hostKey"] == ""
    assert run_.named("spark-01-preflight").inputs["connection"]["hostKey"] == HOST_KEY


def test_prod_requires_host_keys():
    from components.config import ConfigError

    cfg = prod()
    del cfg["nodes"][0]["hostKey"]
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.hostKey: None — the node's public host key"):
        run_program(cfg, SECRETS, stack="prod")


def test_without_an_ssh_key_secret_both_transports_use_the_agent():
    secrets = {k: v for k, v in SECRETS.items() if k != "sshPrivateKey"}
    run_ = run_program(prod(), secrets, stack="prod")
    opts = json.loads(run_.named("spark-01-docker").inputs["sshOpts"])
    assert not any(o.startswith("IdentityFile=") for o in opts) and "IdentitiesOnly=yes" not in opts
    assert "privateKey" not in run_.named("spark-vllm-serve").inputs["connection"]


@pytest.mark.parametrize(
    ("agent", "keys", "with_key", "expected"),
    [
        (None, None, False, "sshPrivateKey: None and SSH_AUTH_SOCK unset"),
        ("/tmp/stale.sock", None, True, "SSH_AUTH_SOCK='/tmp/stale.sock' — no ssh-agent answers there"),
        ("/tmp/agent.sock", 0, False, "the ssh-agent at SSH_AUTH_SOCK='/tmp/agent.sock' holds no keys"),
    ],
    ids=["no-key-no-agent", "stale-agent-beside-a-key", "empty-agent"],
)
def test_ssh_credentials_that_would_fail_half_way_stop_the_program_first(monkeypatch, agent, keys, with_key, expected):
    from components.resources.ssh import SshAccessError

    if agent is None:
        monkeypatch.delenv("SSH_AUTH_SOCK")
    else:
        monkeypatch.setenv("SSH_AUTH_SOCK", agent)
    monkeypatch.setattr("components.resources.ssh.agent_key_count", lambda path: keys)
    secrets = SECRETS if with_key else {k: v for k, v in SECRETS.items() if k != "sshPrivateKey"}
    cloud = FakeCloud()
    with pytest.raises(SshAccessError) as caught:
        run_program(prod(), secrets, stack="prod", mocks=cloud)
    assert cloud.created == []
    assert expected in str(caught.value) and "Fix:" in str(caught.value)


def test_a_key_and_a_live_agent_together_are_fine_and_the_key_wins():
    run_ = run_program(prod(), SECRETS, stack="prod")  # the fixture's agent holds a key
    opts = json.loads(run_.named("spark-01-docker").inputs["sshOpts"])
    assert "IdentitiesOnly=yes" in opts  # ssh offers only the key; pulumi-command tries it before the agent


def test_a_new_version_of_the_supervisor_replaces_no_container_and_is_written_into_them(monkeypatch):
    """An upgrade of this program (here: the supervisor's source edited) changes the install step only:
    the containers, and the models they serve, stay; the new supervisor runs from their next start."""
    from components.plan import programs
    from components.resources import node_container

    before = run_program(prod(), SECRETS, stack="prod")
    edited = programs.script("supervisor.py") + "\n# a comment\n"
    monkeypatch.setattr(
        node_container, "script", lambda name: edited if name == "supervisor.py" else programs.script(name)
    )
    after = run_program(prod(), SECRETS, stack="prod")
    result = changed_inputs(before, after)
    assert result == {"spark-01-supervisor": {"stdin"}, "spark-02-supervisor": {"stdin"}}, result


def test_with_the_guard_what_listens_outside_a_node_container_waits_for_its_rules_in_this_boot():
    """#58: after a reboot Docker starts every container at once; the edge (its own port), vllm-router (its metrics)
    and the copy depot (its port) listen on fenced ports, so their programs start behind guard_gate.sh, which waits
    for the guard's marker of this boot. Without the guard their containers are as they were."""
    copies = {"imageTransfer": {"method": "copy"}, "modelSync": {"enabled": True}}
    guarded = shared_run(prod(**copies), SECRETS, stack="prod")
    plain = shared_run(prod(**copies, network={"guard": False}), SECRETS, stack="prod")
    for name in ("spark-01-edge", "spark-vllm-depot"):
        on, off = guarded.named(name).inputs, plain.named(name).inputs
        gate = on["entrypoints"][:5]
        assert gate[:2] == ["bash", "-c"] and "until grep -qF" in gate[2]
        assert gate[3:] == ["guard_gate", "/run/spark-vllm-guard/applied.json"]
        assert on["entrypoints"][5:] == off["entrypoints"]  # the same program behind it
        marker = {"type": "volume", "source": "spark-vllm-guard", "target": "/run/spark-vllm-guard", "readOnly": True}
        assert on["mounts"] == [*off["mounts"], marker]
        assert "guard_gate" not in off["entrypoints"] and marker not in off["mounts"]
