# network.guard on one node: the ports of Ray, of the ranks (NCCL, Gloo, torch: the kernel's
# ephemeral range), of vLLM's master (executor mp) and of the copy depot accept TCP and UDP only from the
# other nodes' fabric addresses arriving on the fabric interface, and from the node itself
# (loopback); replies to connections this node opened pass. vLLM's API port stays open, or open
# to the given source networks only. SSH is never matched, and nothing is ever opened: the rules
# only drop.
#
# The rules live in a table of their own (nftables: `inet spark_vllm_guard`) or, on a host with
# iptables only, in a chain of their own (SPARK-VLLM-GUARD, jumped to first from INPUT, for IPv4
# and IPv6); they are replaced in one transaction, so applying twice is applying once.
#
# Runs in a container of the node's own image with host networking and CAP_NET_ADMIN. The host's
# own nft (or iptables) runs by chroot into the host's /usr and /etc, mounted read-only at
# P.host_root (a merged-/usr host, as every current Ubuntu and Debian is).
#
# With P.spec.owned, the ports listed there on loopback are reached only from sockets of the users named
# (the owner match of the OUTPUT hook: `meta skuid`, `-m owner --uid-owner`); anyone else's connect is
# refused at once. vllm-router's port on its node: its admin API has no authentication.
#
# P.action:
#   check   say which tool the host has; fail, naming the node, when it has neither
#   run     the guard container's main process: apply, write the marker (boot id, spec hash), then
#           every check_seconds put the rules back if something removed them (a firewall tool
#           flushing the ruleset); on SIGTERM exit and leave the rules (a reboot clears them, and
#           the container applies them again when Docker starts it, before the node's Ray starts)
#   ready   wait until the marker shows this spec's hash in this boot
#   remove  remove the rules and the marker (the stack's destroy, or network.guard turned off)
#   show    print the rules it would write (P.backend: nft or iptables), change nothing
import json
import os
import signal
import subprocess
import sys
import time

from components.scripts.node_contract import GuardParams
from components.scripts.node_params import given
from components.scripts.node_timing import polls

P = GuardParams.from_json(given())
TABLE = "spark_vllm_guard"
CHAIN = "SPARK-VLLM-GUARD"
OUT_CHAIN = "SPARK-VLLM-GUARD-OUT"  # the owner match, jumped to from OUTPUT
ROOT = P.host_root


class GuardError(Exception):
    pass


def say(message):
    print(f"[{P.node}] network.guard: {message}", flush=True)


def boot_id():
    with open("/proc/sys/kernel/random/boot_id") as handle:
        return handle.read().strip()


# --- the host's tools ------------------------------------------------------------------------


def prepare_root():
    """The host's /usr and /etc are mounted at ROOT; its /bin, /sbin, /lib… are links into /usr."""
    if ROOT == "/":
        return
    for name in ("bin", "sbin", "lib", "lib64"):
        path = os.path.join(ROOT, name)
        if not os.path.lexists(path) and os.path.isdir(os.path.join(ROOT, "usr", name)):
            os.symlink(f"usr/{name}", path)


def host(argv, text=None, check=True):
    """Run a host tool in the host's root (chroot), in this (the host's) network namespace."""
    full = argv if ROOT == "/" else ["chroot", ROOT, *argv]
    result = subprocess.run(full, input=text, capture_output=True, text=True)
    if check and result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()[-1500:]
        raise GuardError(f"`{' '.join(argv)}` failed ({result.returncode}): {detail}")
    return result


def has(tool):
    return any(os.path.exists(os.path.join(ROOT, d, tool)) for d in ("usr/sbin", "usr/bin", "sbin", "bin"))


def backend():
    wanted = P.backend or "auto"
    found = [name for name, tool in (("nft", "nft"), ("iptables", "iptables-restore")) if has(tool)]
    if wanted != "auto":
        found = [name for name in found if name == wanted]
    if not found:
        raise GuardError(
            "the node has neither nft nor iptables-restore in /usr/sbin or /usr/bin: install nftables "
            "(`sudo apt install nftables`) or turn network.guard off"
        )
    return found[0]


# --- what is guarded ---------------------------------------------------------------------------


def ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        low, high = handle.read().split()
    return int(low), int(high)


