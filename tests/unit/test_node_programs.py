"""components/scripts as a package with ordinary imports, and the programs that carry it to a node
(components/plan/programs.py, components/scripts/node_loader.py): each program is its entry script and the modules
its imports reach, found from the imports themselves, run by a standard-library loader on a python3 that has no
`components` package, its parameters inside the program text."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from components.plan import programs
from components.plan.programs import ENTRY, imported, node_modules, program_of, script, script_chain, script_program

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "components" / "scripts"
PYTHON_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "__init__.py")


def loaded(sources: dict[str, str]) -> str:
    """The program of components.scripts.entry with these modules, as programs.py makes one."""
    entry = sources.pop("components.scripts.entry")
    # a module besides the entry (an empty one at least): an entry alone travels as it is, without the loader
    return program_of("entry.py", {ENTRY: entry, "components.scripts.node_log": "", **sources})


def run_isolated(program: str, tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python3 -I -` as a node runs it: no PYTHONPATH, no user site, a working directory without the repository."""
    return subprocess.run([sys.executable, "-I", "-", *args], input=program, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.mark.parametrize(
    "source, found",
    [
        ("from components.scripts.node_chat import chat", {"components.scripts.node_chat"}),
        ("from components.scripts import node_log, node_params", {"components.scripts.node_log",
                                                                 "components.scripts.node_params"}),
        ("import components.scripts.node_gpus", {"components.scripts.node_gpus"}),
        ("import components.scripts.node_gpus as gpus", {"components.scripts.node_gpus"}),
        ("def f():\n    from components.scripts.node_watch import http_get", {"components.scripts.node_watch"}),
        ("import json, os\nfrom urllib import request", set()),
        ("from components.plan.names import RUN_DIR", set()),  # the program side: never carried to a node
        ("from components.scriptsx import y", set()),
    ],
)  # fmt: skip
def test_the_modules_a_source_imports_are_read_from_its_imports(source, found):
    assert imported(source, "t.py") == found


@pytest.mark.parametrize("source", ["from . import node_log", "from .node_log import say", "from .. import plan"])
def test_a_relative_import_is_refused_naming_the_way_to_write_it(source):
    with pytest.raises(ValueError, match=r"t\.py: a relative import .* `from components\.scripts\.MODULE import NAME`"):
        imported(source, "t.py")


@pytest.mark.parametrize("name", PYTHON_SCRIPTS)
def test_each_script_carries_exactly_what_its_imports_reach(name):
    """The closure, checked independently of how node_modules walks it: every carried module is imported by the
    entry or by another carried module, and everything those import is carried."""
    carried = node_modules(name)
    assert carried[ENTRY] == (SCRIPTS / name).read_text()
    reached = set()
    for key, source in carried.items():
        if key != ENTRY:
            assert source == (SCRIPTS / (key.split(".")[-1] + ".py")).read_text()
        reached |= imported(source, key)
    assert reached == set(carried) - {ENTRY}


def test_the_supervisor_carries_its_parts_and_no_script_of_another_step():
    carried = set(node_modules("supervisor.py")) - {ENTRY}
    assert {"components.scripts.node_contract", "components.scripts.node_gpu_turn", "components.scripts.node_processes",
            "components.scripts.node_vllm_watch", "components.scripts.node_watch", "components.scripts.node_log"} <= carried  # fmt: skip
    assert not carried & {"components.scripts.node_fabric_copy", "components.scripts.router_keeper",
                          "components.scripts.docker_api", "components.scripts.node_copy_channel"}  # fmt: skip


def test_a_script_of_the_standard_library_only_travels_as_it_is():
    """supervisor_boot.py is every container's main process (an edit replaces every container): never wrapped."""
    for name in ("supervisor_boot.py", "host_facts.py", "preflight_node.sh"):
        assert script(name) == (SCRIPTS / name).read_text()
    assert set(node_modules("supervisor_boot.py")) == {ENTRY}


def test_no_module_of_the_package_imports_what_a_node_lacks():
    """What a node module imports is the standard library or another node module: never the program side
    (components.plan, pydantic, pulumi), which no node has."""
    allowed = set(sys.stdlib_module_names)
    for path in SCRIPTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if name.startswith("components."):
                    assert name == "components.scripts" or name.startswith("components.scripts."), (path.name, name)
                elif top not in ("torch", "ray", "huggingface_hub"):  # the image's, imported by the probes inside it
                    assert top in allowed, (path.name, name)


def test_no_lint_rule_is_turned_off_for_the_node_scripts():
    """Every name a script uses is one it defines or imports (F821 holds for each), and they are held to the Python
    the contract promises (3.7) rather than excused from rules: no per-file ignore names components/scripts."""
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    ignores = ruff["lint"].get("per-file-ignores", {})
    assert not [key for key in ignores if key.startswith("components/")], ignores
    assert ruff["per-file-target-version"]["components/scripts/*.py"] == "py37"


def test_a_program_runs_on_a_python_without_the_package_and_reads_its_parameters(tmp_path):
    """smoke.py against a port nothing listens on: its modules (node_contract, node_chat, node_params) load from
    the program, its parameters from the program text, and it fails with its own message."""
    params = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key": "sk-in-the-program-only",
              "prompt": "hi", "max_tokens": 4, "timeout_seconds": 2}  # fmt: skip
    program = script_program("smoke.py", params)
    assert program.startswith("PARAMS = ")
    result = run_isolated(program, tmp_path)
    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert "Traceback" not in said and "ModuleNotFoundError" not in said, said
    assert said.startswith("smoke test failed: ") and "Connection refused" in said, said


