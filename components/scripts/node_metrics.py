# The node's own metrics for Prometheus (metrics.nodePort; the
# supervisor serves them): the node's memory (MemTotal, MemAvailable: on a GB10 the GPU's too),
# the GPUs' own memory where nvidia-smi reports it, and what the supervisor counts of vLLM (restarts, whether
# it serves, the OOM guard's endings). Served on the node's fabric address, which only the other nodes reach
# with network.guard. Standard library only.
import http.server
import socketserver
import threading

from components.scripts.node_contract import Fault, VllmState
from components.scripts.node_gpus import gpu_memory, meminfo
from components.scripts.node_log import say

METRIC_HELP = {
    "spark_vllm_node_memory_total_bytes": ("gauge", "MemTotal of the node (on a GB10, the GPU's memory too)"),
    "spark_vllm_node_memory_available_bytes": ("gauge", "MemAvailable of the node"),
    "spark_vllm_gpu_memory_total_bytes": ("gauge", "A GPU's own memory, where nvidia-smi reports it"),
    "spark_vllm_gpu_memory_used_bytes": ("gauge", "A GPU's memory in use, where nvidia-smi reports it"),
    "spark_vllm_vllm_restarts_total": ("counter", "vLLM restarts by this node's supervisor"),
    "spark_vllm_vllm_serving": ("gauge", "1 when vLLM answers /health (its API server's node) or runs (a rank)"),
    "spark_vllm_oom_guarded_total": ("counter", "times memory.oomGuard ended vLLM"),
    "spark_vllm_vllm_faults_total": (
        "counter",
        "times the supervisor ended a vLLM that still answered /health, by kind: stalled, wrong (the canary's tokens "
        "changed), head_gone (a headless rank whose API server went away)",
    ),
}


def node_metrics_text(node, status):
    """The exposition text (Prometheus 0.0.4) of this node now (`status`: the supervisor's SupervisorStatus)."""
    samples = []
    found = meminfo()
    if found is not None:
        samples.append(("spark_vllm_node_memory_total_bytes", {}, found[0] * 2**20))
        samples.append(("spark_vllm_node_memory_available_bytes", {}, found[1] * 2**20))
    for index, total, free in gpu_memory(None) or []:
        samples.append(("spark_vllm_gpu_memory_total_bytes", {"gpu": str(index)}, total * 2**20))
        samples.append(("spark_vllm_gpu_memory_used_bytes", {"gpu": str(index)}, (total - free) * 2**20))
    samples.append(("spark_vllm_vllm_restarts_total", {}, status.restarts_total))
    samples.append(("spark_vllm_vllm_serving", {}, 1 if status.state == VllmState.RUNNING else 0))
    samples.append(("spark_vllm_oom_guarded_total", {}, status.oom_guarded))
    for kind in Fault.ALL:
        samples.append(("spark_vllm_vllm_faults_total", {"kind": kind}, status.faults.get(kind, 0)))
    lines, typed = [], set()
    for name, labels, value in samples:
        if name not in typed:
            kind, text = METRIC_HELP[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            typed.add(name)
        tags = ",".join(f'{key}="{val}"' for key, val in sorted({"node": node, **labels}.items()))
        lines.append(f"{name}{{{tags}}} {float(value):g}")
    return "\n".join(lines) + "\n"


class QuietServer(http.server.ThreadingHTTPServer):
    """http.server's, without its bind's name lookup: `HTTPServer.server_bind` asks the resolver for the address's
    name (socket.getfqdn) and nothing here reads it; on a node whose name server does not answer that lookup held
    the supervisor, and so vLLM's start, 10 s (two tries of 5 s; seen on the simulated nodes, 2026-12-07)."""

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def serve_node_metrics(address, port, node, status):
    """Serves the metrics (`status()`: the supervisor's SupervisorStatus now) from a daemon thread; a port it cannot
    take is said and left (vLLM is what matters)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = node_metrics_text(node, status()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    try:
        server = QuietServer((address, port), Handler)
    except OSError as error:
        say(f"the node metrics cannot listen on {address}:{port} ({error}); serving none")
        return None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(f"node metrics on http://{address}:{port}/metrics")
    return server
