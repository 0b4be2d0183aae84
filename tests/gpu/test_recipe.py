"""The GPU lane's recipe (tests/gpu/recipe.py): every path of the lane is in it, every call fits what the device
tool allows, its arguments are the lane's, docs/measurements.md lists it as it is, and a call packs what its runs
wrote, whole. Each call run with the stand-in vLLM: tests/e2e/test_gpu_recipe.py."""

from __future__ import annotations

import json
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.gpu import lane, nccl, recipe

ROOT = Path(__file__).resolve().parents[2]
PARSERS = {"lane": lane.argument_parser, "nccl": nccl.argument_parser}


def parsed(run: recipe.Run):
    return PARSERS[run.module]().parse_args([*run.args, "--out", "/o"])


def test_every_path_of_the_lane_is_in_the_recipe():
    """Each phase, the stall's both targets, both executors, co-tenants of one shape twice, tensor-parallel and the
    NCCL test: a path no call makes is a path that rots until a GPU session finds it broken."""
    runs = [(run, parsed(run)) for call in recipe.CALLS for run in call.runs]
    lanes = [args for run, args in runs if run.module == "lane" and not args.cotenants]
    assert {phase for args in lanes for phase in args.phases} == set(lane.PHASES)
    assert {args.stall_target for args in lanes if "stall" in args.phases} == {"engine", "worker"}
    assert {args.executor for args in lanes} == {"mp", "ray"}
    assert any(args.tensor_parallel == 2 for args in lanes)
    shapes = [[entry.split(":")[0] for entry in args.cotenants.split(",")] for run, args in runs
              if run.module == "lane" and args.cotenants]  # fmt: skip
    assert any(len(set(each)) < len(each) for each in shapes)  # the same shape twice
    assert any(run.module == "nccl" for run, _ in runs)


def test_every_call_fits_the_device_tools_limits():
    """At most 8 files come back (two a run: its report and its packed folder), a command runs 10 minutes at most
    (the call's measured time leaves room), run names are apart within a call."""
    for call in recipe.CALLS:
        assert 2 * len(call.runs) <= 8, call.name
        assert call.seconds <= recipe.CALL_SECONDS - 2 * recipe.PACK_SECONDS, call.name
        assert len({run.name for run in call.runs}) == len(call.runs), call.name
    assert len({call.name for call in recipe.CALLS}) == len(recipe.CALLS)
    assert recipe.CALLS[0].gpus == 1  # the first call carries the last part: any machine makes it


def test_an_unknown_phase_is_refused_naming_the_phases(capsys):
    with pytest.raises(SystemExit):
        lane.argument_parser().parse_args(["--phases", "bench,stal"])
    assert (
        "no phase stal (the phases: imports, answers, router, bench, metrics, stall, kill)" in capsys.readouterr().err
    )


def test_docs_measurements_lists_the_calls_as_the_recipe_has_them():
    assert recipe.listing() in (ROOT / "docs" / "measurements.md").read_text()


def test_a_call_packs_each_runs_folder_whole_beside_its_report_and_goes_on_after_a_failure(tmp_path, monkeypatch):
    """Each run's folder becomes RUN.tar.gz (every file in it) and RUN.json (its report); a run that fails does not
    stop the next; the call's exit says one failed."""
    script = tmp_path / "fake.py"
    script.write_text(
        "import json, sys, pathlib\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "(out / 'lane-mp-qwen3-8b.json').write_text(json.dumps({'steps': {}, 'argv': sys.argv[1:]}))\n"
        "(out / 'vllm.log').write_text('line\\n' * 100000)\n"
        "print('ran', flush=True)\n"
        "sys.exit(0 if '--executor' in sys.argv else 3)\n"
    )
    fake = recipe.Call("fake", (recipe.Run("first", ("--phases", "kill"), "fails"),
                                recipe.Run("second", ("--executor", "mp"), "passes")), seconds=60)  # fmt: skip
    monkeypatch.setattr(recipe, "CALLS", (fake,))
    monkeypatch.setattr(sys, "executable", sys.executable)
    real_popen = recipe.subprocess.Popen

    def popen(argv, **kwargs):  # `python -u -m tests.gpu.lane ARGS` → the fake with the same ARGS
        return real_popen([sys.executable, str(script), *argv[4:]], **kwargs)

    monkeypatch.setattr(recipe.subprocess, "Popen", popen)
    assert recipe.call("fake", tmp_path / "out", extra={"lane": ["--models", "/m"]}) == 1
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == ["first.json", "first.tar.gz", "second.json", "second.tar.gz"]
    assert json.loads((out / "second.json").read_text())["argv"] == ["--executor", "mp", "--out", str(out / "second"),
                                                                     "--models", "/m"]  # fmt: skip
    with tarfile.open(out / "first.tar.gz") as tar:
        names = sorted(tar.getnames())
        assert names == ["first", "first/console.log", "first/lane-mp-qwen3-8b.json", "first/vllm.log"]
        assert len(tar.extractfile("first/vllm.log").read()) == 500000  # whole
        assert tar.extractfile("first/console.log").read() == b"ran\n"


def test_a_run_the_calls_time_would_cut_is_stopped_and_still_packed(tmp_path, monkeypatch):
    """SIGINT at the call's time less PACK_SECONDS: the lane's own finally stops its node and writes its log."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, pathlib, time\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "try:\n    (out / 'started').touch()\n    time.sleep(60)\n"
        "except KeyboardInterrupt:\n    (out / 'vllm.log').write_text('stopped')\n    sys.exit(130)\n"
    )
    monkeypatch.setattr(recipe, "CALLS", (recipe.Call("slow", (recipe.Run("one", (), "sleeps"),), seconds=1),))
    monkeypatch.setattr(recipe, "PACK_SECONDS", 0)
    real_popen = recipe.subprocess.Popen

    def popen(argv, **kw):  # the run started as the lane starts (in its try) before the call's time is watched
        process = real_popen([sys.executable, str(script), *argv[4:]], **kw)  # (under CI's load Python took 2 s)
        started = tmp_path / "out" / "one" / "started"
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return process

    monkeypatch.setattr(recipe.subprocess, "Popen", popen)
    assert recipe.call("slow", tmp_path / "out", seconds=2) == 1
    with tarfile.open(tmp_path / "out" / "one.tar.gz") as tar:
        assert tar.extractfile("one/vllm.log").read() == b"stopped"


def test_the_lane_benchmark_judges_a_calls_reports_and_leaves_the_others(tmp_path, capsys):
    """benchmarks.gpu_lane over a folder a call brought back (RUN.json beside the co-tenants' and NCCL reports)."""
    from benchmarks.gpu_lane import main

    lane_report = {"executor": "mp", "model": "qwen3-8b", "gpu": ["NVIDIA H100 80GB HBM3"], "date": "2026-12-06",
                   "vllm_version": "0.25.0", "steps": {"ready": {"ok": True, "seconds": 101.0}}}  # fmt: skip
    (tmp_path / "mp.json").write_text(json.dumps(lane_report))
    (tmp_path / "nccl.json").write_text(json.dumps({"cases": {}, "machine": {}}))
    (tmp_path / "cotenants.json").write_text(json.dumps({"phase": "cotenants", "replicas": {}}))
    assert main([str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "mp   qwen3-8b       vLLM 0.25.0 on NVIDIA H100 80GB HBM3" in said and "ready (s)" in said
    assert said.count("vLLM") == 1
