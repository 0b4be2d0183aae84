"""vLLM's own multi-node executor, and a group that comes back by itself, through the real CLI.

Two nodes with `executor: mp` (TP 2): vLLM killed on a worker, a worker's dockerd restarted (what a
reboot does to the containers) — both serve again with no `pulumi up`, and a `pulumi up` afterwards
changes nothing. Then the same stack switched to Ray in one `up` (its preview says what is
replaced) and the same faults. Then a vLLM that refuses its settings at start (an unknown flag): its
supervisor stops at once instead of restarting it (a crash loop that exhausts recovery.maxRestarts is
tests/unit/test_supervisor.py's), the containers stay up, and the status command says why (three nodes with
mp and pipeline parallelism: tests/e2e/test_three_nodes.py, on its nodes). Recovery times are
printed (`-s`) for docs/measurements.md.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time

import pytest

from components.plan.edge import CHECK
from components.scripts.node_contract import VllmState
from tests.e2e.cli_stack import StackError
from tests.e2e.rehearsal import chat, compile_factors, rehearsal_config
from tests.waiting import wait_for, wait_until

pytestmark = pytest.mark.e2e

FAST_RECOVERY = {"maxRestarts": 3, "windowSeconds": 120, "backoffSeconds": 1, "maxBackoffSeconds": 4}
STANDIN_STATE = "/var/lib/spark-vllm-standin"  # the rehearsal image's GB10 switch and meminfo (its README)


def serves(outputs, key) -> bool:
    try:
        chat(outputs["endpoint"], key, outputs["servedModelName"])
        return True
    except Exception:  # noqa: BLE001 - not yet
        return False


def supervisor_status(cluster, node) -> dict:
    return json.loads(cluster.container_file(node, f"spark-vllm-{node.name}", "/run/spark-vllm/status.json"))


def vllm_pids(cluster, nodes) -> dict[str, int]:
    return {node.name: supervisor_status(cluster, node)["vllm_pid"] for node in nodes}


def edge_settles_seconds(check: str = CHECK) -> float:
    """The longest the edge may take to agree with a vLLM that came back (components/plan/edge.py CHECK): up to
    `inter` until its next check sees the old one gone, `fall - 1` more checks `fastinter` apart until it is marked
    down, then `rise` answers `downinter` apart until it is up. A chat in that while may be answered (haproxy retries
    the connection while it still counts the server up) and the next one get the edge's 503."""
    words = check.split()
    value = {key: words[words.index(key) + 1] for key in ("inter", "fastinter", "downinter", "fall", "rise")}
    seconds = {key: float(value[key].rstrip("s")) for key in ("inter", "fastinter", "downinter")}
    return (
        seconds["inter"] + (int(value["fall"]) - 1) * seconds["fastinter"] + int(value["rise"]) * seconds["downinter"]
    )


def recovered(cluster, stack, nodes, before: dict[str, int], started: float, timeout=240.0) -> float:
    """Seconds from `started` until vLLM runs anew on every one of `nodes` (another pid than `before`) and the
    endpoint answers chats from then on: the first answer of a run of them over `edge_settles_seconds()` (one
    answer alone was not enough: the next chat got the edge's 503 while its checks caught up, three CI runs and a
    stress run of test_stalls.py, 2026-12-07); fails the test after `timeout`."""
    outputs, key = stack["run"].outputs, stack["secrets"]["apiKey"]
    deadline = started + timeout

    def anew():  # an error: the container or its daemon is coming back
        now = vllm_pids(cluster, nodes)
        return all(now[n] not in (None, before[n]) for n in before)

    wait_until(anew, max(0.0, deadline - time.monotonic()), "vLLM anew on every node", every=0.5, errors=(Exception,))
    steady, since, answers = edge_settles_seconds(), None, []
    while time.monotonic() < deadline:
        ok, now = serves(outputs, key), time.monotonic()
        answers = (answers + [ok])[-20:]
        since = (since or now) if ok else None
        if since is not None and now - since >= steady:
            return since - started
        time.sleep(0.5)
    raise AssertionError(f"waited {timeout:g} s for the endpoint to answer chats for {steady:g} s in a row once vLLM "
                         f"ran anew on every node; the last chats answered: {answers}")  # fmt: skip


def kill_vllm(cluster, node) -> float:
    pid = supervisor_status(cluster, node)["vllm_pid"]
    cluster.docker(node, "exec", f"spark-vllm-{node.name}", "kill", "-9", str(pid))
    return time.monotonic()


def restart_dockerd(cluster, node) -> None:
    """What a reboot does to the node's containers: the daemon goes, and comes back."""
    cluster.stop_dockerd(node)
    cluster.start_dockerd(node)


