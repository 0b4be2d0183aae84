"""Stand-in for the pulumi-docker provider (5.2, kreuzwerker/terraform-provider-docker v4.5.0 underneath):
the provider config, `docker:index/remoteImage:RemoteImage` and `docker:index/container:Container`.

NOT pulumi-docker. Its provider cannot be built from Go modules (it compiles against a patched
upstream and a schema generated at build time), so the rehearsal runs this test double behind the
real Pulumi CLI and engine. It does what the real one does, read from its sources (internal/provider/
config.go, resource_docker_container*.go, resource_docker_image*.go; docker/cli's connhelper;
pulumi-docker provider/resources.go):

* The node is reached the way the provider's connection helper does it: the local `ssh` from PATH,
  `ssh [-l USER] [-p PORT] <sshOpts…> -o ConnectTimeout=30 -T -- HOST docker system dial-stdio`, in a
  new session (no terminal, so no prompt can be answered), with the environment `pulumi` runs in:
  the user's ~/.ssh/known_hosts and default keys apply, no BatchMode is added. The Docker API
  requests travel over it (the docker CLI here, through an `ssh` that prepends `sshOpts`).
* Nothing connects at CheckConfig, Configure, Check, Diff or preview. The first operation pings the
  daemon; a failure reads `failed to create Docker client: Error pinging Docker server, …`.
* Changing `host` or `sshOpts` updates the provider in place; its resources stay.
* RemoteImage: looked up locally by name first and pulled only when missing; id `<image id><name>`;
  `imageId` and `repoDigest` (""
  for an image without RepoDigests). `name`, `pullTriggers`, `triggers`, `platform` replace it
  (create before delete); `keepLocally` makes delete a no-op. Refresh of a missing image drops it.
* Container: id = the full container id. Replace is delete-before-replace; what replaces and what
  updates follows the schema (restart policy and resources are `docker update`d; mustRun, init,
  destroyGraceSeconds, healthcheck, wait… change the state only). Create does not check that the
  container keeps running. Refresh: a removed container leaves the state; a stopped one turns
  `mustRun` false, so the next `up` starts it again. Delete: `stop -t destroyGraceSeconds` (0 when
  unset), then a forced remove with volumes.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Optional

from tests.e2e.providers.plugin import (
    ADD,
    DELETE,
    UNKNOWN,
    Call,
    Provider,
    ProviderError,
    Resource,
    diff_response,
    reveal,
    serve,
)

VERSION = "5.2.0"
DEFAULT_TIMEOUT = 20 * 60  # the schema's create/update/delete timeouts
SSH = "/usr/bin/ssh"

# Container inputs that change the container in place (or only the state); every other input replaces it.
CONTAINER_UPDATABLE = {
    "restart", "maxRetryCount", "memory", "memorySwap", "memoryReservation", "cpuShares", "cpuSet", "mustRun",
    "destroyGraceSeconds", "init", "healthcheck", "start", "wait", "waitTimeout", "attach", "logs", "rm",
    "removeVolumes", "containerReadRefreshTimeoutMilliseconds",
}  # fmt: skip
# What `docker update` applies; the other updatable inputs change the state only.
CONTAINER_DOCKER_UPDATE = {"restart", "maxRetryCount", "memory", "memorySwap", "cpuShares", "cpuSet"}
CONTAINER_DEFAULTS = {
    "networkMode": "bridge", "restart": "no", "mustRun": True, "start": True, "wait": False, "waitTimeout": 60,
    "attach": False, "logs": False, "rm": False, "removeVolumes": True, "readOnly": False, "tty": False,
    "stdinOpen": False,
}  # fmt: skip
# Inputs this stand-in turns into `docker create` flags; anything else is refused rather than dropped.
CONTAINER_HANDLED = {
    "name", "image", "entrypoints", "command", "envs", "networkMode", "ipcMode", "shmSize", "gpus", "ulimits",
    "mounts", "restart", "maxRetryCount", "init", "privileged", "capabilities", "devices", "labels", "stopTimeout",
    "stopSignal", "memory", "healthcheck", *CONTAINER_DEFAULTS, "destroyGraceSeconds",
}  # fmt: skip
IMAGE_REPLACING = {"name", "pullTriggers", "triggers", "platform"}
RESTART_POLICIES = ("no", "on-failure", "always", "unless-stopped")


# --- the connection ------------------------------------------------------------------------------


class Daemon:
    """One provider instance's Docker daemon at `ssh://…`, reached with the local `ssh` and sshOpts."""

    def __init__(self, host: str, ssh_opts: list[str]):
        self.host = host
        self.ssh_opts = ssh_opts
        self._pinged = False
        self._lock = threading.Lock()
        self._bin = Path(tempfile.mkdtemp(prefix="standin-docker-"))
        quoted = " ".join(shlex.quote(o) for o in ssh_opts)
        # The connection helper puts sshOpts before its own options; ssh keeps the first value of an option.
        (self._bin / "ssh").write_text(f'#!/bin/sh\nexec {SSH} {quoted} "$@"\n')
        (self._bin / "ssh").chmod(0o755)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self._bin}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("DOCKER_HOST", None)
        env.pop("DOCKER_CONTEXT", None)
        return env

    def run(self, *args: str, stdin: Any = None, timeout: float = DEFAULT_TIMEOUT, check: bool = True):
        result = subprocess.run(
            ["docker", "-H", self.host, *args],
            env=self._env(),
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,  # like the connection helper: no controlling terminal for ssh
        )
        if check and result.returncode != 0:
            raise DockerError(result.stderr.strip() or result.stdout.strip())
        return result

    def ping(self) -> None:
        with self._lock:
            if self._pinged:
                return
            result = self.run("version", "--format", "{{.Server.APIVersion}}", check=False, timeout=120)
            if result.returncode != 0 or not result.stdout.strip():
                raise ProviderError(
                    "failed to create Docker client: Error pinging Docker server, please make sure that "
                    f"{self.host} is reachable and has a  '_ping' endpoint. Error: {result.stderr.strip()}"
                )
            self._pinged = True

    def inspect(self, kind: str, ref: str) -> Optional[dict]:
        result = self.run("inspect", "--type", kind, ref, check=False, timeout=120)
        if result.returncode != 0:
            if "No such" in result.stderr or "not found" in result.stderr.lower():
                return None
            raise DockerError(result.stderr.strip())
        return json.loads(result.stdout)[0]