def guarded_ranges():
    """The spec's ranges plus the ephemeral one, merged, minus the ports that stay public."""
    ranges = [tuple(item) for item in P.spec.guarded]
    if P.spec.ephemeral:
        ranges.append(ephemeral_range())
    merged = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    for port in P.spec.public:
        cut = []
        for first, last in merged:
            if first <= port <= last:
                cut += [(a, b) for a, b in ((first, port - 1), (port + 1, last)) if a <= b]
            else:
                cut.append((first, last))
        merged = cut
    return merged


def nft_ruleset(ranges):
    spec = P.spec
    ports = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
    peers = ", ".join(spec.peers)
    lines = [
        f"table inet {TABLE}",
        f"delete table inet {TABLE}",
        f"table inet {TABLE} {{",
        f'  comment "spark-vllm network.guard for node {P.node}"',
        "  set peers {",
        "    type ipv4_addr",
        *([f"    elements = {{ {peers} }}"] if peers else []),
        "  }",
        "  set guarded {",
        "    type inet_service; flags interval",
        f"    elements = {{ {ports} }}",
        "  }",
    ]
    api = spec.api
    if api:
        lines += ["  set api_sources {", "    type ipv4_addr; flags interval"]
        lines += [f"    elements = {{ {', '.join(api.sources)} }}", "  }"]
    lines += [
        "  chain input {",
        "    type filter hook input priority filter - 10; policy accept;",
        '    iif "lo" accept',
        "    ct state established,related accept",
        f'    tcp dport @guarded iifname "{spec.interface}" ip saddr @peers accept',
        f'    udp dport @guarded iifname "{spec.interface}" ip saddr @peers accept',
        "    tcp dport @guarded drop",
        "    udp dport @guarded drop",
    ]
    for port in api_ports(api):
        lines += [f"    tcp dport {port} ip saddr @api_sources accept", f"    tcp dport {port} drop"]
    lines.append("  }")
    if owned():
        lines += ["  chain output {", "    type filter hook output priority filter - 10; policy accept;"]
        for port, uids in owned():
            users = ", ".join(str(uid) for uid in uids)
            lines += [f'    oif "lo" tcp dport {port} meta skuid {{ {users} }} accept',
                      f'    oif "lo" tcp dport {port} reject with tcp reset']  # fmt: skip
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def owned():
    """[(port, [uid, …])]: the loopback ports only those users reach."""
    return [(int(port), [int(uid) for uid in uids]) for port, uids in (P.spec.owned or [])]


def api_ports(api):
    """The API ports network.apiSources limits: one (a single-model stack's vLLM) or several (each
    deployment's on the node, the router's)."""
    if not api:
        return []
    return list(api.ports) if api.ports is not None else [api.port]


def multiport_chunks(ranges):
    """`--dports` values of at most 15 slots each (a range takes two)."""
    chunk, slots = [], 0
    for first, last in ranges:
        need = 1 if first == last else 2
        if slots + need > 15:
            yield ",".join(chunk)
            chunk, slots = [], 0
        chunk.append(str(first) if first == last else f"{first}:{last}")
        slots += need
    if chunk:
        yield ",".join(chunk)


def iptables_rules(ranges, v6):
    spec = P.spec
    lines = ["*filter", f":{CHAIN} - [0:0]"]
    if owned():
        lines.append(f":{OUT_CHAIN} - [0:0]")
        for port, uids in owned():
            match = f"-o lo -p tcp --dport {port}"
            lines += [f"-A {OUT_CHAIN} {match} -m owner --uid-owner {uid} -j RETURN" for uid in uids]
            lines.append(f"-A {OUT_CHAIN} {match} -j REJECT --reject-with tcp-reset")
    lines.append(f"-A {CHAIN} -i lo -j RETURN")
    lines.append(f"-A {CHAIN} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN")
    for protocol in ("tcp", "udp"):
        for ports in multiport_chunks(ranges):
            match = f"-p {protocol} -m multiport --dports {ports}"
            if not v6:
                for peer in spec.peers:
                    lines.append(f"-A {CHAIN} {match} -i {spec.interface} -s {peer}/32 -j RETURN")
            lines.append(f"-A {CHAIN} {match} -j DROP")
    api = spec.api
    for port in api_ports(api):
        if not v6:
            for source in api.sources:
                lines.append(f"-A {CHAIN} -p tcp --dport {port} -s {source} -j RETURN")
        lines.append(f"-A {CHAIN} -p tcp --dport {port} -j DROP")
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


# --- apply, look, remove ------------------------------------------------------------------------


