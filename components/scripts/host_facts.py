# Runs on a node's HOST over SSH as `env FABRIC_IF=… python3 -` with this script on stdin (components/resources/
# checks/host_check.py). Says what the host runs that decides whether the image can: one JSON line, each fact
# null where the host cannot say (HostFacts in node_contract.py is how the program reads it):
#   kernel, os                 `uname -r`, /etc/os-release's PRETTY_NAME
#   driver, cuda               the NVIDIA driver's version and the highest CUDA it supports (nvidia-smi's header)
#   gpus                       [{"name", "compute_cap"}] each GPU (`nvidia-smi --query-gpu=name,compute_cap`)
#   docker_runtimes, cdi_nvidia Docker's runtimes (`docker info`), whether a CDI spec names nvidia.com/gpu
#   toolkit                    the NVIDIA Container Toolkit's version (nvidia-ctk, else nvidia-container-cli)
#   rdma_core                  rdma-core's package version (dpkg, else rpm)
#   nic_firmware               the fabric interface's firmware (`ethtool -i`)
# Standard library only, Python 3.7 (the oldest python3 a node's host may have: node_contract.py).
import json
import os
import platform
import re
import subprocess

CDI_DIRS = ("/etc/cdi", "/var/run/cdi")


def said(argv, timeout=30):
    """A command's stdout, or None when it is missing, fails or hangs."""
    try:
        result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.decode("utf-8", "replace").strip()


def os_release(path="/etc/os-release"):
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"') or None
    except OSError:
        pass
    return None


def nvidia():
    """(driver, cuda, gpus) from nvidia-smi; None each where it cannot say."""
    gpus, driver = [], None
    rows = said(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"])
    for row in (rows or "").splitlines():
        parts = [part.strip() for part in row.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "compute_cap": parts[1] if re.match(r"^\d+\.\d+$", parts[1]) else None})
            driver = driver or parts[2]
    header = said(["nvidia-smi"]) or ""
    cuda = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", header)
    if driver is None:
        found = re.search(r"Driver Version:\s*([0-9.]+)", header)
        driver = found.group(1) if found else None
    return driver, (cuda.group(1) if cuda else None), (gpus if rows is not None else None)


def docker_runtimes():
    out = said(["docker", "info", "--format", "{{json .Runtimes}}"])
    try:
        return sorted(json.loads(out)) if out else None
    except ValueError:
        return None


def cdi_nvidia():
    """Whether a CDI spec of the host names NVIDIA's GPUs (nvidia-ctk cdi generate writes /etc/cdi/nvidia.yaml)."""
    seen = False
    for folder in CDI_DIRS:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        seen = True
        for name in names:
            try:
                with open(os.path.join(folder, name)) as handle:
                    if "nvidia.com/gpu" in handle.read():
                        return True
            except OSError:
                continue
    return False if seen else None


def toolkit():
    for argv in (["nvidia-ctk", "--version"], ["nvidia-container-cli", "--version"]):
        out = said(argv)
        found = re.search(r"version:?\s*v?([0-9][0-9.]*)", out or "", re.IGNORECASE)
        if found:
            return found.group(1)
    return None


def rdma_core():
    return said(["dpkg-query", "-W", "-f", "${Version}", "rdma-core"]) or said(
        ["rpm", "-q", "--qf", "%{VERSION}", "rdma-core"]
    )


def nic_firmware(interface):
    out = said(["ethtool", "-i", interface]) if interface else None
    found = re.search(r"^firmware-version:\s*(.+)$", out or "", re.MULTILINE)
    return found.group(1).strip() if found and found.group(1).strip() not in ("", "N/A") else None


driver, cuda, gpus = nvidia()
print(
    json.dumps(
        {
            "kernel": said(["uname", "-r"]) or platform.release() or None,
            "os": os_release(),
            "driver": driver,
            "cuda": cuda,
            "gpus": gpus,
            "docker_runtimes": docker_runtimes(),
            "cdi_nvidia": cdi_nvidia(),
            "toolkit": toolkit(),
            "rdma_core": rdma_core(),
            "nic_firmware": nic_firmware(os.environ.get("FABRIC_IF", "")),
        },
        sort_keys=True,
    )
)