def container_ids(cluster) -> dict[str, str]:
    return {
        node.name: cluster.docker(node, "ps", "-q", "--no-trunc", "--filter", "label=spark-vllm.node").stdout.strip()
        for node in cluster.nodes
    }


def run_status_command(cluster, command: str) -> str:
    """The statusCommand output as a user runs it: their ssh (here the cluster's key and host keys)."""
    result = subprocess.run(["sh", "-c", command], env=cluster.ssh_env(), capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def stack(sim_cluster, image, model_dir, new_stack):
    created = new_stack("recovery")
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir, executor="mp", recovery=FAST_RECOVERY)
    created.configure(config, secrets)
    run = created.up()
    return {"stack": created, "config": config, "secrets": secrets, "run": run}


def test_mp_serves_with_a_rank_on_every_node(sim_cluster, stack):
    outputs, key = stack["run"].outputs, stack["secrets"]["apiKey"]
    assert outputs["executor"] == "mp" and outputs.get("rayAddress") is None
    assert serves(outputs, key)
    head, worker = sim_cluster.nodes
    log = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    assert f"node rank 1 joined from {worker.fabric_ip} (VLLM_HOST_IP {worker.fabric_ip})" in log  # over the fabric
    assert "--distributed-executor-backend=mp --nnodes=2 --node-rank=0" in log
    worker_log = sim_cluster.docker(worker, "exec", "spark-vllm-node-2", "cat", "/run/spark-vllm/vllm.log").stdout
    assert "--node-rank=1" in worker_log and "--headless" in worker_log
    for node in sim_cluster.nodes:  # no Ray anywhere
        processes = sim_cluster.docker(node, "exec", f"spark-vllm-{node.name}", "ps", "-eo", "args").stdout
        assert "raylet" not in processes and "gcs_server" not in processes


def test_mp_the_api_key_is_taken_out_of_the_heads_compile_cache_metadata(sim_cluster, stack):
    """With mp the head's workers have the API server's environment, the key with it, and vLLM 0.25 writes
    its raw value into cache_key_factors.json (the stand-in's engine core does too): the supervisor puts a
    mark in its place."""
    key = stack["secrets"]["apiKey"]
    head, worker = sim_cluster.nodes
    assert wait_for(lambda: "<redacted by spark-vllm>" in json.dumps(compile_factors(sim_cluster, head)), 30)
    assert [found["env"]["VLLM_API_KEY"] for found in compile_factors(sim_cluster, head)] == [
        "<redacted by spark-vllm>"
    ]
    # the headless rank serves no API: it is never given the key, so its factors have none to leave
    assert [found["env"].get("VLLM_API_KEY") for found in compile_factors(sim_cluster, worker)] == [None]
    for node in sim_cluster.nodes:
        assert key not in json.dumps(compile_factors(sim_cluster, node))


def test_mp_a_killed_worker_rank_recovers_by_itself(sim_cluster, stack):
    """Rank 0 loses its peer and exits too: both supervisors restart their rank, they meet again."""
    before = vllm_pids(sim_cluster, sim_cluster.nodes)
    started = kill_vllm(sim_cluster, sim_cluster.nodes[1])
    seconds = recovered(sim_cluster, stack, sim_cluster.nodes, before, started)
    print(f"\nRECOVERY mp, vLLM killed on a worker: serving again after {seconds:.1f} s")
    assert supervisor_status(sim_cluster, sim_cluster.nodes[1])["restarts_total"] >= 1


def test_mp_a_worker_whose_dockerd_restarts_rejoins_by_itself(sim_cluster, stack):
    before = vllm_pids(sim_cluster, sim_cluster.nodes)
    started = time.monotonic()
    restart_dockerd(sim_cluster, sim_cluster.nodes[1])
    seconds = recovered(sim_cluster, stack, sim_cluster.nodes, before, started)
    print(f"\nRECOVERY mp, a worker's dockerd restarted: serving again after {seconds:.1f} s")


def test_an_up_after_a_recovery_changes_nothing(stack):
    assert stack["stack"].preview().changed == {}
    assert stack["stack"].up().changed == {}


def test_the_status_command_shows_every_node(sim_cluster, stack):
    output = run_status_command(sim_cluster, stack["stack"].outputs()["statusCommand"])
    for node in ("node-1", "node-2"):
        assert f"== {node}" in output
    assert "container running, restarted by Docker" in output
    assert "vLLM: running, serving: yes" in output  # the head
    assert "restarts: " in output


