# The router's keeper: the main process of the container spark-vllm.router (mode "serve"), and the steps
# that talk to it through `docker exec` (modes "workers", "drain", "undrain", "ready"). Fed on stdin or as
# the container's program, after PARAMS and node_contract.py (components/plan/programs.py). Standard library only.
#
# The stack's endpoint on router.port is the edge (HAProxy, components/plan/edge.py) in its own container: it
# checks the key and the route, answers /v1/models in OpenAI's shape for every declared model, and passes the
# rest to vllm-router, which listens on loopback only (router.innerPort), where the keeper's steps reach its
# admin API and nothing from the network does.
#
# The router is vllm-router (PyPI; vllm-project/router) in its IGW mode (--enable-igw): it routes a request
# by its `model` to the workers registered for that model through its HTTP API (POST /workers with url and
# model_id, DELETE /workers/<url>, GET /workers), balancing among them (--policy). It keeps those
# registrations in memory only, so the keeper holds what should be registered in RUN_DIR and makes the
# router match it every second: the workers the stack declares (mode "workers", from `pulumi up`) less the
# ones being changed (mode "drain" takes a replica out and waits until it has finished what it was
# serving; "undrain" puts it back) and less the ones that serve no more: /health not 200 (a vLLM restarting),
# or stalled by its own counters with requests waiting on it (node_watch.py StallWatch, the replica's
# vllm.stallSeconds: its supervisor ends it a few seconds later, so no new request lands on it meanwhile);
# those are put back once they answer /health and move again (RUN_DIR/unserving.json). A restarted router,
# or a worker registered by anyone else, is mended within a second. The router's own API is not authenticated
# (0.1.17): docs/several-models.md says how the stack fences it.
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from components.scripts.node_chat import chat, wait_served
from components.scripts.node_contract import KEEPER_MODES, KeeperResult
from components.scripts.node_params import given
from components.scripts.node_timing import Backoff, Every, polls
from components.scripts.node_watch import HealthWatch, StallWatch, http_get, read_load, read_metrics

_GIVEN = given()
P = KEEPER_MODES[_GIVEN["mode"]].from_json(_GIVEN)  # the router container's program (serve) or one of its steps
RUN_DIR = os.environ.get("SPARK_VLLM_ROUTER_RUN_DIR") or "/run/spark-vllm-router"  # another: tests only
WORKERS, DRAINED, UNSERVING = f"{RUN_DIR}/workers.json", f"{RUN_DIR}/drained.json", f"{RUN_DIR}/unserving.json"
FIELDS = ("url", "model", "stall_seconds")  # a declared worker, as workers.json keeps it
WATCH_SECONDS = 2  # how often the serving keeper reads each worker's /health and /metrics
HEALTH_MISSES = 2  # passes in a row without /health 200 before a worker is out (a pass every WATCH_SECONDS)
RESTART_BACKOFF = Backoff(1, 30)  # vllm-router restarted 1, 2, 4 … 30 s after each exit, until it answers again
ROUTER = f"http://127.0.0.1:{P.inner_port}"  # vllm-router itself, its admin API included: loopback only
ENDPOINT = f"{'127.0.0.1' if P.host == '0.0.0.0' else P.host}:{P.port}"  # the stack's endpoint: the edge
INSTALL_DIR = "/opt/spark-vllm-router"  # a volume: vllm-router installed once per version


def say(message):
    print(f"[router-keeper] {time.strftime('%H:%M:%S')} {message}", flush=True)


def read_json(path, default):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return default


class Locked:
    """The state files change one step at a time (two deployments may change at once)."""

    def __enter__(self):
        os.makedirs(RUN_DIR, exist_ok=True)
        self.handle = open(f"{RUN_DIR}/.lock", "w")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *_):
        self.handle.close()


