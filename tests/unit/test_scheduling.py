"""tests/scheduling.py: tests go out as processes free up; the long waits first but to a few processes at once, the
files that wait alternating with the others, a file's tests together; the rehearsal's modules whole, first, to a
few processes at once."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import FAST_LANE, LONG_WAITS, in_fast_lane, pytest_xdist_make_scheduler
from tests.scheduling import WAITING_SHARE, CappedWaits, file_of, is_listed

ROOT = Path(__file__).resolve().parents[2]
WAITS = [f"tests/unit/test_w.py::test_wait_{n}" for n in range(8)]
COLLECTION = (
    [f"tests/unit/test_slow.py::test_{n}" for n in range(30)]
    + [f"tests/unit/test_w.py::test_wait_{n}" for n in range(8)]
    + [f"tests/unit/test_a.py::test_{n}" for n in range(40)]
    + [f"tests/unit/test_b.py::test_{n}[{p}]" for n in range(10) for p in "xy"]
)
WAITING_FILES = ["tests/unit/test_slow.py", "tests/unit/test_w.py"]


def test_a_listed_name_stands_for_itself_and_each_of_its_parameters():
    assert is_listed("tests/unit/test_b.py::test_slow[x]", ["tests/unit/test_b.py::test_slow"])
    assert is_listed("tests/unit/test_b.py::test_slow[x]", ["tests/unit/test_b.py::test_slow[x]"])
    assert not is_listed("tests/unit/test_b.py::test_slower", ["tests/unit/test_b.py::test_slow"])
    assert not is_listed("tests/unit/test_b.py::test_slow[y]", ["tests/unit/test_b.py::test_slow[x]"])


class Node:
    shutting_down = False

    def __init__(self, name):
        self.gateway, self.handed = SimpleNamespace(id=name), []

    def send_runtest_some(self, indices):
        self.handed.append(list(indices))

    def shutdown(self):
        self.shutting_down = True


class Config:
    def __init__(self, processes, dist="load"):
        self.values = {"tx": [f"{processes}*popen"], "dist": dist}

    def getvalue(self, name):
        return self.values[name]

    def getoption(self, name):
        return None  # maxschedchunk: unset


def run_through(processes, collection=COLLECTION, waits=WAITS, whole=lambda path: False, whole_at_once=None,
                each=lambda scheduler, nodes: None):  # fmt: skip
    """The scheduler from the collection to every process shut down, a test completing at a time, the processes in
    turn; `each(scheduler, nodes)` after every completion. Returns the scheduler, its processes, the tests in the
    order they ran, and at each hand-out how many processes held a long wait."""
    scheduler = CappedWaits(
        Config(processes), waits=waits, waiting_files=WAITING_FILES, whole=whole, whole_at_once=whole_at_once
    )
    nodes = [Node(f"gw{n}") for n in range(processes)]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    listed = {index for index, nodeid in enumerate(collection) if is_listed(nodeid, waits)}
    ran, holding = [], []
    turn = 0
    while any(scheduler.node2pending[node] for node in nodes):
        assert turn < 50 * len(collection), "the processes never ended: one holds its last test and was not told to end"
        node = nodes[turn % processes]
        turn += 1
        queue = scheduler.node2pending[node]
        if not queue or (len(queue) < 2 and not node.shutting_down):
            continue  # a worker runs a test once it knows the next, or it is told to end
        ran.append(queue[0])
        scheduler.mark_test_complete(node, queue[0])
        holding.append(sum(1 for other in nodes if listed & set(scheduler.node2pending[other])))
        each(scheduler, nodes)
    return scheduler, nodes, ran, holding


def test_every_test_runs_once_and_every_process_is_shut_down_at_the_end():
    scheduler, nodes, ran, _ = run_through(5)
    assert sorted(ran) == list(range(len(COLLECTION)))
    assert all(node.shutting_down for node in nodes) and scheduler.tests_finished and not scheduler.has_pending


def test_the_long_waits_go_first_to_at_most_two_fifths_of_the_processes_and_never_two_to_one():
    scheduler, nodes, ran, holding = run_through(10)
    waits = [index for index, nodeid in enumerate(COLLECTION) if nodeid in WAITS]
    first = [node.handed[0] for node in nodes]  # what each process was handed first
    assert sorted(index for hand in first for index in hand if index in waits) == waits[: int(10 * WAITING_SHARE)]
    assert max(holding) <= int(10 * WAITING_SHARE)
    for node in nodes:  # a process holds a second wait only once its first is done
        held = [index for hand in node.handed for index in hand if index in waits]
        assert all(ran.index(a) < ran.index(b) for a, b in zip(held, held[1:], strict=False)), node.gateway.id
    assert max(ran.index(index) for index in waits) < len(ran) // 2  # all handed out in the first half


def test_a_hand_out_is_a_run_of_one_files_tests_and_the_waiting_files_alternate_with_the_others():
    scheduler, nodes, ran, _ = run_through(3, waits=[])
    hands = [hand for node in nodes for hand in node.handed]
    assert all(len({file_of(COLLECTION[index]) for index in hand}) == 1 for hand in hands)
    assert all(hand == list(range(hand[0], hand[0] + len(hand))) for hand in hands)  # consecutive, in order
    assert max(len(hand) for hand in hands) <= scheduler.chunk
    # the order the hand-outs left the queue: the waiting files' and the others' share run out together
    slow = [file_of(COLLECTION[index]) in WAITING_FILES for index in ran]
    assert slow[: len(slow) // 2].count(True) == pytest.approx(slow.count(True) / 2, abs=4)


def test_one_process_still_runs_every_long_wait_one_after_the_other():
    _, nodes, ran, _ = run_through(1)
    assert sorted(ran) == list(range(len(COLLECTION))) and nodes[0].shutting_down


def test_a_process_that_dies_hands_back_what_it_held():
    scheduler = CappedWaits(Config(2), waits=WAITS, waiting_files=WAITING_FILES)
    nodes = [Node("gw0"), Node("gw1")]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, COLLECTION)
    scheduler.schedule()
    held = list(scheduler.node2pending[nodes[0]])
    crashed = scheduler.remove_node(nodes[0])
    assert crashed == COLLECTION[held[0]] and set(held[1:]) <= set(scheduler.pending)
    assert nodes[0] not in scheduler.in_wait


REHEARSAL = [f"tests/e2e/test_long.py::test_{n}" for n in range(6)] + [
    f"tests/e2e/test_short.py::test_{n}" for n in range(3)
]


def test_whole_files_go_out_first_each_to_one_process_in_order_and_the_rest_after():
    collection = REHEARSAL + COLLECTION
    scheduler, nodes, ran, _ = run_through(3, collection=collection, whole=lambda path: path.startswith("tests/e2e/"))
    assert sorted(ran) == list(range(len(collection)))
    firsts = [node.handed[0] for node in nodes]
    assert firsts[:2] == [list(range(6)), list(range(6, 9))]  # the long module, then the short one, each whole
    assert all(index >= 9 for node in nodes for hand in node.handed[1:] for index in hand)


def in_rehearsal(path):
    return path.startswith("tests/e2e/")


def test_no_more_processes_than_allowed_hold_whole_files_and_the_others_take_the_rest_meanwhile():
    collection = [f"tests/e2e/test_m{m}.py::test_{n}" for m in range(5) for n in range(4)] + COLLECTION

    def at_most_two_in_modules(scheduler, nodes):
        assert sum(1 for other in nodes if set(scheduler.node2pending[other]) & set(range(20))) <= 2

    _, nodes, ran, _ = run_through(
        4, collection=collection, whole=in_rehearsal, whole_at_once=2, each=at_most_two_in_modules
    )
    modules = [set(range(m * 4, m * 4 + 4)) for m in range(5)]
    assert [node.handed[0] for node in nodes[:2]] == [list(range(4)), list(range(4, 8))]
    assert all(not any(set(node.handed[0]) & module for module in modules) for node in nodes[2:])
    assert sorted(ran) == list(range(len(collection))) and all(node.shutting_down for node in nodes)
    held = [
        [m for m, module in enumerate(modules) if any(set(hand) & module for hand in node.handed)] for node in nodes
    ]
    assert sorted(m for modules_of in held for m in modules_of) == list(range(5)) and not held[2] and not held[3]


def test_with_only_whole_files_a_process_past_the_limit_waits_and_ends():
    collection = [f"tests/e2e/test_m{m}.py::test_{n}" for m in range(5) for n in range(3)]
    scheduler, nodes, ran, _ = run_through(4, collection=collection, waits=[], whole=in_rehearsal, whole_at_once=2)
    assert sorted(ran) == list(range(15)) and all(node.shutting_down for node in nodes)
    assert [len(node.handed) for node in nodes[2:]] == [0, 0]


def test_the_rehearsals_modules_are_whole_and_the_fast_lanes_tests_are_not():
    assert not in_fast_lane("tests/e2e/test_rehearsal.py") and not in_fast_lane("tests/e2e/image/test_image.py")
    assert in_fast_lane("tests/e2e/standin/test_vllm_standin.py") and in_fast_lane("tests/unit/test_scheduling.py")
    assert not in_fast_lane("tests/unitx/test_a.py")
    scheduler = pytest_xdist_make_scheduler(Config(5), None)
    assert scheduler.is_whole("tests/e2e/test_stalls.py") and not scheduler.is_whole("tests/program/test_program.py")


def test_the_fast_lane_is_what_run_tests_runs_with_fast():
    line = next(line for line in (ROOT / "run-tests").read_text().splitlines() if line.startswith("FAST=("))
    assert tuple(line.removeprefix("FAST=(").removesuffix(")").split()) == FAST_LANE


def test_both_lanes_get_this_scheduler_and_other_modes_xdists_own():
    assert isinstance(pytest_xdist_make_scheduler(Config(10), None), CappedWaits)
    assert pytest_xdist_make_scheduler(Config(5, dist="loadfile"), None) is None
    assert "--dist load " in (ROOT / "run-tests").read_text()


def test_each_long_wait_names_a_test_that_exists():
    for name in LONG_WAITS:
        path, function = name.split("::")
        function = function.split("[")[0]
        tree = ast.parse((ROOT / path).read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert function in defined, name