class DockerError(ProviderError):
    pass


_DAEMONS: dict[tuple, Daemon] = {}


def daemon(config: dict[str, Any]) -> Daemon:
    host = reveal(config.get("host")) or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    opts = reveal(config.get("sshOpts")) or []
    if isinstance(opts, str):
        opts = json.loads(opts) if opts else []
    key = (host, tuple(opts))
    if key not in _DAEMONS:
        _DAEMONS[key] = Daemon(host, list(opts))
    return _DAEMONS[key]


def check_config(config: dict[str, Any]) -> list[tuple[str, str]]:
    host = reveal(config.get("host")) or ""
    if isinstance(host, str) and host.startswith("ssh://"):
        url = urllib.parse.urlsplit(host)
        if url.password is not None:
            return [("host", "ssh host connection is not valid: invalid SSH URL: plain-text password is not supported")]
        if url.query or url.fragment:
            return [
                (
                    "host",
                    f"ssh host connection is not valid: invalid SSH URL: query parameters are not allowed: {url.query!r}",
                )
            ]
    opts = reveal(config.get("sshOpts"))
    if isinstance(opts, str) and opts:
        try:
            json.loads(opts)
        except json.JSONDecodeError as error:
            return [("sshOpts", f"CheckConfig failed because of malformed resource inputs: {error}")]
    return []


def _timeout(call: Call) -> float:
    return call.timeout or DEFAULT_TIMEOUT


# --- RemoteImage --------------------------------------------------------------------------------------


def repo_digest(name: str, found: dict) -> str:
    digests = found.get("RepoDigests") or []
    if not digests:
        return ""
    if len(digests) == 1:
        return digests[0]
    repository = name.split("@", 1)[0].rsplit(":", 1)[0] if ":" in name.split("/")[-1] else name.split("@", 1)[0]
    return next((d for d in digests if d.startswith(repository + "@")), digests[0])


