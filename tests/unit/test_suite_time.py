"""benchmarks/suite_time.py reads pytest's JUnit report and the rehearsal's command timings as they are written."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.suite_time import (
    CpuSampler,
    _kind,
    command_kinds,
    failed_tests,
    file_cpu,
    module_seconds,
    slowest_tests,
    worker_spans,
)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.e2e.test_deployments" name="test_a" time="10.5"/>
<testcase classname="tests.e2e.test_deployments" name="test_b" time="2.5"/>
<testcase classname="tests.unit.test_x.TestGroup" name="test_c" time="0.25"/>
</testsuite></testsuites>"""


def test_module_seconds_add_up_per_file_a_class_in_its_file(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert module_seconds(path) == {"tests/e2e/test_deployments.py": 13.0, "tests/unit/test_x.py": 0.25}


def test_pulumi_commands_are_counted_by_kind_with_the_slowest_and_its_test(tmp_path):
    path = tmp_path / "timings.jsonl"
    lines = [{"test": "t1", "command": "up", "seconds": 50.0}, {"test": "t2", "command": "up", "seconds": 80.5},
             {"test": "t2", "command": "destroy", "seconds": 12.0, "failed": True}]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines))
    kinds = command_kinds(path)
    assert kinds["up"] == {"count": 2, "seconds": 130.5, "slowest": (80.5, "t2")}
    assert kinds["destroy"]["count"] == 1 and command_kinds(tmp_path / "none") == {}


def test_the_stress_run_names_each_test_that_failed_or_errored(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT.replace('name="test_b" time="2.5"/>', 'name="test_b" time="2.5"><error message="setup"/></testcase>')
                    .replace('name="test_c" time="0.25"/>', 'name="test_c" time="0.25"><failure message="x"/></testcase>'))  # fmt: skip
    assert failed_tests(path) == ["tests.e2e.test_deployments::test_b", "tests.unit.test_x.TestGroup::test_c"]
    path.write_text(JUNIT)
    assert failed_tests(path) == []


def test_the_slowest_tests_come_first_with_their_module_and_name(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert slowest_tests(path, count=2) == [(10.5, "tests.e2e.test_deployments::test_a"),
                                            (2.5, "tests.e2e.test_deployments::test_b")]  # fmt: skip


def test_processes_are_told_apart_by_their_command_lines():
    assert _kind("/work/x/.toolchain/bin/pulumi --non-interactive up --yes") == "pulumi CLI and engine"
    assert _kind("/work/x/.toolchain/bin/pulumi-resource-docker 127.0.0.1:4") == "provider plugins (command, docker)"
    assert (
        _kind("python -u .toolchain/bin/pulumi-language-python-exec --monitor x")
        == "the program (language host, __main__.py)"
    )
    assert _kind("/opt/site/ray/core/src/ray/raylet/raylet --raylet_socket_name=x").startswith("Ray")
    assert _kind("/usr/sbin/dockerd --config-file x").startswith("dockerd")
    assert _kind("/work/x/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))").startswith("pytest")
    assert _kind("python3 -") == "other Python (on the nodes and in tests)"
    assert _kind("nft list table") == "other"


def test_the_sampler_counts_a_busy_child_and_not_what_ran_before_it_started():
    sampler = CpuSampler(interval=0.1)
    sampler.start()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"],
                   check=True)  # fmt: skip
    time.sleep(0.05)
    kinds = sampler.stop()
    assert kinds.get("other Python (on the nodes and in tests)", 0) + kinds["short-lived (under a sample)"] >= 0.5
    assert sampler.busy >= 0.5
    assert any("python" in command for _, _, command in sampler.busiest())


def test_each_test_files_cpu_adds_its_tests_own_and_their_childrens(tmp_path):
    path = tmp_path / "cpu.jsonl"
    lines = [{"test": "tests/unit/test_a.py::test_x", "own": 1.5, "children": 2.0},
             {"test": "tests/unit/test_a.py::test_y[1]", "own": 0.5, "children": 0.0},
             {"test": "tests/unit/test_b.py::T::test_z", "own": 0.25, "children": 4.0}]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert file_cpu(path) == {"tests/unit/test_a.py": (2.0, 2.0), "tests/unit/test_b.py": (0.25, 4.0)}
    assert file_cpu(tmp_path / "none") == {}


