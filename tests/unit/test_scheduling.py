"""tests/scheduling.py: the fast lane's long waiting tests go out first, one to each process in turn, and the rest
is split as work stealing splits it."""

import ast
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
    # the longest first, one to each process; the fourth goes round to the first again (a run this short has no gap)
    assert plan == [[12, 3, 0, 1, 2], [10, 4, 5, 6], [7, 11, 8, 9]]


def test_each_process_starts_its_waits_later_in_its_gaps_than_the_one_before_and_within_the_first_part_of_its_run():
    collection = [f"tests/unit/test_a.py::test_{n}" for n in range(60)] + [
        f"tests/unit/test_w.py::test_{n}" for n in range(6)
    ]
    first = [f"tests/unit/test_w.py::test_{n}" for n in range(6)]
    plan = first_then_split(collection, first, 3)
    waits = [[place for place, index in enumerate(share) if index >= 60] for share in plan]
    # 20 other tests a process, two waits each: their gap is 20 * WAITS_WITHIN / 2 = 6, the phase a third of it more
    assert waits == [[0, 7], [2, 9], [4, 11]]
    assert [[plan[p][place] for place in places] for p, places in enumerate(waits)] == [[60, 63], [61, 64], [62, 65]]
    assert sorted(index for share in plan for index in share) == list(range(len(collection)))


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
