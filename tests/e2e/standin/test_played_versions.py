"""The stand-in plays a vLLM release (vllm_standin/versions.py): each release's flags, the routes its key guards,
the render routes and their refusal, its keyless routes and its loading line, as that release has them — and the
same facts as the program holds of that release (components/config/vllm_versions.py), so the two cannot drift.
Each release runs in a process of its own (the stand-in reads which it plays at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from components.config.vllm_versions import parse, rules

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_standin.versions import PLAYABLE, Played  # noqa: E402

# What a process playing one release does: its parser and its HTTP server, as JSON.
PROBE = r"""
import json, threading, urllib.error, urllib.request
from vllm_standin import __version__, api, args, core

def parses(*argv):
    try:
        ns = args.parse_cli(["serve", "m", *argv])
    except SystemExit:
        return None
    return {"tracking": ns.enable_server_load_tracking, "gpu": ns.gpu_memory_utilization,
            "scale_out": getattr(ns, "enable_scale_out", None)}

found = {"version": __version__,
         "disable_tracking": parses("--enable-server-load-tracking", "--disable-server-load-tracking"),
         "no_enable_tracking": parses("--enable-server-load-tracking", "--no-enable-server-load-tracking"),
         "alias": parses("--device-memory-utilization", "0.5"),
         "scale_out": parses("--enable-scale-out"),
         "loading": core.loading_line("/models/m")[0]}
for scale_out in (False, True):
    state = api.ServerState(api.ServeConfig(model="m", served_model_names=("m",), max_model_len=4096,
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, backend=None, host="127.0.0.1",
        port=0, api_key="k", scale_out=scale_out))
    server = api.make_server(state)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def call(path, body=None, key=None):
        req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode())
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    found[f"render_{scale_out}"] = call("/v1/chat/completions/render", chat, key="k")
    found["cohere"] = call("/cohere/v2/chat", chat)
    found["kv_event_sources"] = call("/kv_event_sources")
    server.shutdown()
print(json.dumps(found))
"""


def played(version: str) -> dict:
    env = {**os.environ, "VLLM_STANDIN_PLAYS": version, "PYTHONPATH": str(HERE)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # after the access log lines the stand-in writes


@pytest.mark.parametrize("version", PLAYABLE)
def test_the_stand_in_plays_each_release_as_that_release_behaves(version):
    found, release = played(version), rules(parse(version))
    assert found["version"] == version
    # --disable-X beside --enable-X from 0.33 (EnableDisableAction); --no-enable-X in every release
    if release.disable_switches:
        assert found["disable_tracking"]["tracking"] is False
    else:
        assert found["disable_tracking"] is None  # argparse's "unrecognized arguments": exit 2
    assert found["no_enable_tracking"]["tracking"] is False
    assert (found["alias"] is not None and found["alias"]["gpu"] == 0.5) == bool(release.gpu_memory_aliases)
    assert (found["scale_out"] is not None) == (release.scale_out_flag is not None)
    # the render routes: open before 0.30; from 0.32 a 403 without --enable-scale-out; served with it
    assert found["render_False"] == (200 if release.scale_out_flag is None else 403)
    assert found["render_True"] == 200
    # /cohere behind the key from 0.27; /kv_event_sources without it from 0.31
    assert (found["cohere"] == 401) == ("/cohere" in release.guarded_prefixes)
    assert (found["kv_event_sources"] == 200) == ("/kv_event_sources" in release.keyless_routes_added)
    assert found["loading"].split("%")[0].strip(". ") in " ".join(release.loading_lines)


@pytest.mark.parametrize("version", ["0.25.0", "0.26.0", "0.27.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0",
                                     "0.34.0"])  # fmt: skip
def test_the_stand_ins_rules_are_the_programs_for_every_release(version):
    standin, program = Played(version), rules(parse(version))
    assert standin.disable_switches == program.disable_switches
    assert standin.gpu_memory_aliases == program.gpu_memory_aliases
    assert standin.scale_out_flag == (program.scale_out_flag is not None)
    assert standin.guarded_prefixes == program.guarded_prefixes
    assert standin.keyless_routes_added == program.keyless_routes_added
    assert standin.default_block_tokens == program.default_block_tokens
    assert standin.loading_line.split("%")[0].strip(". ") in " ".join(program.loading_lines)