def write_json(path, value):
    os.makedirs(RUN_DIR, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        json.dump(value, handle, sort_keys=True)
    os.replace(tmp, path)


def api(method, path, body=None, timeout=5):
    """(status, parsed body or text) from the router's API; (0, reason) when it does not answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(ROUTER + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
            status = response.status
    except urllib.error.HTTPError as error:
        text, status = error.read().decode(errors="replace"), error.code
    except (OSError, ValueError) as error:
        return 0, str(error)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def registered():
    """{url: model} the router routes to now, or None when it does not answer."""
    status, body = api("GET", "/workers")
    if status != 200 or not isinstance(body, dict):
        return None
    return {w["url"]: w.get("model_id") for w in body.get("workers", []) if isinstance(w, dict) and "url" in w}


def wanted():
    """{url: model} the router should route to: the declared workers less the drained ones and those that serve
    no more."""
    out = set(read_json(DRAINED, [])) | set(read_json(UNSERVING, []))
    return {w["url"]: w["model"] for w in read_json(WORKERS, []) if w["url"] not in out}


def serves_no_more(worker, watches, out, now):
    """Why a declared worker should get no request now (None: it serves): /health not 200 (HealthWatch: passes in a
    row), or its counters stalled with requests waiting on it. `watches`: url -> its HealthWatch and StallWatch, kept
    between passes; `out`: url -> why, as the last pass left it (a worker out stays out while /health misses)."""
    url = worker["url"]
    if not worker.get("stall_seconds"):  # declared without one (a keeper's step of an earlier release): not watched
        return None
    health, stall = watches.setdefault(url, [HealthWatch(HEALTH_MISSES), None])
    healthy = http_get(url + "/health", 2)[0] == 200
    if health.see(healthy):
        watches[url][1] = None
        return "/health does not answer 200"
    if not healthy:
        return out.get(url)  # one miss: as it was
    (metrics_status, metrics), (load_status, load) = http_get(url + "/metrics", 2), http_get(url + "/load", 2)
    if metrics_status != 200 or load_status != 200:
        return None
    if stall is None:
        stall = watches[url][1] = StallWatch(worker["stall_seconds"])
    return stall.see(now, read_metrics(metrics), read_load(load))


def watch_workers(watches, out):
    """One pass over the declared workers: those that serve no more out of the router, those that serve again
    back (UNSERVING); `out`: url -> why, as the last pass left it."""
    now_out = {}
    for worker in read_json(WORKERS, []):
        why = serves_no_more(worker, watches, out, time.monotonic())
        if why is not None:
            now_out[worker["url"]] = why
    if set(now_out) != set(out):
        for url in sorted(set(now_out) - set(out)):
            say(f"{url} out of the router: {now_out[url]}")
        for url in sorted(set(out) - set(now_out)):
            say(f"{url} back in the router: it serves again")
        with Locked():
            write_json(UNSERVING, sorted(now_out))
    return now_out


def reconcile():
    """One pass: register what is wanted and missing (or registered for another model), remove the rest."""
    now = registered()
    if now is None:
        return False
    goal = wanted()
    for url in sorted(now):
        if url not in goal or now[url] != goal[url]:
            status, body = api("DELETE", "/workers/" + urllib.parse.quote(url, safe=""))
            say(f"removed {url} ({now[url]}): {status}" if status == 200 else f"could not remove {url}: {body}")
    for url, model in sorted(goal.items()):
        if now.get(url) != model:
            status, body = api("POST", "/workers", {"url": url, "model_id": model})
            say(f"registered {url} for {model}" if status == 200 else f"could not register {url}: {status} {body}")
    return True


# --- the router process ---------------------------------------------------------------------------


def installed_version(path):
    """The vllm-router version importable with `path` first (None: not there)."""
    probe = "import importlib.metadata as m; print(m.version('vllm-router'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    return found.stdout.strip() if found.returncode == 0 else None


def router_path():
    """Where vllm-router of P.version is: the image's own, or installed into the volume once."""
    if installed_version("") == P.version:
        return ""
    target = f"{INSTALL_DIR}/{P.version}"
    if installed_version(target) == P.version:
        return target
    say(f"installing vllm-router {P.version} into {target} (the image has {installed_version('') or 'none'})")
    argv = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", "--target",
            f"{target}.partial", f"vllm-router=={P.version}"]  # fmt: skip
    if P.index_url:
        argv += ["--index-url", P.index_url]
    subprocess.run(["rm", "-rf", f"{target}.partial"], check=False)
    if subprocess.run(argv).returncode != 0:
        raise SystemExit(
            f"could not install vllm-router {P.version} (pip above): the node needs PyPI or router.indexUrl, "
            "or an image with vllm-router in it (router.version its version)"
        )
    os.replace(f"{target}.partial", target)
    return target


def router_argv():
    return [
        sys.executable, "-c", "import sys; from vllm_router.launch_router import main; sys.exit(main())",
        "--host", "127.0.0.1", "--port", str(P.inner_port), "--enable-igw", "--policy", P.policy,
        "--prometheus-host", P.metrics_host, "--prometheus-port", str(P.metrics_port),
        "--health-check-interval-secs", str(P.health_interval), "--log-level", "warning",
    ]  # fmt: skip


def serve():
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    path = router_path()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
    say(f"vllm-router on 127.0.0.1:{P.inner_port}, behind the edge on {P.host}:{P.port}")
    router, exits, healthy = None, 0, False  # exits since it last answered
    watches, out, looks = {}, {url: "" for url in read_json(UNSERVING, [])}, Every(WATCH_SECONDS)
    while not stopping:
        if looks.due(time.monotonic()):
            out = watch_workers(watches, out)
        if router is None or router.poll() is not None:
            if router is not None:
                exits += 1
                delay = RESTART_BACKOFF.delay(exits)
                say(f"vllm-router exited with {router.returncode}; starting it again in {delay:g} s")
                time.sleep(delay)
            say(f"starting vllm-router {P.version} on 127.0.0.1:{P.inner_port} (policy {P.policy})")
            router, healthy = subprocess.Popen(router_argv(), env=env), False
        if reconcile():
            if not healthy:
                say("vllm-router answers; the workers are registered")
                healthy, exits = True, 0
        time.sleep(1)
    if router is not None and router.poll() is None:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()


