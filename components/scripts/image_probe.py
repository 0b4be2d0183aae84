# Runs in a throwaway container of the node's image (`docker run --rm -i --entrypoint python3 IMAGE -`,
# this script on stdin; see components.checks.image_check). Says what the image holds that the
# deployment relies on, as one JSON line:
#   {"python": "3.12.3", "vllm": "0.25.0" | null, "vllm_nnodes": true | false | null,
#    "ray": "2.60.0" | null, "ray_dashboard": true | false | null, "ray_dashboard_error": "..."}
# vllm_load_tracking: whether it has --enable-server-load-tracking (vLLM 0.8 and later; the program sets it: the
# stall watch reads /load), read from the file that release declares the API server's flags in (SERVER_FLAG_FILES);
# vllm_scale_out: whether it has --enable-scale-out (0.30 on: the render routes vllm-router's cache_aware asks for).
# vllm_nnodes: whether `vllm serve` has the multi-node mp flags (--nnodes, --node-rank, …), read from
# vLLM's own argument definitions (vllm/engine/arg_utils.py) without importing vLLM (that takes torch
# and seconds); an image with a `vllm` command but no `vllm` package is asked `vllm serve --help`.
# ray_dashboard: whether `ray start --include-dashboard=true` can start: Ray imports
# ray.dashboard.optional_deps for that (ray/_private/utils.py get_dashboard_dependency_error), which
# plain `ray` lacks (`ray[default]` has it). That module is imports alone; it runs here from its file, without the
# `ray` package's own import (1.3-1.5 CPU-s in the rehearsal's image, nine tenths of this probe's, 2026-12-07).
# bytecode: {"vllm": true | false | null, "torch": …}, whether the package's modules have their compiled
# bytecode beside them (importlib's cache_from_source of a sample of its files); dont_write_bytecode:
# whether the image runs Python with PYTHONDONTWRITEBYTECODE. Both false/true: every start of each of
# vLLM's processes compiles those sources again (seen on an H200: `import torch` 4.6 s instead of 1.4 s).
# torch, torch_cuda, torch_arch, nccl: torch's version, the CUDA it was built for, the GPU code it carries, the
# NCCL it loads: what the host check (components/plan/host.py) holds against the node's driver and GPUs.
# Standard library only.
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys

from components.scripts.node_contract import ImageFacts

try:
    import importlib.metadata as metadata
except ImportError:  # Python 3.7 (no image with a vLLM this program runs has it): the versions are then unknown
    metadata = None


def version(name):
    if metadata is None:
        return None
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def command_output(argv):
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout + result.stderr


def source_has(root, path, needle):
    """Whether vLLM's source file `path` (under its package `root`) holds `needle`; None when unreadable."""
    try:
        with open(os.path.join(root, *path.split("/"))) as handle:
            return needle in handle.read()
    except OSError:
        return None


# Where each vLLM release declares the API server's flags (components/plan/vllm_versions.py CHANGES,
# load_tracking_file: 0.25-0.28, 0.29-0.32, 0.33 on); a flag is looked for in all of them.
SERVER_FLAG_FILES = (
    "entrypoints/openai/cli_args.py",
    "entrypoints/launchers/cli_args.py",
    "entrypoints/common/cli_args.py",
)


def any_source_has(root, paths, needle):
    """Whether any of vLLM's source files `paths` holds `needle`; None when none of them is readable."""
    found = [source_has(root, path, needle) for path in paths]
    if any(found):
        return True
    return None if all(item is None for item in found) else False