def test_a_traceback_names_the_module_and_its_line(tmp_path):
    """A failure deep in a carried module reads as it would from files: the module's own file name and line."""
    sources = {
        "components.scripts.entry": "from components.scripts.middle import go\n\ngo()\n",
        "components.scripts.middle": "from components.scripts import deep\n\n\ndef go():\n    deep.fail()\n",
        "components.scripts.deep": "def fail():\n    raise ValueError('the reason')\n",
    }
    program = (
        SCRIPTS / "node_loader.py"
    ).read_text() + f"\nSOURCES = {sources!r}\nrun(SOURCES, 'components.scripts.entry')\n"
    result = run_isolated(program, tmp_path)
    assert result.returncode == 1
    assert 'File "components/scripts/middle.py", line 5, in go' in result.stderr, result.stderr
    assert 'File "components/scripts/deep.py", line 2, in fail' in result.stderr
    assert "ValueError: the reason" in result.stderr
    assert len(max(result.stderr.splitlines(), key=len)) < 200  # no line of the program's sources in it


def test_a_module_the_program_does_not_carry_is_not_found_on_the_node(tmp_path):
    sources = {"components.scripts.entry": "import components.scripts.absent\n"}
    program = (
        SCRIPTS / "node_loader.py"
    ).read_text() + f"\nSOURCES = {sources!r}\nrun(SOURCES, 'components.scripts.entry')\n"
    result = run_isolated(program, tmp_path)
    assert result.returncode == 1 and "No module named 'components.scripts.absent'" in result.stderr, result.stderr


def test_the_entry_runs_as_main_and_sys_exit_is_its_exit_code(tmp_path):
    sources = {"components.scripts.entry": "import sys\nprint(__name__, __file__)\nsys.exit(3)\n"}
    program = (
        SCRIPTS / "node_loader.py"
    ).read_text() + f"\nSOURCES = {sources!r}\nrun(SOURCES, 'components.scripts.entry')\n"
    result = run_isolated(program, tmp_path)
    assert (result.returncode, result.stdout) == (3, "__main__ components/scripts/entry.py\n")


def test_a_chain_of_programs_runs_each_with_its_own_parameters(tmp_path, monkeypatch):
    """Two steps in one program, each with the loader and its parameters: the second reads its own, not the first's."""
    monkeypatch.setattr(programs, "node_modules", lambda name: {
        ENTRY: "import json\nfrom components.scripts.node_params import given\nprint(json.dumps({'got': given()['n']}))\n",
        "components.scripts.node_params": (SCRIPTS / "node_params.py").read_text(),
    })  # fmt: skip
    programs.script.cache_clear()
    try:
        program = script_chain([("one.py", {"n": 1}), ("two.py", {"n": 2})])
    finally:
        programs.script.cache_clear()
    result = run_isolated(program, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"chain": {"one.py": {"got": 1}, "two.py": {"got": 2}}}


def test_the_supervisor_installed_as_a_file_runs_from_it(tmp_path):
    """As the container runs it (supervisor_boot.py execs the file the `<node>-supervisor` step wrote): the program
    is too long for an argument (over 128 KiB), so it lives in a file; its parameters come in argv."""
    program = tmp_path / "supervisor.py"
    program.write_text(script("supervisor.py"))
    assert len(script("supervisor.py").encode()) > 100_000
    result = subprocess.run([sys.executable, "-I", str(program), json.dumps({"node": "n"})], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 1
    assert 'File "components/scripts/supervisor.py"' in result.stderr and "TypeError" in result.stderr, result.stderr


def test_a_traceback_shows_the_modules_own_lines(tmp_path):
    sources = {"components.scripts.entry": "x = 1\nraise RuntimeError('shown with its line')  # this line\n"}
    program = (
        SCRIPTS / "node_loader.py"
    ).read_text() + f"\nSOURCES = {sources!r}\nrun(SOURCES, 'components.scripts.entry')\n"
    result = run_isolated(program, tmp_path)
    assert "raise RuntimeError('shown with its line')  # this line" in result.stderr, result.stderr


def test_every_program_a_container_runs_from_its_argv_fits_one_argument():
    """A container whose entrypoint is `python3 -u -c PROGRAM` (the router's keeper, the guard, the depot) carries
    its program as one argument, and Linux refuses one over MAX_ARG_STRLEN (32 pages: 131,072 bytes) at exec. The
    supervisor's (137 KB) is past it: it is installed as a file instead. Found from the resources' code, with room
    for the parameters (8 KiB)."""
    import re

    found = set()
    for path in (ROOT / "components" / "resources").rglob("*.py"):
        found |= set(re.findall(r'"-c", script_program\("([a-z_]+\.py)"', path.read_text()))
    assert found == {"router_keeper.py", "node_guard.py", "node_fabric_copy.py"}
    for name in sorted(found):
        assert len(script(name).encode()) < 131_072 - 8192, name
    assert len(script("supervisor.py").encode()) > 131_072 - 8192  # why it travels as a file