def apply(kind):
    ranges = guarded_ranges()
    if kind == "nft":
        host(["nft", "-f", "-"], text=nft_ruleset(ranges))
        return
    for v6, tool in ((False, "iptables"), (True, "ip6tables")):
        # --noflush keeps every other chain; declaring ours empties it first.
        host([f"{tool}-restore", "--noflush"], text=iptables_rules(ranges, v6))
        for hook, chain in jumps():
            if host([tool, "-C", hook, "-j", chain], check=False).returncode != 0:
                host([tool, "-I", hook, "1", "-j", chain])


def jumps():
    """(hook, chain): the guard's chains and where each is jumped to from (iptables)."""
    return [("INPUT", CHAIN)] + ([("OUTPUT", OUT_CHAIN)] if owned() else [])


def listing(kind):
    """What the kernel holds of the guard's rules now, as the tools print them (None: the table, chain or jump is
    gone): compared with what it held right after they were applied, so rules emptied or edited are seen too."""
    if kind == "nft":
        found = host(["nft", "list", "table", "inet", TABLE], check=False)
        return found.stdout if found.returncode == 0 else None
    parts = []
    for tool in ("iptables", "ip6tables"):
        for hook, chain in jumps():
            rules = host([tool, "-S", chain], check=False)
            if rules.returncode != 0 or host([tool, "-C", hook, "-j", chain], check=False).returncode != 0:
                return None
            parts.append(rules.stdout)
    return "".join(parts)


def remove(kind):
    if kind == "nft":
        if listing(kind) is not None:
            host(["nft", "delete", "table", "inet", TABLE])
        return
    for tool in ("iptables", "ip6tables"):
        for hook, chain in (("INPUT", CHAIN), ("OUTPUT", OUT_CHAIN)):  # the owner match's, whether or not it is on
            while host([tool, "-D", hook, "-j", chain], check=False).returncode == 0:
                pass
            if host([tool, "-F", chain], check=False).returncode == 0:
                host([tool, "-X", chain])


def write_marker(kind):
    marker = P.marker
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    record = {"boot_id": boot_id(), "hash": P.hash, "backend": kind, "node": P.node, "applied": time.time()}
    with open(marker + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(marker + ".tmp", marker)


def read_marker():
    try:
        with open(P.marker) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def describe(kind):
    ranges = guarded_ranges()
    ports = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
    peers = ", ".join(P.spec.peers) or "none (one node)"
    api = P.spec.api
    listed = ", ".join(str(port) for port in api_ports(api))
    sources = f"; port {listed} only from {', '.join(api.sources)}" if api else ""
    users = "".join(f"; loopback port {port} only for uid {', '.join(map(str, uids))}" for port, uids in owned())
    where = f"table inet {TABLE}" if kind == "nft" else f"chain {CHAIN} (iptables and ip6tables)"
    return f"{where}: TCP {ports} only from {peers} on {P.spec.interface}{sources}{users}"


def run():
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    prepare_root()
    kind = backend()
    apply(kind)
    write_marker(kind)
    applied = listing(kind)
    say(f"applied ({kind}) {describe(kind)}")
    while not stopping:
        time.sleep(P.check_seconds)
        now = None if stopping else listing(kind)
        if not stopping and now != applied:
            what = "gone" if now is None else "changed (emptied or edited)"
            say(f"the rules were {what} (another firewall tool flushed them?): applying them again")
            apply(kind)
            write_marker(kind)
            applied = listing(kind)
    say("stopping; the rules stay until the stack removes them")


def ready():
    for _ in polls(P.timeout_seconds, 0.5):
        marker = read_marker()
        if marker and marker.get("hash") == P.hash and marker.get("boot_id") == boot_id():
            say(f"in place ({marker['backend']})")
            return
    raise GuardError(f"the guard container did not apply the rules within {P.timeout_seconds} s")


def main():
    action = P.action
    try:
        if action == "run":
            run()
        elif action == "ready":
            ready()
        elif action == "show":
            ranges = guarded_ranges()
            if P.backend == "iptables":
                print(iptables_rules(ranges, False) + iptables_rules(ranges, True), end="")
            else:
                print(nft_ruleset(ranges), end="")
        else:
            prepare_root()
            kind = backend()
            if action == "check":
                say(f"the host has {kind}; will write {describe(kind)}")
            elif action == "remove":
                remove(kind)
                if os.path.exists(P.marker):
                    os.remove(P.marker)
                say(f"removed ({kind})")
    except GuardError as error:
        say(f"FAILED: {error}")
        return 1
    return 0


sys.exit(main())
