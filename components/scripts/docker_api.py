# The Docker Engine API over its unix socket (DOCKER_HOST when it is unix://, else /var/run/docker.sock), for the
# scripts that talk to it (image_pull.py, node_fabric_copy.py import it). Standard library only, no side effects.
import http.client
import json
import os
import socket


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)
        self.raw = self.sock  # kept: http.client drops `sock` once a response reads to the end


def docker_socket():
    host = os.environ.get("DOCKER_HOST", "")
    return host[len("unix://") :] if host.startswith("unix://") else "/var/run/docker.sock"


# The newest Docker Engine API these calls were checked against (Docker 29 speaks 1.52 and refuses clients
# below 1.44; Docker 20.10 speaks 1.41): the version is negotiated as the Docker SDKs do (docker-py
# `version="auto"`, the Go client's NegotiateAPIVersion): ask the unversioned GET /version, then speak
# min(its ApiVersion, NEWEST_API), never below its MinAPIVersion.
NEWEST_API = (1, 52)
negotiated = {}


def _version(text):
    major, minor = str(text).split(".")[:2]
    return int(major), int(minor)


def api_prefix():
    """`/v1.NN`, negotiated once with the daemon."""
    if "prefix" not in negotiated:
        connection = UnixConnection(docker_socket(), 30)
        try:
            connection.request("GET", "/version")
            response = connection.getresponse()
            facts = json.loads(response.read() or b"{}") if response.status == 200 else {}
        finally:
            connection.close()
        daemon = _version(facts.get("ApiVersion") or "1.24")
        lowest = _version(facts.get("MinAPIVersion") or "1.12")
        major, minor = max(min(daemon, NEWEST_API), lowest)
        negotiated["prefix"] = f"/v{major}.{minor}"
        negotiated["said"] = f"Docker {facts.get('Version', '?')}, Engine API {major}.{minor}"
    return negotiated["prefix"]