def test_switching_to_ray_is_one_up_and_its_preview_says_what_is_replaced(sim_cluster, stack):
    config = {**stack["config"], "executor": "ray"}
    stack["stack"].configure(config, stack["secrets"])
    # node-2-serve (the headless rank's step) is deleted before its container's delete-before-replace, as a
    # step of that replacement (`delete-replaced`, nothing in its place): the plain `--diff` folds such steps into
    # the replacement and names nothing; `--show-replacement-steps` names it (docs/how-it-works.md)
    preview = stack["stack"].preview("--show-replacement-steps")
    assert preview.changed["node-1-container"] == "replace" and preview.changed["node-2-container"] == "replace"
    assert preview.changed["spark-vllm-cluster-ready"] == "create" and preview.changed["node-2-serve"] == "delete"
    assert re.search(r"\(delete-replaced\)\n.*\n.*::node-2-serve\]", preview.output), preview.output
    assert not any(name.endswith(("-image", "-docker", "-pull")) for name in preview.changed)
    run = stack["stack"].up()
    assert run.outputs["executor"] == "ray" and serves(run.outputs, stack["secrets"]["apiKey"])
    stack.update(config=config, run=run)


def test_ray_a_killed_vllm_recovers_by_itself(sim_cluster, stack):
    """A SIGKILL of vLLM's API server alone, as the OOM killer sends it: its engine core (the stand-in's,
    like real vLLM's) lives on holding the GPU, and a restart works only once the supervisor ended it."""
    head = sim_cluster.nodes[0]
    before = vllm_pids(sim_cluster, [head])
    started = kill_vllm(sim_cluster, head)
    seconds = recovered(sim_cluster, stack, [head], before, started)
    print(f"\nRECOVERY ray, vLLM killed on the head: serving again after {seconds:.1f} s")
    log = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    ended = [line for line in log.splitlines() if "ending what it left running" in line]
    assert ended and "VLLM::EngineCor" in ended[-1]


def test_ray_a_worker_whose_dockerd_restarts_rejoins_by_itself(sim_cluster, stack):
    containers, head = container_ids(sim_cluster), sim_cluster.nodes[0]
    before = vllm_pids(sim_cluster, [head])
    started = time.monotonic()
    restart_dockerd(sim_cluster, sim_cluster.nodes[1])
    seconds = recovered(sim_cluster, stack, [head], before, started)  # vLLM's Ray worker there died
    print(f"\nRECOVERY ray, a worker's dockerd restarted: serving again after {seconds:.1f} s")
    assert container_ids(sim_cluster) == containers  # the same containers, restarted by Docker
    assert stack["stack"].preview().changed == {}


def pretend_unified(cluster, node, total_gib: int, available_gib: int) -> None:
    """The node's container as a GB10's: nvidia-smi reports no memory sizes ([N/A]), and the meminfo the
    supervisor reads says MemTotal and MemAvailable (written whole, then moved over the last)."""
    total, available = total_gib * 2**20, available_gib * 2**20  # kB, as the kernel writes them
    text = f"MemTotal: {total} kB\nMemFree: {available} kB\nMemAvailable: {available} kB\n"
    script = (
        f"touch {STANDIN_STATE}/unified && printf %s {shlex.quote(text)} > {STANDIN_STATE}/meminfo.new && "
        f"mv -f {STANDIN_STATE}/meminfo.new {STANDIN_STATE}/meminfo"
    )
    cluster.docker(node, "exec", f"spark-vllm-{node.name}", "sh", "-c", script)


def pretend_no_gpu(cluster, node) -> None:
    script = f"rm -f {STANDIN_STATE}/unified && ln -sfn /proc/meminfo {STANDIN_STATE}/meminfo"
    cluster.docker(node, "exec", f"spark-vllm-{node.name}", "sh", "-c", script)


def status_when(cluster, node, state: VllmState, timeout: float) -> dict:
    """The node's supervisor status once it is in `state`; fails the test with the last one seen."""
    seen: dict = {}

    def arrived():
        seen.update(supervisor_status(cluster, node))
        return VllmState(seen["state"]) is state and dict(seen)

    return wait_until(arrived, timeout, f"{node.name}'s supervisor {state!r}", every=0.2, seen=lambda: seen)


def vllm_log(cluster, node) -> str:
    return cluster.container_file(node, f"spark-vllm-{node.name}", "/run/spark-vllm/vllm.log")