def test_a_test_run_with_the_cpu_file_set_writes_its_line_with_a_busy_child_counted(tmp_path):
    """tests/conftest.py's hook, through a real pytest run of one test that burns a child's CPU."""
    test = tmp_path / "test_burn.py"
    test.write_text(
        "import subprocess, sys\n"
        "def test_burn():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass'], check=True)\n"
    )
    out = tmp_path / "cpu.jsonl"
    conftest_dir = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}  # one process
    env["SPARK_VLLM_TEST_CPU"] = str(out)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "--confcutdir", str(conftest_dir.parent), "-c", "/dev/null", "-p", "tests.conftest", str(test)],
        capture_output=True, text=True, cwd=conftest_dir.parent, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert line["test"].endswith("test_burn.py::test_burn") and line["children"] >= 0.25
    assert line["worker"] == "main" and line["end"] - line["start"] >= 0.25


def test_each_test_process_is_shown_from_its_first_test_to_its_last_with_the_file_it_ended_with(tmp_path):
    path = tmp_path / "cpu.jsonl"
    lines = [{"test": "tests/e2e/test_a.py::test_x", "own": 1, "children": 2, "worker": "gw0", "start": 1000.0, "end": 1300.0},
             {"test": "tests/unit/test_b.py::test_y", "own": 1, "children": 0, "worker": "gw1", "start": 1002.0, "end": 1010.0},
             {"test": "tests/unit/test_c.py::test_z", "own": 1, "children": 0, "worker": "gw1", "start": 1010.0, "end": 1100.0},
             {"test": "tests/unit/test_old.py::test_w", "own": 1, "children": 0}]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines))
    spans = worker_spans(path)
    assert spans == {"gw0": {"start": 0.0, "end": 300.0, "tests": 300.0, "last": "tests/e2e/test_a.py"},
                     "gw1": {"start": 2.0, "end": 100.0, "tests": 98.0, "last": "tests/unit/test_c.py"}}  # fmt: skip
    assert worker_spans(tmp_path / "none") == {}


def test_the_sampler_counts_the_cores_idle_time_minute_by_minute():
    """One minute's entry for a run of under a minute, never negative and never more than the cores had."""
    sampler = CpuSampler(interval=0.1)
    sampler.start()
    time.sleep(0.6)
    sampler.stop()
    (idle,) = sampler.idle_by_minute
    assert 0 <= idle <= 0.8 * os.cpu_count()


def test_every_rehearsal_module_has_its_place_in_the_longest_first_order():
    """tests/conftest.py hands the rehearsal's modules out longest first; a module it does not list goes last,
    where one of 300 s (the GPU recipe's, unlisted until 2026-12-06) ends the run alone."""
    from tests.conftest import LONGEST_FIRST

    root = Path(__file__).resolve().parents[2]
    modules = {str(path.relative_to(root)) for path in (root / "tests" / "e2e").rglob("test_*.py")}
    modules -= {str(path.relative_to(root)) for path in (root / "tests" / "e2e" / "standin").rglob("test_*.py")}
    modules -= {"tests/e2e/image/test_build_unit.py"}  # the fast lane's
    assert all((root / path).is_file() for path in LONGEST_FIRST), LONGEST_FIRST
    assert modules <= set(LONGEST_FIRST), sorted(modules - set(LONGEST_FIRST))


