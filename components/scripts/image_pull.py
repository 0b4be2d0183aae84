# Runs on a node's HOST over SSH (its own python3, standard library only) as `python3 -`, its parameters
# in the program (node_params.py). Pulls the image through the Docker Engine API
# (the daemon of DOCKER_HOST when it is a unix:// socket, else /var/run/docker.sock) and prints,
# every `progress_seconds`, how far it is: bytes of bytes, rate, layers done. A pull that is not
# done within `timeout_seconds` fails with that limit named. Registry credentials come from
# ~/.docker/config.json (`auths`); where a credential helper holds them, `docker pull` does the
# pull and the progress counts layers only. Exits 0 once the image is on the node.
import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

from components.scripts.docker_api import UnixConnection, api_prefix, docker_socket, negotiated
from components.scripts.node_common import human, node_voice
from components.scripts.node_contract import PullParams
from components.scripts.node_log import say, speak_with
from components.scripts.node_params import given

P = PullParams.from_json(given())
speak_with(node_voice(P.node))


def request(method, path, headers=None, timeout=60):
    connection = UnixConnection(docker_socket(), timeout)
    connection.request(method, api_prefix() + path, headers=headers or {})
    return connection, connection.getresponse()


def present(reference):
    connection, response = request("GET", f"/images/{urllib.parse.quote(reference, safe='')}/json")
    response.read()
    connection.close()
    return response.status == 200


def split_reference(reference):
    """(repository, tag or digest) as /images/create takes them."""
    if "@" in reference:
        repository, digest = reference.split("@", 1)
        return repository, digest
    last = reference.rsplit("/", 1)[-1]
    if ":" in last:
        repository, tag = reference.rsplit(":", 1)
        return repository, tag
    return reference, "latest"


def registry_of(repository):
    first = repository.split("/", 1)[0]
    if "/" in repository and ("." in first or ":" in first or first == "localhost"):
        return first
    return "https://index.docker.io/v1/"


def credentials(repository):
    """(X-Registry-Auth value or None, True when a credential helper holds them)."""
    try:
        with open(os.path.expanduser("~/.docker/config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None, False
    registry = registry_of(repository)
    if registry in (config.get("credHelpers") or {}) or config.get("credsStore"):
        entry = (config.get("auths") or {}).get(registry) or {}
        if not entry.get("auth"):
            return None, True
    entry = (config.get("auths") or {}).get(registry) or {}
    if not entry.get("auth"):
        return None, False
    user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
    auth = {"username": user, "password": password, "serveraddress": registry}
    return base64.urlsafe_b64encode(json.dumps(auth).encode()).decode(), False


class Progress:
    def __init__(self, tag):
        self.tag = tag  # the reference pulled: its own events are not a layer's
        self.layers = {}  # id -> [current, total, done]
        self.started = time.monotonic()
        self.last_report = self.started
        self.last_bytes = 0

    def update(self, event):
        layer = event.get("id")
        status = event.get("status", "")
        if not layer or layer == self.tag:
            return
        entry = self.layers.setdefault(layer, [0, 0, False])
        detail = event.get("progressDetail") or {}
        if status == "Downloading" and detail.get("total"):
            entry[0], entry[1] = detail.get("current", 0), detail["total"]
        elif status in ("Download complete", "Verifying Checksum", "Extracting"):
            entry[0] = entry[1]
        if status in ("Pull complete", "Already exists"):
            entry[0], entry[2] = entry[1], True

    def line(self):
        now = time.monotonic()
        current = sum(layer[0] for layer in self.layers.values())
        total = sum(layer[1] for layer in self.layers.values())
        rate = (current - self.last_bytes) / max(now - self.last_report, 1e-6)
        self.last_report, self.last_bytes = now, current
        done = sum(1 for layer in self.layers.values() if layer[2])
        share = f" ({100 * current / total:.0f}%)" if total else ""
        return (
            f"pulling {P.image}: {human(current)} of {human(total)}{share} at {human(rate)}/s, "
            f"{done}/{len(self.layers)} layers done, {now - self.started:.0f} s"
        )


def pull_with_api(repository, reference, auth, deadline):
    headers = {"X-Registry-Auth": auth} if auth else {}
    query = urllib.parse.urlencode({"fromImage": repository, "tag": reference})
    connection, response = request("POST", f"/images/create?{query}", headers, timeout=P.timeout_seconds)
    if response.status != 200:
        say(f"pull refused by the Docker daemon: HTTP {response.status} {response.read().decode(errors='replace')}")
        return 1
    progress, finished, timed_out = Progress(reference), threading.Event(), threading.Event()

    def report():
        # A line every progress_seconds while the pull runs; at the deadline, cut the connection.
        while not finished.wait(P.progress_seconds):
            if time.monotonic() > deadline:
                timed_out.set()
                connection.raw.shutdown(socket.SHUT_RDWR)
                return
            say(progress.line())

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        for raw in response:
            if not raw.strip():
                continue
            event = json.loads(raw)
            if event.get("error"):
                say(f"pull failed: {event['error']}")
                return 1
            progress.update(event)
    except (OSError, ValueError, http.client.HTTPException) as error:
        if not timed_out.is_set():
            say(f"pull interrupted: {error}")
            return 1
    finally:
        finished.set()
        connection.close()
    if timed_out.is_set():
        limit = P.timeout_seconds
        say(f"the pull did not finish within {limit} s (imageTransfer.timeoutSeconds); last: {progress.line()}")
        return 1
    total = sum(layer[1] for layer in progress.layers.values())
    seconds = time.monotonic() - progress.started
    say(f"pulled {P.image} in {seconds:.1f} s ({human(total)} downloaded, {human(total / max(seconds, 1e-6))}/s)")
    return 0


def pull_with_cli(deadline):
    """`docker pull` (it asks the credential helper); progress counts the layers it reports done."""
    process = subprocess.Popen(["docker", "pull", P.image], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done, started = 0, time.monotonic()
    for line in process.stdout:
        if "Pull complete" in line or "Already exists" in line:
            done += 1
            say(f"pulling {P.image}: {done} layers done, {time.monotonic() - started:.0f} s")
        if time.monotonic() > deadline:
            process.kill()
            say(f"the pull did not finish within {P.timeout_seconds} s (imageTransfer.timeoutSeconds)")
            return 1
    return process.wait()


def main():
    deadline = time.monotonic() + P.timeout_seconds
    try:
        if present(P.image):
            say(f"{P.image} is already on this node")
            return 0
        if P.image.startswith("sha256:"):
            say(
                f"{P.image} is an image id, which no registry serves: load or build it on this node "
                "(with imageTransfer.method copy, the copy source; the other nodes receive it from there)"
            )
            return 1
        repository, reference = split_reference(P.image)
        auth, helper = credentials(repository)
        say(f"pulling {P.image} (at most {P.timeout_seconds} s; {negotiated['said']})")
        code = pull_with_cli(deadline) if helper else pull_with_api(repository, reference, auth, deadline)
    except OSError as error:
        say(f"cannot reach the Docker daemon at {docker_socket()}: {error}")
        return 1
    if code == 0 and not present(P.image):
        say(f"the pull ended but {P.image} is not on this node")
        return 1
    return code


sys.exit(main())