def find_or_pull(call: Call, docker: Daemon, name: str) -> dict:
    """The image by name, from the node itself when it is there, else pulled (no progress is shown)."""
    found = docker.inspect("image", name)
    if found is None:
        try:
            docker.run("pull", "--quiet", name, timeout=_timeout(call))
        except subprocess.TimeoutExpired:
            raise ProviderError(f"unable to pull image {name}: context deadline exceeded") from None
        except DockerError as error:
            raise ProviderError(
                f"Unable to read Docker image into resource: unable to pull image {name}: {error}"
            ) from None
        found = docker.inspect("image", name)
    if found is None:
        raise ProviderError(f"Unable to read Docker image into resource: unable to find or pull image {name}")
    return found


class RemoteImage(Resource):
    def check(self, call: Call, olds: dict, news: dict):
        failures = [] if news.get("name") not in (None, "") else [("name", "Missing required argument")]
        return news, failures

    def diff(self, call: Call, id_: str, old_inputs: dict, olds: dict, news: dict):
        return diff_response(old_inputs, news, lambda key, path, kind: key in IMAGE_REPLACING)

    def _outputs(self, inputs: dict, found: dict) -> dict:
        name = reveal(inputs["name"])
        return {**inputs, "imageId": found["Id"], "repoDigest": repo_digest(name, found)}

    def create(self, call: Call, news: dict):
        if call.preview:
            return "", {**news, "imageId": UNKNOWN, "repoDigest": UNKNOWN}
        docker = daemon(call.config)
        docker.ping()
        name = reveal(news["name"])
        found = find_or_pull(call, docker, name)
        return found["Id"] + name, self._outputs(news, found)

    def read(self, call: Call, id_: str, olds: dict, inputs: dict):
        docker = daemon(call.config)
        docker.ping()
        found = docker.inspect("image", reveal(olds["name"]))
        if found is None:
            return "", {}, {}
        return found["Id"] + reveal(olds["name"]), self._outputs(inputs or olds, found), inputs or olds

    def update(self, call: Call, id_: str, olds: dict, news: dict, old_inputs: dict):
        if call.preview:
            return {**news, "imageId": olds.get("imageId"), "repoDigest": olds.get("repoDigest")}
        docker = daemon(call.config)
        docker.ping()
        return self._outputs(news, find_or_pull(call, docker, reveal(news["name"])))

    def delete(self, call: Call, id_: str, olds: dict, old_inputs: dict):
        docker = daemon(call.config)
        docker.ping()
        if olds.get("keepLocally"):
            return
        name = reveal(olds["name"])
        if docker.inspect("image", name) is None:
            return
        try:
            docker.run("rmi", *(["--force"] if olds.get("forceRemove") else []), name)
        except DockerError as error:
            raise ProviderError(f"Unable to remove Docker image: {error}") from None


# --- Container ----------------------------------------------------------------------------------------


def _mounts_replace(path: str, kind: int) -> bool:
    # A set of blocks forces replacement when its size changes; a field changed inside an element of
    # a set of the same size is an update (terraform-plugin-sdk semantics the bridge reproduces).
    return path == "mounts" or (path.count("[") == 1 and path.endswith("]") and kind in (ADD, DELETE))


def container_replaces(key: str, path: str, kind: int) -> bool:
    if key in CONTAINER_UPDATABLE:
        return False
    if key == "mounts":
        return _mounts_replace(path, kind)
    return True