def test_on_unified_memory_the_oom_guard_ends_vllm_and_restarts_wait_for_the_memory(sim_cluster, stack):
    """A GB10's crash loop (eugr/spark-vllm-docker #257), with the head's container made to look like one:
    memory.oomGuard ends vLLM when MemAvailable falls under memory.osReserveGib; the restart waits until
    MemAvailable holds gpuMemoryUtilization x MemTotal again, then serves; memory that does not come back
    within recovery.gpuWaitSeconds ends the loop, and the status says to reboot the node."""
    head = sim_cluster.nodes[0]
    outputs_key = stack["secrets"]["apiKey"]
    guarded = {
        **stack["config"],
        "memory": {"oomGuard": True, "osReserveGib": 8},
        "recovery": {**FAST_RECOVERY, "maxRestarts": 10, "gpuWaitSeconds": 20},
    }
    pretend_unified(sim_cluster, head, total_gib=128, available_gib=100)
    try:
        stack["stack"].configure(guarded, stack["secrets"])
        preview = stack["stack"].preview()
        assert preview.changed and not any(name.endswith("-container") for name in preview.changed)
        run = stack["stack"].up()  # vLLM restarts with the guard: 100 GiB available, 64 asked (0.5 x 128)
        assert serves(run.outputs, outputs_key)
        stack.update(run=run)

        # MemAvailable under the reserve: the guard ends vLLM, and the restart waits for the memory
        before = vllm_pids(sim_cluster, [head])
        pretend_unified(sim_cluster, head, total_gib=128, available_gib=4)
        started = time.monotonic()
        waiting = status_when(sim_cluster, head, VllmState.WAITING_MEMORY, timeout=30)
        assert waiting["oom_guarded"] == 1 and waiting["vllm_pid"] is None
        assert "unified memory: 4.0 of 128.0 GiB available (MemAvailable), vLLM asks for 64.0" in waiting["gpu_busy"]
        log = vllm_log(sim_cluster, head)
        assert "memory.oomGuard: MemAvailable 4.0 GiB is under the OS's reserve (8.0 GiB" in log
        output = run_status_command(sim_cluster, stack["stack"].outputs()["statusCommand"])
        assert (
            "vLLM: waiting for GPU memory, serving: no" in output and "waiting: unified memory: 4.0 of 128.0" in output
        )
        pretend_unified(sim_cluster, head, total_gib=128, available_gib=100)  # the memory is back
        seconds = recovered(sim_cluster, stack, [head], before, started)
        print(f"\nRECOVERY unified memory: oomGuard ended vLLM, memory back, serving again after {seconds:.1f} s")

        # memory that does not come back: the loop ends, and says what it means on a GB10
        pretend_unified(sim_cluster, head, total_gib=128, available_gib=4)
        failed = status_when(sim_cluster, head, VllmState.FAILED, timeout=90)
        assert failed["oom_guarded"] == 2
        assert "recovery.gpuWaitSeconds 20" in failed["failed"] and "reboot the node" in failed["failed"]
        output = run_status_command(sim_cluster, stack["stack"].outputs()["statusCommand"])
        assert "GAVE UP: the GPU stayed busy" in output and "reboot the node" in output
    finally:
        pretend_no_gpu(sim_cluster, head)
    stack["stack"].configure(stack["config"], stack["secrets"])  # the guard off again: vLLM starts anew
    run = stack["stack"].up()
    assert serves(run.outputs, outputs_key)
    stack.update(run=run)


def test_a_setting_vllm_refuses_at_start_ends_the_loop_at_once_and_the_status_says_why(sim_cluster, stack):
    """An unknown flag is refused by vLLM's parser at every start: the supervisor does not restart it
    (it would be refused again), and `pulumi up` fails with vLLM's own reason in the first seconds."""
    broken = {**stack["config"], "vllm": {**stack["config"]["vllm"], "extraArgs": ["--no-such-flag"]}}
    stack["stack"].configure(broken, stack["secrets"])
    started = time.monotonic()
    with pytest.raises(StackError) as caught:
        stack["stack"].up()
    message = str(caught.value)
    assert "vLLM refused its settings while starting" in message and "unrecognized arguments: --no-such-flag" in message
    print(
        f"\nRECOVERY a start refusal ended the loop after {time.monotonic() - started:.1f} s (up failed with the reason)"
    )
    status = supervisor_status(sim_cluster, sim_cluster.nodes[0])
    assert VllmState(status["state"]) is VllmState.FAILED and status["vllm_pid"] is None
    assert status["restarts_in_window"] == 0  # no restart counted for these settings (earlier tests restarted others)
    running = sim_cluster.docker(sim_cluster.nodes[0], "inspect", "-f", "{{.State.Running}}", "spark-vllm-node-1")
    assert running.stdout.strip() == "true"  # the container stays up
    output = run_status_command(sim_cluster, stack["stack"].outputs()["statusCommand"])
    assert "GAVE UP: vLLM refused its settings while starting" in output
    # mended in the config, it serves again
    stack["stack"].configure(stack["config"], stack["secrets"])
    run = stack["stack"].up()
    assert serves(run.outputs, stack["secrets"]["apiKey"])


def test_the_edge_agrees_with_a_vllm_back_within_its_checks_timings():
    assert edge_settles_seconds("check inter 5s fastinter 1s downinter 1s fall 2 rise 1") == 7.0
    assert edge_settles_seconds("check inter 10s fastinter 2s downinter 3s fall 3 rise 2") == 10 + 2 * 2 + 2 * 3
    assert edge_settles_seconds() >= 5  # the edge's own CHECK