# --- the steps -------------------------------------------------------------------------------------


def wait_until(check, seconds, what):
    for _ in polls(seconds, 0.5):
        if check():
            return
    raise SystemExit(f"router: {what} not within {seconds} s; the keeper's log: docker logs spark-vllm.router")


def in_flight(worker):
    """Requests a vLLM (its /metrics) runs or queues now; None when it does not answer."""
    status, text = http_get(worker.url + "/metrics", 5)
    if status != 200:
        return None
    found = read_metrics(text, ("vllm:num_requests_running", "vllm:num_requests_waiting"))
    return sum(found.values())


def smoke():
    """One short chat completion for each model, through the router (as a client sends it): the edge, https:// with
    tls (its certificate verified for P.server_name)."""
    results = {}
    front = f"{'https' if P.tls_ca else 'http'}://{ENDPOINT}"
    tls = (P.server_name, P.tls_ca) if P.tls_ca else None
    try:  # once the edge's checks have seen the router answer (node_chat.wait_served)
        unserved = wait_served(front, P.wait_served_seconds, tls)
    except OSError as error:
        raise SystemExit(f"router: {front}/health: {error}") from None
    if unserved is not None:
        raise SystemExit(f"router: the endpoint's /health ({front}) still answered {unserved} after "
                         f"{P.wait_served_seconds:g} s: the edge's checks of the router did not pass")  # fmt: skip
    for model in P.models:
        body = {"model": model, "messages": [{"role": "user", "content": P.prompt}], "max_tokens": P.max_tokens}
        started = time.monotonic()
        try:
            answer = chat(front, body, P.api_key, P.timeout, tls)
        except urllib.error.HTTPError as error:
            said = error.read().decode(errors="replace")[:500] if error.fp else error.reason
            raise SystemExit(f"router: {model} answered {error.code}: {said}") from None
        except (OSError, ValueError) as error:
            raise SystemExit(f"router: no answer for {model}: {error}") from None
        usage = answer.get("usage") or {}
        results[model] = {
            "latencySeconds": round(time.monotonic() - started, 3),
            "completionTokens": usage.get("completion_tokens"),
            "answeredBy": answer.get("model"),
        }
    print(json.dumps(KeeperResult(router=front, models=results).to_json()))


def _gone(url):
    now = registered()
    return now is not None and url not in now


def main():
    mode = P.mode
    if mode == "serve":
        return serve()
    if mode == "ready":
        wait_until(lambda: registered() is not None, P.timeout, "vllm-router answering")
        print(json.dumps(KeeperResult(router=f"http://{ENDPOINT}", workers=registered()).to_json()))
        return None
    if mode == "workers":
        with Locked():
            write_json(WORKERS, [{k: getattr(w, k) for k in FIELDS} for w in P.workers])
        goal = wanted()
        wait_until(lambda: registered() == goal, P.timeout, f"the router routing to {sorted(goal)}")
        print(json.dumps(KeeperResult(workers=goal, drained=read_json(DRAINED, [])).to_json()))
        return None
    if mode == "smoke":
        return smoke()
    worker = P.worker
    if mode == "drain":
        with Locked():
            write_json(DRAINED, sorted(set(read_json(DRAINED, [])) | {worker.url}))
        wait_until(lambda: _gone(worker.url), P.timeout, f"{worker.url} out of the router")
        started = time.monotonic()
        # what it was serving finishes (or it is down already); the router sends it nothing new
        wait_until(lambda: not in_flight(worker), P.timeout, f"{worker.replica} finishing its requests")
        say(f"{worker.replica} ({worker.url}) out of the router, idle after {time.monotonic() - started:.1f} s")
    elif mode == "undrain":
        with Locked():  # declared (a new replica is not yet), and no longer drained
            known = read_json(WORKERS, [])
            before = next((w for w in known if w["url"] == worker.url), {})
            declared = [w for w in known if w["url"] != worker.url]
            entry = {k: getattr(worker, k) if getattr(worker, k) is not None else before.get(k) for k in FIELDS}
            write_json(WORKERS, [*declared, entry])
            write_json(DRAINED, sorted(set(read_json(DRAINED, [])) - {worker.url}))
        wait_until(lambda: (registered() or {}).get(worker.url) == worker.model, P.timeout,
                   f"{worker.url} back in the router")  # fmt: skip
        say(f"{worker.replica} ({worker.url}) back in the router for {worker.model}")
    print(json.dumps(KeeperResult(mode=mode, worker=worker.url, drained=read_json(DRAINED, [])).to_json()))
    return None


if __name__ == "__main__":
    sys.exit(main())