def create_args(inputs: dict[str, Any], env_file: str) -> list[str]:
    unknown = sorted(
        k for k in inputs if k not in CONTAINER_HANDLED and not k.startswith("__") and inputs[k] is not None
    )
    if unknown:
        raise ProviderError(f"the stand-in docker provider does not implement container inputs {unknown}")
    argv = ["create", "--name", inputs["name"], "--env-file", env_file]
    entrypoints = inputs.get("entrypoints") or []
    if entrypoints:
        argv += ["--entrypoint", entrypoints[0]]
    argv += ["--network", inputs.get("networkMode") or "bridge"]
    restart = inputs.get("restart") or "no"
    if restart == "on-failure" and inputs.get("maxRetryCount"):
        restart += f":{inputs['maxRetryCount']}"
    argv += ["--restart", restart]
    if inputs.get("ipcMode"):
        argv += ["--ipc", inputs["ipcMode"]]
    if inputs.get("shmSize"):
        argv += ["--shm-size", f"{int(inputs['shmSize'])}m"]
    if inputs.get("memory"):
        argv += ["--memory", f"{int(inputs['memory'])}m"]
    if inputs.get("gpus"):
        argv += ["--gpus", inputs["gpus"]]
    for limit in inputs.get("ulimits") or []:
        argv += ["--ulimit", f"{limit['name']}={int(limit['soft'])}:{int(limit['hard'])}"]
    for mount in inputs.get("mounts") or []:
        spec = f"type={mount['type']},target={mount['target']}"
        if mount.get("source"):
            spec += f",source={mount['source']}"
        argv += ["--mount", spec + (",readonly" if mount.get("readOnly") else "")]
    argv.append(f"--init={'true' if inputs.get('init') else 'false'}")
    if inputs.get("privileged"):
        argv.append("--privileged")
    for capability in (inputs.get("capabilities") or {}).get("adds") or []:
        argv += ["--cap-add", capability]
    for capability in (inputs.get("capabilities") or {}).get("drops") or []:
        argv += ["--cap-drop", capability]
    for device in inputs.get("devices") or []:
        target = device.get("containerPath") or device["hostPath"]
        argv += ["--device", f"{device['hostPath']}:{target}:{device.get('permissions') or 'rwm'}"]
    for label in inputs.get("labels") or []:
        argv += ["--label", f"{label['label']}={label['value']}"]
    if inputs.get("stopTimeout") is not None:
        argv += ["--stop-timeout", str(int(inputs["stopTimeout"]))]
    if inputs.get("stopSignal"):
        argv += ["--stop-signal", inputs["stopSignal"]]
    if inputs.get("rm"):
        argv.append("--rm")
    return [*argv, inputs["image"], *entrypoints[1:], *(inputs.get("command") or [])]


