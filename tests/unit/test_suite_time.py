"""benchmarks/suite_time.py reads pytest's JUnit report and the rehearsal's command timings as they are written."""

import json

from benchmarks.suite_time import command_kinds, failed_tests, module_seconds

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
