"""tests/scheduling.py: the fast lane's long waiting tests go out first, one to each process in turn, and the rest
is split as work stealing splits it; and tests/conftest.py's python3 past a version manager's shim."""

import ast
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import LONG_WAITS
from tests.scheduling import LongWaitsFirst, first_then_split, is_listed

ROOT = Path(__file__).resolve().parents[2]
COLLECTION = [f"tests/unit/test_a.py::test_{n}" for n in range(10)] + [
    "tests/unit/test_b.py::test_slow[x]",
    "tests/unit/test_b.py::test_slow[y]",
    "tests/unit/test_b.py::test_slower",
]


def test_a_listed_name_stands_for_itself_and_each_of_its_parameters():
    assert is_listed("tests/unit/test_b.py::test_slow[x]", ["tests/unit/test_b.py::test_slow"])
    assert is_listed("tests/unit/test_b.py::test_slow[x]", ["tests/unit/test_b.py::test_slow[x]"])
    assert not is_listed("tests/unit/test_b.py::test_slower", ["tests/unit/test_b.py::test_slow"])
    assert not is_listed("tests/unit/test_b.py::test_slow[y]", ["tests/unit/test_b.py::test_slow[x]"])


def test_listed_tests_are_dealt_in_the_lists_order_and_spread_through_even_runs_of_the_rest():
    first = ["tests/unit/test_b.py::test_slower", "tests/unit/test_b.py::test_slow", "tests/unit/test_a.py::test_3"]
    plan = first_then_split(COLLECTION, first, 3)
    # the longest first, one to each process; the fourth goes round to the first again, half way through its run
    assert plan == [[12, 0, 3, 1, 2], [10, 4, 5, 6], [11, 7, 8, 9]]


def test_with_nothing_listed_the_split_is_work_stealings():
    assert first_then_split(COLLECTION[:7], [], 3) == [[0, 1], [2, 3], [4, 5, 6]]


class Node:
    shutting_down = False

    def __init__(self, name):
        self.gateway, self.sent = SimpleNamespace(id=name), []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def send_steal(self, indices):
        self.steal = list(indices)

    def shutdown(self):
        self.shutting_down = True


class Config:
    def getvalue(self, name):
        return {"tx": ["3*popen"], "dist": "worksteal"}[name]


def test_the_first_hand_out_is_the_plans_and_nothing_is_left_pending():
    scheduler = LongWaitsFirst(Config(), first=["tests/unit/test_b.py::test_slower"])
    nodes = [Node(n) for n in "abc"]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    assert [node.sent for node in nodes] == first_then_split(COLLECTION, ["tests/unit/test_b.py::test_slower"], 3)
    assert scheduler.pending == [] and not scheduler.tests_finished
    ran = []
    while not scheduler.tests_finished or any(scheduler.node2pending.values()):  # a test each in turn; steals answered
        for node in nodes:
            if getattr(node, "steal", None) is not None:
                stolen, node.steal = node.steal, None
                scheduler.remove_pending_tests_from_node(node, stolen)
            if scheduler.node2pending[node]:
                ran.append(scheduler.node2pending[node][0])
                scheduler.mark_test_complete(node, scheduler.node2pending[node][0])
    assert sorted(ran) == list(range(len(COLLECTION))) and all(node.shutting_down for node in nodes)


def test_each_long_wait_names_a_test_that_exists():
    for name in LONG_WAITS:
        path, function = name.split("::")
        function = function.split("[")[0]
        tree = ast.parse((ROOT / path).read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert function in defined, name


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