def vllm_facts():
    """(version, has --nnodes, has --enable-server-load-tracking, has --enable-scale-out), None each where nothing
    can tell."""
    found = version("vllm")
    spec = importlib.util.find_spec("vllm") if found else None
    if spec is not None and spec.submodule_search_locations:
        root = list(spec.submodule_search_locations)[0]
        tracking = any_source_has(root, SERVER_FLAG_FILES, "enable_server_load_tracking")
        scale_out = any_source_has(root, SERVER_FLAG_FILES, "enable_scale_out")
        return found, source_has(root, "engine/arg_utils.py", '"--nnodes"'), tracking, scale_out
    if shutil.which("vllm"):
        said = command_output(["vllm", "--version"]).strip().splitlines()
        flags = command_output(["vllm", "serve", "--help"])
        tracking, scale_out = "--enable-server-load-tracking" in flags, "--enable-scale-out" in flags
        return (said[-1].strip() if said else "unknown"), "--nnodes" in flags, tracking, scale_out
    return None, None, None, None


def ray_facts():
    found = version("ray")
    if found is None:
        return None, None, None
    spec = importlib.util.find_spec("ray")  # where the package is; finding it imports nothing
    deps = None
    if spec is not None and spec.submodule_search_locations:
        deps = os.path.join(list(spec.submodule_search_locations)[0], "dashboard", "optional_deps.py")
    try:
        if deps and os.path.isfile(deps):
            runpy.run_path(deps)  # what `ray start` imports for the dashboard, each import as Ray makes it
        else:  # a Ray that keeps it elsewhere: imported as Ray imports it
            import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as error:
        return found, False, str(error)
    return found, True, None


def has_bytecode(name, sample=40):
    """Whether most of a sample of the package's .py files have their .pyc (None: not installed)."""
    spec = importlib.util.find_spec(name) if version(name) else None
    if spec is None or not spec.submodule_search_locations:
        return None
    sources = []
    for folder, _dirs, files in os.walk(list(spec.submodule_search_locations)[0]):
        sources.extend(os.path.join(folder, file) for file in files if file.endswith(".py"))
        if len(sources) >= sample:
            break
    if not sources:
        return None
    compiled = sum(os.path.exists(importlib.util.cache_from_source(path)) for path in sources[:sample])
    return compiled * 2 >= len(sources[:sample])


NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")  # the NCCL torch's wheels load


def torch_facts():
    """(version, the CUDA it was built for, the GPU code it carries, the NCCL it loads); None each where nothing
    can tell. The CUDA is read from torch/version.py without importing torch; the GPU code needs the import (torch
    keeps the list in its library), in a process of its own so a torch that cannot load says None, not a crash."""
    found = version("torch")
    spec = importlib.util.find_spec("torch") if found else None
    if spec is None or not spec.submodule_search_locations:
        return None, None, None, None
    cuda = None
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as handle:
            built = re.search(r"^cuda\b[^=\n]*=\s*['\"]([0-9][0-9.]*)['\"]", handle.read(), re.MULTILINE)
            cuda = built.group(1) if built else None
    except OSError:
        pass
    arch = None
    if cuda:
        said = command_output([sys.executable, "-c", "import torch; print(torch._C._cuda_getArchFlags())"]).split()
        arch = sorted({flag for flag in said if re.match(r"^(sm|compute)_[0-9]+[a-z]?$", flag)}) or None
    nccl = next((version(name) for name in NCCL_PACKAGES if version(name)), None)
    return found, cuda, arch, nccl


vllm, nnodes, load_tracking, scale_out = vllm_facts()
torch, torch_cuda, torch_arch, nccl = torch_facts()
ray, dashboard, dashboard_error = ray_facts()
facts = ImageFacts(
    python=sys.version.split()[0],
    vllm=vllm,
    vllm_nnodes=nnodes,
    vllm_load_tracking=load_tracking,
    vllm_scale_out=scale_out,
    ray=ray,
    ray_dashboard=dashboard,
    ray_dashboard_error=dashboard_error or None,
    bytecode={name: has_bytecode(name) for name in ("vllm", "torch")},
    dont_write_bytecode=bool(sys.flags.dont_write_bytecode),
    torch=torch,
    torch_cuda=torch_cuda,
    torch_arch=torch_arch,
    nccl=nccl,
)
print(json.dumps(facts.to_json(), sort_keys=True))