class Container(Resource):
    def check(self, call: Call, olds: dict, news: dict):
        inputs = {**{k: v for k, v in CONTAINER_DEFAULTS.items() if news.get(k) is None}, **news}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        failures = []
        if inputs.get("image") in (None, ""):
            failures.append(("image", "Missing required argument"))
        if not inputs.get("name"):
            # Autonaming: `<resource name>-<7 hex>`, kept from the previous inputs.
            inputs["name"] = olds.get("name") or f"{call.name}-{secrets.token_hex(4)[:7]}"
        if inputs.get("gpus") and inputs.get("deviceRequests"):
            failures.append(("gpus", '"gpus": conflicts with device_requests'))
        if inputs.get("restart") not in RESTART_POLICIES:
            failures.append(("restart", f"expected restart to match one of {list(RESTART_POLICIES)}"))
        for index, mount in enumerate(reveal(inputs.get("mounts")) or []):
            if isinstance(mount, dict) and mount.get("type") not in ("bind", "volume", "tmpfs"):
                failures.append((f"mounts[{index}].type", "expected type to be one of [bind volume tmpfs]"))
        return inputs, failures

    def diff(self, call: Call, id_: str, old_inputs: dict, olds: dict, news: dict):
        return diff_response(old_inputs, news, container_replaces, delete_before_replace=True)

    def _outputs(self, inputs: dict, found: dict) -> dict:
        state = found.get("State") or {}
        outputs = {
            **inputs,
            "hostname": (found.get("Config") or {}).get("Hostname", ""),
            "exitCode": None if state.get("Running") else state.get("ExitCode"),
            "bridge": "",
            "networkDatas": [],
        }
        if not state.get("Running") and outputs.get("mustRun"):
            outputs["mustRun"] = False  # the real provider's drift marker: the next `up` starts it again
        return outputs

    def create(self, call: Call, news: dict):
        if call.preview:
            return "", {**news, "hostname": UNKNOWN, "exitCode": UNKNOWN, "bridge": UNKNOWN, "networkDatas": UNKNOWN}
        docker = daemon(call.config)
        docker.ping()
        plain = reveal(news)
        image = plain["image"]
        try:
            find_or_pull(call, docker, image)
        except ProviderError as error:
            raise ProviderError(f"Unable to create container with image {image}: {error}") from None
        with tempfile.NamedTemporaryFile("w", delete=False) as env_file:
            os.chmod(env_file.name, 0o600)  # the API carries env in a request body, never in an argv
            env_file.write("".join(f"{e}\n" for e in plain.get("envs") or []))
        try:
            try:
                container_id = docker.run(*create_args(plain, env_file.name), timeout=_timeout(call)).stdout.strip()
            except DockerError as error:
                raise ProviderError(f"Unable to create container: {error}") from None
        finally:
            os.unlink(env_file.name)
        if plain.get("start", True):
            try:
                docker.run("start", container_id, timeout=_timeout(call))
            except DockerError as error:
                raise ProviderError(f"Unable to start container: {error}") from None
            if plain.get("wait"):
                self._wait_healthy(docker, container_id, plain)
        found = docker.inspect("container", container_id) or {}
        return container_id, self._outputs(news, found)

    @staticmethod
    def _wait_healthy(docker: Daemon, container_id: str, plain: dict) -> None:
        deadline = time.monotonic() + int(plain.get("waitTimeout") or 60)
        while time.monotonic() < deadline:
            health = ((docker.inspect("container", container_id) or {}).get("State") or {}).get("Health")
            if health is None:
                raise ProviderError(
                    "you have supplied a 'wait' argument, but the container does not have a healthcheck defined"
                )
            if health.get("Status") == "healthy":
                return
            time.sleep(1)
        raise ProviderError("container failed to be in healthy state")

    def read(self, call: Call, id_: str, olds: dict, inputs: dict):
        docker = daemon(call.config)
        docker.ping()
        found = docker.inspect("container", id_)
        if found is None or found.get("Id") != id_:
            return "", {}, {}
        outputs = self._outputs(olds, found)
        inputs = dict(inputs or olds)
        if outputs.get("mustRun") is False and inputs.get("mustRun") is not False:
            inputs["mustRun"] = False
        return id_, outputs, inputs

    def update(self, call: Call, id_: str, olds: dict, news: dict, old_inputs: dict):
        computed = {k: olds.get(k) for k in ("hostname", "exitCode", "bridge", "networkDatas")}
        if call.preview:
            return {**news, **computed}
        docker = daemon(call.config)
        docker.ping()
        plain_new, plain_old = reveal(news), reveal(old_inputs)
        if plain_new.get("mustRun") and not plain_old.get("mustRun") and plain_new.get("start", True):
            docker.run("start", id_)
        if any(plain_new.get(k) != plain_old.get(k) for k in CONTAINER_DOCKER_UPDATE):
            restart = plain_new.get("restart") or "no"
            if restart == "on-failure" and plain_new.get("maxRetryCount"):
                restart += f":{plain_new['maxRetryCount']}"
            args = ["update", f"--restart={restart}"]
            if plain_new.get("memory"):
                args.append(f"--memory={int(plain_new['memory'])}m")
            try:
                docker.run(*args, id_)
            except DockerError as error:
                raise ProviderError(f"Unable to update a container: {error}") from None
        return {**news, **computed}

    def delete(self, call: Call, id_: str, olds: dict, old_inputs: dict):
        docker = daemon(call.config)
        docker.ping()
        plain = reveal(olds)
        if not plain.get("attach"):
            grace = int(plain.get("destroyGraceSeconds") or 0)
            result = docker.run("stop", "-t", str(grace), id_, check=False, timeout=grace + 120)
            if result.returncode != 0 and "No such container" not in result.stderr:
                raise ProviderError(f"Error stopping container {id_}: {result.stderr.strip()}")
        args = ["rm", "--force", *(["--volumes"] if plain.get("removeVolumes", True) else []), id_]
        result = docker.run(*args, check=False)
        if result.returncode != 0 and "No such container" not in result.stderr and "in progress" not in result.stderr:
            raise ProviderError(f"Error deleting container {id_}: {result.stderr.strip()}")


def diff_config(old: dict, new: dict):
    # No key forces a provider replacement: a new host or sshOpts re-configures it, resources stay.
    return diff_response(old, new)


PROVIDER = Provider(
    name="docker",
    version=VERSION,
    resources={
        "docker:index/remoteImage:RemoteImage": RemoteImage(),
        "docker:index/container:Container": Container(),
    },
    check_config=check_config,
    diff_config=diff_config,
)


if __name__ == "__main__":
    serve(PROVIDER)
