# The fabric gate's NCCL test (fabric.bandwidthTest: nccl): runs in the node's IMAGE as `python3 -`
# (its parameters in the program: node_params.py) through `docker run --gpus all
# --network host` with the Ray container's NCCL environment, on every node at once, once the fabric
# gate passed and every node has the image. One rank a node (its first GPU): an all-reduce of
# PARAMS["megabytes"] MiB, `warmup` times then `iterations` timed, as nccl-tests' all_reduce_perf
# measures it. Prints one JSON line of facts; components/fabric.py turns them into the bus bandwidth
# (algorithm bandwidth x 2(n-1)/n) and judges it. Never fails itself: an error is a fact too, with the
# tail of NCCL's own log, so every node's outcome reaches the one list of problems.
#
#   network     what NCCL chose ("IB" for RDMA, RoCE included; "Socket" for its TCP fallback), from
#               its INFO log (NCCL_DEBUG_FILE); `devices`: per network the devices it listed
#   transports  how the channels between the ranks go ("NET/IB/0", "NET/Socket/0", …)
#   seconds     per timed all-reduce, averaged; `correct`: the first one summed to the world size
import json
import os
import re
import sys
import threading
import time
import traceback

from components.scripts.node_contract import NcclFacts, NcclParams
from components.scripts.node_params import given

P = NcclParams.from_json(given())
LOG = f"/tmp/spark-vllm-nccl-{P.node}.{os.getpid()}.log"
facts = {"node": P.node, "rank": P.rank, "world": P.world}
started = time.monotonic()


def nccl_log():
    try:
        with open(LOG, errors="replace") as handle:
            return handle.read().splitlines()
    except OSError:
        return []


def say(extra):
    lines = nccl_log()
    network = [m.group(1) for line in lines for m in [re.search(r"Using network (\S+)", line)] if m]
    facts["network"] = network[-1] if network else None
    # per network, the devices NCCL lists ("NET/IB : Using [0]rocep1s0f1:1/RoCE …"; NCCL 2.28 lists IB's
    # out-of-band interface even when it found no IB device, "NET/IB : No device found.")
    facts["devices"] = {m.group(1): m.group(2).strip()[:300] for line in lines
                        for m in [re.search(r"NET/(\w+) : Using (.*)", line)] if m}  # fmt: skip
    facts["transports"] = sorted({m.group(1) for line in lines for m in [re.search(r"via (\S+)", line)] if m})
    if "error" in extra:
        facts["log_tail"] = [line[-300:] for line in lines if " WARN " in line or "NCCL INFO NET" in line][-12:]
    facts.update(extra, total_seconds=round(time.monotonic() - started, 2))
    print(json.dumps(NcclFacts(**facts).to_json(), sort_keys=True), flush=True)


def watchdog():
    # A peer that never comes, or a hung collective: say so before `docker run` is given up on.
    say({"error": f"no result within {P.timeout_seconds} s (a peer's test never started, or NCCL hung)"})
    os._exit(0)


# NCCL reads its settings when the communicator is made: its INFO log goes to a file of its own, so
# the network it chose is known even when the user's nccl.debug is off.
os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=LOG)
timer = threading.Timer(P.timeout_seconds, watchdog)
timer.daemon = True
timer.start()
try:
    import datetime

    import torch
    import torch.distributed as dist

    facts["torch"], facts["import_seconds"] = torch.__version__, round(time.monotonic() - started, 2)
    facts["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://{P.master_address}:{P.port}",
        rank=P.rank,
        world_size=P.world,
        timeout=datetime.timedelta(seconds=P.timeout_seconds),
        device_id=torch.device("cuda", 0),  # the communicator is made now, not at the first collective
    )
    facts["init_seconds"] = round(time.monotonic() - started, 2)
    size = P.megabytes << 20
    tensor = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    facts["correct"] = float(tensor[0]) == P.world and float(tensor[-1]) == P.world
    for _ in range(P.warmup):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    dist.barrier()
    begin = time.perf_counter()
    for _ in range(P.iterations):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - begin) / P.iterations
    dist.destroy_process_group()
    timer.cancel()
    say({"bytes": size, "seconds": seconds, "iterations": P.iterations})
except Exception as error:  # noqa: BLE001 - every failure is a fact for the judge
    timer.cancel()
    said = traceback.format_exception_only(type(error), error)[-1].strip()
    say({"error": said[-600:], "python": sys.version.split()[0]})