def test_a_shared_program_run_is_made_once_a_session_for_every_process_that_asks(tmp_path, monkeypatch):
    """tests/harness.py shares a run across the xdist workers of a session: who asks while it is made waits for it
    (threads here, each with its own lock file handle as a process has), who asks later reads it."""
    import threading

    from tests import harness

    monkeypatch.setenv(harness.SHARED_RUNS_ENV, str(tmp_path))
    made = []

    def make():
        made.append(1)
        time.sleep(0.2)
        return harness.ProgramRun(registrations=[], exports={"endpoint": "http://a:30000/v1"}, secret_exports={"x"})

    got = []
    threads = [threading.Thread(target=lambda: got.append(harness._across_processes("key", make))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len(got) == 4
    assert all(run.exports == {"endpoint": "http://a:30000/v1"} and run.secret_exports == {"x"} for run in got)
    assert harness._across_processes("another key", make).exports and len(made) == 2  # a key of its own
    monkeypatch.delenv(harness.SHARED_RUNS_ENV)
    harness._across_processes("key", make)  # no session folder: the process's own run
    assert len(made) == 3


def test_a_stacks_project_runs_the_checkouts_venv_by_its_own_path(tmp_path):
    """The rehearsal's project directories name the venv by its path, not through a link of their own: the bytecode
    cache is keyed by path, and each link made every stack's first program run compile the venv again."""
    from tests.e2e.cli_stack import ROOT, RehearsalStack

    stack = RehearsalStack(tmp_path / "deployer")
    written = (stack.project_dir / "Pulumi.yaml").read_text()
    assert f"    virtualenv: {ROOT / 'venv'}\n" in written and "virtualenv: venv\n" not in written
    assert written.replace(str(ROOT / "venv"), "venv") == (ROOT / "Pulumi.yaml").read_text()  # nothing else differs
    assert not (stack.project_dir / "venv").exists()
    assert (stack.project_dir / "components").resolve() == ROOT / "components"


def test_bytecode_of_earlier_sessions_stacks_is_pruned_and_the_current_sessions_kept(tmp_path, monkeypatch):
    from tests.e2e.cli_stack import prune_stale_bytecode

    prefix = tmp_path / "pycache"
    basetemp = tmp_path / "tmp" / "pytest-of-root" / "pytest-7" / "popen-gw1"
    basetemp.mkdir(parents=True)
    mirror = prefix / basetemp.parents[1].relative_to("/")
    for session in ("pytest-5", "pytest-6", "pytest-7"):
        (mirror / session / "popen-gw0" / "deployer-0").mkdir(parents=True)
    (mirror.parent / "elsewhere").mkdir()
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    prune_stale_bytecode(basetemp)
    assert sorted(path.name for path in mirror.iterdir()) == ["pytest-7"]
    assert (mirror.parent / "elsewhere").is_dir()  # only the sessions' mirrors are touched
    monkeypatch.setattr(sys, "pycache_prefix", None)
    prune_stale_bytecode(basetemp)  # no prefix: nothing to do
    assert (mirror / "pytest-7").is_dir()


def test_a_secret_set_before_with_the_same_value_is_kept_in_the_stack_file_and_not_set_again(tmp_path, monkeypatch):
    """Each `pulumi config set --secret` is a CLI start that derives the passphrase's key (0.3 CPU-s); a configure
    with secrets unchanged sets none of them again, and what the stack's file holds stays encrypted and whole."""
    import yaml

    from tests.e2e.cli_stack import PROJECT, RehearsalStack

    stack = RehearsalStack(tmp_path / "deployer")
    calls: list[tuple[str, str]] = []

    def config_set(*args, stdin=None, check=True):  # what the CLI does to the file, the value "encrypted"
        assert args[:3] == ("config", "set", "--secret") and stdin is not None
        calls.append((args[-1], stdin))
        document = yaml.safe_load(stack.config_file.read_text())
        head, _, sub = args[-1].partition(".")
        entry = {"secure": f"v1:{stdin[::-1]}"}
        if sub:
            document["config"].setdefault(f"{PROJECT}:{head}", {})[sub] = entry
        else:
            document["config"][f"{PROJECT}:{head}"] = entry
        stack.config_file.write_text(yaml.safe_dump(document, sort_keys=False))

    monkeypatch.setattr(stack, "cli", config_set)
    secrets = {"apiKey": "sk-one", "apiKeys": {"alice": "sk-alice", "bob": "sk-bob"}, "hfToken": "hf_x"}
    stack.configure({"image": "a"}, secrets)
    assert sorted(calls) == [("apiKey", "sk-one"), ("apiKeys.alice", "sk-alice"), ("apiKeys.bob", "sk-bob"),
                             ("hfToken", "hf_x")]  # fmt: skip
    first = yaml.safe_load(stack.config_file.read_text())["config"]
    calls.clear()
    stack.configure({"image": "b"}, secrets)
    after = yaml.safe_load(stack.config_file.read_text())["config"]
    assert calls == [] and after == {**first, f"{PROJECT}:image": "b"}
    stack.configure({"image": "b"}, {**secrets, "apiKeys": {"alice": "sk-alice"}, "hfToken": "hf_y"})
    assert sorted(calls) == [("apiKeys.alice", "sk-alice"), ("hfToken", "hf_y")]  # a map that changed: set anew
    assert yaml.safe_load(stack.config_file.read_text())["config"][f"{PROJECT}:apiKeys"] == {
        "alice": {"secure": "v1:ecila-ks"}}  # fmt: skip
    calls.clear()
    document = yaml.safe_load(stack.config_file.read_text())
    document["config"][f"{PROJECT}:hfToken"] = "hf_y"  # `config set --plaintext`: not kept as a secret
    stack.config_file.write_text(yaml.safe_dump(document, sort_keys=False))
    stack.configure({"image": "b"}, {**secrets, "apiKeys": {"alice": "sk-alice"}, "hfToken": "hf_y"})
    assert calls == [("hfToken", "hf_y")]


def test_a_stack_writes_its_state_once_a_command_only_when_asked_and_as_a_user_by_default(tmp_path):
    """The tests' stacks skip the engine's checkpoint after every step (tests/e2e/conftest.py new_stack); a stack made
    as a user's CLI runs, the README's path and the main job included, keeps them."""
    from tests.e2e.cli_stack import RehearsalStack

    assert "PULUMI_SKIP_CHECKPOINTS" not in RehearsalStack(tmp_path / "user").env
    assert RehearsalStack(tmp_path / "test", checkpoints=False).env["PULUMI_SKIP_CHECKPOINTS"] == "true"


def test_an_ups_outputs_come_from_its_event_log_unless_a_value_there_is_not_plain(tmp_path, monkeypatch):
    """`pulumi stack output --show-secrets` after every `up` is a CLI start deriving the passphrase's key: the
    stack's outputs event in the up's own log holds them, except a secret (blinded there), an asset or a reference;
    with one of those, or no such event (a phase that only previewed), the CLI is asked."""
    from pulumi import automation as auto

    from tests.e2e.cli_stack import SIGNATURE_KEY, RehearsalStack, _Events

    def outputs_event(outputs):
        urn = "urn:pulumi:dev::spark-vllm::pulumi:pulumi:Stack::spark-vllm-dev"
        meta = {"op": "same", "urn": urn, "type": "pulumi:pulumi:Stack", "provider": "",
                "new": {"type": "pulumi:pulumi:Stack", "urn": urn, "id": "", "parent": "", "provider": "",
                        "custom": False, "delete": False, "protect": False, "outputs": outputs, "inputs": {}}}  # fmt: skip
        return auto.EngineEvent.from_json({"sequence": 1, "timestamp": 1, "resOutputsEvent": {"metadata": meta}})

    stack = RehearsalStack(tmp_path / "deployer")
    asked = []
    monkeypatch.setattr(stack, "outputs", lambda show_secrets=False: asked.append(show_secrets) or {"from": "cli"})
    plain = {"endpoint": "http://10.0.0.1:8000/v1", "memoryPlan": {"m": {"kvCache": {"pinnedGib": 1.5}}}, "n": [1]}
    events = _Events()
    events(outputs_event(plain))
    assert stack._outputs_after(events) == plain and asked == []
    secret = {SIGNATURE_KEY: "1b47061264138c4ac30d75fd1eb44270", "ciphertext": "[secret]"}
    for special in ({**plain, "routerSmoke": secret}, {**plain, "deep": [{"x": secret}]}):
        events = _Events()
        events(outputs_event(special))
        assert stack._outputs_after(events) == {"from": "cli"}
    events(auto.EngineEvent.from_json({"sequence": 2, "timestamp": 2, "preludeEvent": {"config": {}}}))
    assert events.stack_outputs is None and stack._outputs_after(events) == {"from": "cli"}
    assert asked == [True, True, True] and stack.outputs_read_by_cli == 3


# What Pulumi v3.276.0's CLI wrote (2026-12-07): `pulumi stack init vec`, then `printf 'sk-written-by-the-cli' |
# pulumi config set --secret apiKey` and `printf 'line one\nline two' | pulumi config set --secret --path tls.key`,
# with the rehearsal's passphrase.
CLI_WRITTEN = {
    "encryptionsalt": "v1:+aStHrkBkCM=:v1:tt5xQHUa913ZB/Lw:GvY/1gBRNeSGBowhTjig1Ct+KsIwmw==",
    "apiKey": "v1:5tMrJIerxaIZzhhj:wKOmImCAGtg8m+PeAplKwk8WiK6aaWYbhpwtHCY0DF8FndIF+Q==",
    "tls.key": "v1:qSWRA1lCI8j9g+2H:9qjDoe8RYc9fyZYG5ZtokGpasT9LYjx6QrArGsm9Mu4Q",
}


def test_the_tests_stacks_write_their_secrets_as_the_cli_does_and_start_no_cli_for_them(tmp_path, monkeypatch):
    """A test's stack (not the README's path) writes each secret into its stack file encrypted as `pulumi config set
    --secret` does, under one salt a process: each such command was a CLI start deriving the passphrase's key. The
    key and format are the CLI's: what it wrote decrypts, and what is written here decrypts under its salt (the
    rehearsal's every `up` then reads them with the real CLI)."""
    import yaml

    from tests.e2e import cli_stack
    from tests.e2e.cli_stack import PROJECT, RehearsalStack

    written_by_cli = cli_stack._passphrase_key(CLI_WRITTEN["encryptionsalt"])
    assert cli_stack._decrypt(written_by_cli, CLI_WRITTEN["apiKey"]) == "sk-written-by-the-cli"
    assert cli_stack._decrypt(written_by_cli, CLI_WRITTEN["tls.key"]) == "line one\nline two"
    monkeypatch.setattr(cli_stack, "_KEYS", {})
    monkeypatch.setattr(cli_stack, "PASSPHRASE", "another")
    with pytest.raises(AssertionError, match="not this passphrase's"):
        cli_stack._passphrase_key(CLI_WRITTEN["encryptionsalt"])
    monkeypatch.undo()

    stack = RehearsalStack(tmp_path / "deployer", typed=False)
    assert stack.env["PULUMI_BACKEND_URL"] == f"file://{stack.backend}"  # no `pulumi login`
    assert "PULUMI_BACKEND_URL" not in RehearsalStack(tmp_path / "user").env
    calls = []
    monkeypatch.setattr(stack, "cli", lambda *args, **kwargs: calls.append(args))
    stack.init()
    assert calls == [("stack", "init", "rehearsal")]  # a stack the backend does not hold yet
    salt = yaml.safe_load(stack.config_file.read_text())["encryptionsalt"]
    assert salt == cli_stack.process_salt()  # `stack init` keeps a salt it finds (manager.go)
    secrets = {"apiKey": "sk-one", "apiKeys": {"alice": "sk-alice"}, "sshPrivateKey": "-----BEGIN…\nkey\n"}
    stack.configure({"image": "a"}, secrets)
    document = yaml.safe_load(stack.config_file.read_text())
    aes = cli_stack._passphrase_key(document["encryptionsalt"])
    found = document["config"]
    assert found[f"{PROJECT}:image"] == "a" and calls == [("stack", "init", "rehearsal")]
    assert cli_stack._decrypt(aes, found[f"{PROJECT}:apiKey"]["secure"]) == "sk-one"
    assert cli_stack._decrypt(aes, found[f"{PROJECT}:apiKeys"]["alice"]["secure"]) == "sk-alice"
    assert cli_stack._decrypt(aes, found[f"{PROJECT}:sshPrivateKey"]["secure"]) == "-----BEGIN…\nkey\n"
    assert "sk-one" not in stack.config_file.read_text()
    stack.configure({"image": "b"}, {**secrets, "apiKey": "sk-two"})  # one changed: written anew, the rest kept
    again = yaml.safe_load(stack.config_file.read_text())["config"]
    assert cli_stack._decrypt(aes, again[f"{PROJECT}:apiKey"]["secure"]) == "sk-two"
    assert again[f"{PROJECT}:apiKeys"] == found[f"{PROJECT}:apiKeys"]
    (stack.backend / ".pulumi" / "stacks" / PROJECT).mkdir(parents=True)
    (stack.backend / ".pulumi" / "stacks" / PROJECT / "rehearsal.json").write_text("{}")
    stack.init()  # the backend holds it now: selected, and the salt the file has is kept
    assert calls[-1] == ("stack", "select", "rehearsal")
    assert yaml.safe_load(stack.config_file.read_text())["encryptionsalt"] == salt


def test_python3_goes_past_a_shim_to_the_interpreter_and_is_left_alone_where_it_is_one(tmp_path):
    from tests.conftest import python3_past_a_shim

    shims, plain, interpreter = tmp_path / "shims", tmp_path / "plain", os.path.realpath(sys._base_executable)
    shims.mkdir()
    plain.mkdir()
    (shims / "python3").write_text('#!/usr/bin/env bash\nexec pyenv exec "$0" "$@"\n')
    (shims / "python3").chmod(0o755)
    os.symlink(interpreter, plain / "python3")
    folder = python3_past_a_shim(f"{shims}:{plain}", interpreter)
    assert folder and os.path.realpath(os.path.join(folder, "python3")) == interpreter
    assert python3_past_a_shim(f"{shims}:{plain}", interpreter) == folder  # made once
    assert python3_past_a_shim(f"{plain}:{shims}", interpreter) is None
    assert python3_past_a_shim(str(tmp_path / "nothing"), interpreter) is None
    # this session's PATH, as pytest_configure left it: python3 is the venv's interpreter, shim or none before it
    assert os.path.realpath(shutil.which("python3")) == interpreter
