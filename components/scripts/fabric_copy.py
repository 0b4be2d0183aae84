# Copies the image and the model between nodes over the fabric link, with no registry and nothing
# passing through the machine running Pulumi. One script, three roles (PARAMS prepended by
# components.render.script_program; standard library only):
#
# * "serve" — the depot: the main process of the `spark-vllm-depot` container on the source node
#   (host network, bound to the source's fabric address). It serves the one image id it was given
#   (`docker save` through the Docker Engine API) and the files of the model directory, to clients
#   that prove they hold the stack's copy token. It never writes anything.
# * "image" — on a receiving node's host: when the node lacks the image id, streams it from the
#   depot into `docker load`, then checks that exactly that id is now on the node and tags it.
# * "model" — on a receiving node's host: makes the model directory equal to the source's: fetches
#   the files whose size or modification time differ (holes in sparse files stay holes), fixes
#   symlinks, removes files the source does not have. Hidden entries are left alone (download
#   state, and this script's own partial files). Files outside the model directory are never
#   touched, except, for a Hugging Face snapshot directory (…/models--org--name/snapshots/REV), the
#   blobs its symlinks point at in that repository's blobs/.
#
# The wire: the client proves the token (HMAC-SHA256 over both sides' nonces, so the token never
# crosses the link), the depot proves it back, and both derive per-direction keys; every frame
# after that carries an HMAC over its sequence number, kind and payload. A frame that fails its MAC
# ends the transfer. So nothing on the fabric without the token can read the model, inject bytes
# into a copy or replay one; a cut or corrupted stream fails naming the node, and leaves no
# half-written file in place (files land under a hidden name and are renamed when complete) and no
# image (Docker creates an image only once its whole archive loaded, and the id is checked after).
#
# Clients print progress every `progress_seconds` and one JSON line at the end.
import errno
import hashlib
import hmac
import http.client
import json
import os
import queue
import shutil
import socket
import socketserver
import stat
import struct
import sys
import threading
import time
import urllib.parse

P = json.loads(PARAMS)  # noqa: F821 - prepended by script_program
MAGIC = b"spark-vllm-copy/1\n"
FRAME = 4 << 20  # bytes of payload per data frame
MAX_FRAME = 16 << 20
HEADER = struct.Struct(">cI")  # kind, payload length
PARTIAL = ".spark-vllm-partial"


class CopyError(Exception):
    pass


def say(message):
    print(f"[{P['node']}] {message}", flush=True)


def human(count):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1000.0


# --- the authenticated channel ---------------------------------------------------------------------


def mac(key, *parts):
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


def read_exact(sock, count):
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    while got < count:
        n = sock.recv_into(view[got:], count - got)
        if n == 0:
            raise CopyError(f"the connection closed after {got} of {count} bytes")
        got += n
    return buffer


class Channel:
    """Frames (kind, payload) with an HMAC over (sequence number, kind, length, payload) each."""

    def __init__(self, sock, send_key, receive_key):
        self.sock, self.send_key, self.receive_key = sock, send_key, receive_key
        self.sent = self.received = 0

    def send(self, kind, payload=b""):
        header = HEADER.pack(kind, len(payload))
        tag = mac(self.send_key, struct.pack(">Q", self.sent), header, payload)
        self.sent += 1
        if len(payload) < 65536:
            self.sock.sendall(header + bytes(payload) + tag)
        else:  # no copy of a large payload
            for part in (header, payload, tag):
                self.sock.sendall(part)

    def send_json(self, value):
        self.send(b"J", json.dumps(value).encode())

    def receive(self):
        kind, length = HEADER.unpack(read_exact(self.sock, HEADER.size))
        if length > MAX_FRAME:
            raise CopyError(f"a frame of {length} bytes: not from a depot of this stack")
        payload = read_exact(self.sock, length)
        tag = read_exact(self.sock, 32)
        expected = mac(self.receive_key, struct.pack(">Q", self.received), HEADER.pack(kind, length), payload)
        if not hmac.compare_digest(bytes(tag), expected):
            raise CopyError("a frame failed its integrity check (corrupted, or not from this stack's depot)")
        self.received += 1
        if kind == b"X":
            raise CopyError(f"the depot says: {payload.decode(errors='replace')}")
        return kind, payload

    def receive_json(self):
        kind, payload = self.receive()
        if kind != b"J":
            raise CopyError(f"expected a message, got a frame of kind {kind!r}")
        return json.loads(payload)


def keys(token, nonce_server, nonce_client):
    return (
        mac(token, b"to-client", nonce_server, nonce_client),
        mac(token, b"to-server", nonce_server, nonce_client),
    )


def accept(sock, token):
    """The depot's side of the handshake: a Channel, or CopyError for a client without the token."""
    nonce_server = os.urandom(32)
    sock.sendall(MAGIC + nonce_server)
    answer = read_exact(sock, 64)
    nonce_client, proof = bytes(answer[:32]), bytes(answer[32:])
    if not hmac.compare_digest(proof, mac(token, b"client", nonce_server, nonce_client)):
        raise CopyError("a client without this stack's copy token")
    sock.sendall(mac(token, b"server", nonce_client, nonce_server))
    to_client, to_server = keys(token, nonce_server, nonce_client)
    return Channel(sock, to_client, to_server)


def connect(address, port, token, wait_seconds=30):
    """A Channel to the depot; it may still be starting, so a refused connection is tried again."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=10)
            break
        except OSError as error:
            if time.monotonic() > deadline:
                raise CopyError(
                    f"cannot reach the depot of {P['source']} at {address}:{port} over the fabric: {error}"
                ) from error
            time.sleep(0.5)
    sock.settimeout(120)
    try:
        hello = read_exact(sock, len(MAGIC) + 32)
    except (CopyError, OSError) as error:
        raise CopyError(f"the depot at {address}:{port} did not greet: {error}") from error
    if bytes(hello[: len(MAGIC)]) != MAGIC:
        raise CopyError(f"{address}:{port} is not a spark-vllm depot")
    nonce_server, nonce_client = bytes(hello[len(MAGIC) :]), os.urandom(32)
    sock.sendall(nonce_client + mac(token, b"client", nonce_server, nonce_client))
    try:
        proof = bytes(read_exact(sock, 32))
    except CopyError:
        proof = b""
    if not hmac.compare_digest(proof, mac(token, b"server", nonce_client, nonce_server)):
        raise CopyError(f"the depot at {address}:{port} refused this stack's copy token, or does not hold it")
    to_client, to_server = keys(token, nonce_server, nonce_client)
    return Channel(sock, to_server, to_client)


# --- the Docker Engine API over its unix socket -----------------------------------------------------


def docker(method, path, body=None, headers=None, timeout=60):
    connection = UnixConnection(docker_socket(), timeout)
    try:
        connection.request(
            method, api_prefix() + path, body=body, headers=headers or {}, encode_chunked=body is not None
        )
        return connection, connection.getresponse()
    except BaseException:
        connection.close()  # a body cut short: Docker sees the upload end unfinished and loads nothing
        raise


def image_info(image_id):
    connection, response = docker("GET", f"/images/{urllib.parse.quote(image_id, safe='')}/json")
    body = response.read()
    connection.close()
    return json.loads(body) if response.status == 200 else None


# --- the model directory ----------------------------------------------------------------------------


def sync_root(model_dir):
    """The directory the copy works in: the model directory, or for a Hugging Face snapshot
    (…/models--org--name/snapshots/REV) its repository, whose blobs/ the snapshot links into."""
    parent = os.path.dirname(model_dir)
    if os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith("models--"):
        return os.path.dirname(parent)
    return model_dir


def inside(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


def manifest(model_dir):
    """{relative path under the sync root: entry} for the model directory, and the problems that
    stop a copy (symlinks leading out of it, dangling ones, unreadable entries)."""
    root = sync_root(model_dir)
    real_root = os.path.realpath(root)
    entries, problems = {}, []

    def relative(path):
        return os.path.relpath(path, root).replace(os.sep, "/")

    def add_file(path, info):
        entries[relative(path)] = {
            "type": "file",
            "size": info.st_size,
            "mtime_ns": info.st_mtime_ns,
            "mode": stat.S_IMODE(info.st_mode),
        }

    for current, dirs, names in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if current != model_dir:
            entries[relative(current)] = {"type": "dir"}
        for name in sorted(names + [d for d in dirs if os.path.islink(os.path.join(current, d))]):
            if name.startswith("."):
                continue
            path = os.path.join(current, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                add_file(path, info)
            elif stat.S_ISLNK(info.st_mode):
                target = os.readlink(path)
                resolved = os.path.realpath(path)
                if not inside(resolved, real_root):
                    problems.append(f"{relative(path)} -> {target} leads out of {root}")
                elif not os.path.exists(resolved):
                    problems.append(f"{relative(path)} -> {target} is dangling")
                elif os.path.isdir(resolved) and not inside(resolved, os.path.realpath(model_dir)):
                    problems.append(f"{relative(path)} -> {target}: a link to a directory outside {model_dir}")
                else:
                    entries[relative(path)] = {"type": "link", "target": target}
                    if os.path.isfile(resolved) and not inside(resolved, os.path.realpath(model_dir)):
                        blob = os.path.join(root, os.path.relpath(resolved, real_root))
                        add_file(blob, os.stat(blob))
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(current, d))]
    return entries, problems


def extents(handle, size):
    """[(offset, length)] of the data in a file; holes are left out (SEEK_DATA / SEEK_HOLE; a
    filesystem without them reports the whole file as data)."""
    spans, offset = [], 0
    while offset < size:
        try:
            start = os.lseek(handle, offset, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # only a hole after offset
                break
            return [(0, size)]
        end = min(os.lseek(handle, start, os.SEEK_HOLE), size)
        if end > start:
            spans.append((start, end - start))
        offset = end
    return spans


# --- the depot --------------------------------------------------------------------------------------


class Depot(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class DepotHandler(socketserver.BaseRequestHandler):
    entries = None  # the manifest this connection was given: the only files it may ask for

    def handle(self):
        sock, peer = self.request, self.client_address[0]
        sock.settimeout(300)
        try:
            channel = accept(sock, TOKEN)
        except (CopyError, OSError) as error:
            print(f"[depot] refused {peer}: {error}", flush=True)
            return
        try:
            while True:
                try:
                    request = channel.receive_json()
                except CopyError:
                    return  # the client is done
                operation = request.get("op")
                try:
                    if operation == "image":
                        self.send_image(channel, peer)
                    elif operation == "manifest":
                        self.send_manifest(channel)
                    elif operation == "file":
                        self.send_file(channel, request.get("path"))
                    else:
                        channel.send(b"X", f"unknown request {operation!r}".encode())
                except (OSError, http.client.HTTPException, ValueError) as error:
                    # Something on this side (its Docker socket, a file): the receiver is told why.
                    reason = f"{P['node']} cannot serve the {operation}: {type(error).__name__}: {error}"
                    print(f"[depot] {peer}: {reason}", flush=True)
                    channel.send(b"X", reason[:2000].encode())
                    return
        except (CopyError, OSError) as error:
            print(f"[depot] {peer}: {error}", flush=True)

    def send_image(self, channel, peer):
        image_id = P.get("image_id")
        info = image_info(image_id) if image_id else None
        if info is None:
            channel.send(b"X", f"the depot serves no image (or {image_id} is gone from {P['node']})".encode())
            return
        channel.send_json({"id": info["Id"], "size": info.get("Size", 0)})
        connection, response = docker("GET", f"/images/{urllib.parse.quote(info['Id'], safe='')}/get", timeout=300)
        if response.status != 200:
            channel.send(b"X", f"docker save failed: {response.status} {response.read()[:300]!r}".encode())
            return
        sent, started = 0, time.monotonic()
        while True:
            chunk = response.read(FRAME)
            if not chunk:
                break
            channel.send(b"D", chunk)
            sent += len(chunk)
        connection.close()
        channel.send(b"E")
        print(
            f"[depot] image {info['Id'][:19]} to {peer}: {human(sent)} in {time.monotonic() - started:.1f} s",
            flush=True,
        )

    def send_manifest(self, channel):
        if not P.get("model_dir"):
            channel.send(b"X", b"the depot serves no model")
            return
        self.entries, problems = manifest(P["model_dir"])
        channel.send_json({"root": sync_root(P["model_dir"]), "entries": self.entries, "problems": problems})

    def send_file(self, channel, path):
        entry = (self.entries or {}).get(path) if isinstance(path, str) else None
        if entry is None or entry["type"] != "file":
            channel.send(b"X", f"{path!r} is not a file of the model".encode())
            return
        full = os.path.join(sync_root(P["model_dir"]), path)
        handle = os.open(full, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            info = os.fstat(handle)
            spans = extents(handle, info.st_size)
            channel.send_json({"size": info.st_size, "mtime_ns": info.st_mtime_ns, "extents": spans})
            for start, length in spans:
                offset, end = start, start + length
                while offset < end:
                    chunk = os.pread(handle, min(FRAME, end - offset), offset)
                    if not chunk:
                        raise CopyError(f"{path} shrank while it was read")
                    channel.send(b"D", chunk)
                    offset += len(chunk)
            channel.send(b"E")
        finally:
            os.close(handle)


def serve():
    depot = Depot((P["address"], P["port"]), DepotHandler)
    served = ", ".join(x for x in (P.get("image_id") and "image " + P["image_id"][:19], P.get("model_dir")) if x)
    print(f"[depot] {P['node']} serves {served} on {P['address']}:{P['port']}", flush=True)
    if P.get("image_id"):
        try:
            api_prefix()
            print(f"[depot] {_negotiated['said']}", flush=True)
        except OSError as error:
            print(f"[depot] the Docker daemon does not answer yet: {error}", flush=True)
    depot.serve_forever()


# --- the image --------------------------------------------------------------------------------------


class Progress:
    def __init__(self, what, total):
        self.what, self.total, self.done = what, total, 0
        self.started = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, count):
        with self.lock:
            self.done += count
            now = time.monotonic()
            if now - self.last >= P["progress_seconds"]:
                self.last = now
                say(self.line())

    def line(self):
        elapsed = max(time.monotonic() - self.started, 1e-6)
        share = f" of {human(self.total)} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.what}: {human(self.done)}{share}, {human(self.done / elapsed)}/s, {elapsed:.0f} s"


def receive_image():
    expected = P["image_id"]
    if image_info(expected) is not None:
        tag(expected)
        say(f"image {expected[:19]} is already on this node: nothing to copy")
        print(json.dumps({"image_id": expected, "copied_bytes": 0}))
        return 0
    channel = connect(P["address"], P["port"], TOKEN)
    channel.send_json({"op": "image"})
    offer = channel.receive_json()
    if offer["id"] != expected:
        raise CopyError(f"the depot on {P['source']} serves {offer['id']}, not {expected}: run `pulumi up` again")
    say(
        f"copying image {expected[:19]} from {P['source']} over the fabric ({human(offer['size'])} unpacked; "
        f"{_negotiated['said']})"
    )
    progress = Progress("image", offer["size"])
    failure = []

    def body():
        try:
            while True:
                kind, payload = channel.receive()
                if kind == b"E":
                    return
                progress.add(len(payload))
                yield bytes(payload)
        except (CopyError, OSError) as error:
            failure.append(error)
            raise

    try:
        connection, response = docker(
            "POST", "/images/load?quiet=1", body=body(), headers={"Content-Type": "application/x-tar"}, timeout=600
        )
        answer = response.read().decode(errors="replace")
        connection.close()
    except (OSError, http.client.HTTPException, CopyError) as error:
        cause = failure[0] if failure else error
        raise CopyError(f"the copy was cut after {human(progress.done)}: {cause}; nothing was loaded") from error
    if failure:
        raise CopyError(f"the copy was cut after {human(progress.done)}: {failure[0]}; nothing was loaded")
    errors = [m for m in (json.loads(line) for line in answer.splitlines() if line.strip()) if "error" in m]
    if response.status != 200 or errors:
        raise CopyError(f"docker load refused the archive: {response.status} {errors or answer[:300]}")
    if image_info(expected) is None:
        raise CopyError(f"after the copy {expected} is not on this node: the archive held another image")
    tag(expected)
    say(progress.line() + " — loaded, image id checked")
    print(json.dumps({"image_id": expected, "copied_bytes": progress.done}))
    return 0


def tag(image_id):
    """Give the loaded image the configured tag too (not for a digest or an id: those name it already)."""
    reference = P.get("reference") or ""
    if not reference or "@" in reference or reference.startswith("sha256:"):
        return
    last = reference.rsplit("/", 1)[-1]
    repository, tag_name = reference.rsplit(":", 1) if ":" in last else (reference, "latest")
    query = urllib.parse.urlencode({"repo": repository, "tag": tag_name})
    connection, response = docker("POST", f"/images/{urllib.parse.quote(image_id, safe='')}/tag?{query}")
    response.read()
    connection.close()
    if response.status not in (200, 201):
        raise CopyError(f"cannot tag {image_id} as {reference}: {response.status}")


# --- the model --------------------------------------------------------------------------------------


def local_entry(path):
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return {"type": "link", "target": os.readlink(path)}
    if stat.S_ISDIR(info.st_mode):
        return {"type": "dir"}
    if stat.S_ISREG(info.st_mode):
        return {"type": "file", "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    return {"type": "other"}


def same(wanted, found):
    if found is None or found["type"] != wanted["type"]:
        return False
    if wanted["type"] == "file":  # rsync's quick check: size and modification time
        return found["size"] == wanted["size"] and found["mtime_ns"] // 10**9 == wanted["mtime_ns"] // 10**9
    if wanted["type"] == "link":
        return found["target"] == wanted["target"]
    return True


def remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def stale_partials(model_dir):
    for current, _, names in os.walk(model_dir):
        for name in names:
            if name.startswith(".") and name.endswith(PARTIAL):
                os.unlink(os.path.join(current, name))


def plan(model_dir, root, entries):
    """(files to fetch, links to set, dirs to make, paths to remove) to make this node's copy the source's."""
    fetch, links, dirs, extra = [], [], [], []
    for relative, wanted in sorted(entries.items()):
        found = local_entry(os.path.join(root, relative))
        if same(wanted, found):
            continue
        {"file": fetch, "link": links, "dir": dirs}[wanted["type"]].append(relative)
    if os.path.isdir(model_dir):
        for current, subdirs, names in os.walk(model_dir):
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
            for name in [n for n in names + subdirs if not n.startswith(".")]:
                relative = os.path.relpath(os.path.join(current, name), root).replace(os.sep, "/")
                if relative not in entries:
                    extra.append(relative)
            subdirs[:] = [d for d in subdirs if os.path.relpath(os.path.join(current, d), root) in entries]
    return fetch, links, dirs, extra


class Finisher:
    """Completed files made durable and put in place in the background, in order (fdatasync, time,
    rename), while the next file arrives: the disk's writeback of one file overlaps the transfer of
    the next, as a pipe into tar would let it. A file is renamed only once its data is on disk."""

    def __init__(self):
        self.queue = queue.Queue(maxsize=4)  # bounds the open files and the unsynced bytes
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            handle, partial, final, mtime_ns = item
            try:
                if self.error is None:
                    os.fdatasync(handle)
            except OSError as error:
                self.error = f"{final}: {error}"
            finally:
                os.close(handle)
            if self.error is not None:
                continue  # left as a partial file: the next run clears it
            try:
                os.utime(partial, ns=(mtime_ns, mtime_ns))
                if os.path.isdir(final) and not os.path.islink(final):
                    shutil.rmtree(final)
                os.replace(partial, final)
            except OSError as error:
                self.error = f"{final}: {error}"

    def put(self, handle, partial, final, mtime_ns):
        if self.error is not None:
            os.close(handle)
            raise CopyError(f"writing {self.error}")
        self.queue.put((handle, partial, final, mtime_ns))

    def close(self):
        """Wait until every handed-over file is in place; raise if one could not be."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise CopyError(f"writing {self.error}")


def fetch_file(channel, root, relative, entry, progress, finisher):
    final = os.path.join(root, relative)
    directory, name = os.path.split(final)
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, f".{name}{PARTIAL}")
    channel.send_json({"op": "file", "path": relative})
    header = channel.receive_json()
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(handle, header["size"])
        spans = iter(header["extents"])
        offset = end = 0
        while True:
            kind, payload = channel.receive()
            if kind == b"E":
                break
            while offset >= end:
                start, length = next(spans)
                offset, end = start, start + length
            if offset + len(payload) > end:
                raise CopyError(f"{relative}: more data than its extents")
            os.pwrite(handle, payload, offset)
            offset += len(payload)
            progress.add(len(payload))
        os.fchmod(handle, entry["mode"])
    except BaseException:
        os.close(handle)
        os.unlink(partial)
        raise
    finisher.put(handle, partial, final, header["mtime_ns"])


def sync_model():
    model_dir = P["model_dir"].rstrip("/") or "/"
    started = time.monotonic()
    channel = connect(P["address"], P["port"], TOKEN)
    channel.send_json({"op": "manifest"})
    offer = channel.receive_json()
    if offer["problems"]:
        raise CopyError(f"the model on {P['source']} cannot be copied as it is: " + "; ".join(offer["problems"][:10]))
    root, entries = offer["root"], offer["entries"]
    if root != sync_root(model_dir):
        raise CopyError(f"the depot copies {root}, this node expects {sync_root(model_dir)}")
    os.makedirs(model_dir, exist_ok=True)
    stale_partials(model_dir)
    fetch, links, dirs, extra = plan(model_dir, root, entries)
    decided = time.monotonic() - started
    total = sum(entries[r]["size"] for r in fetch)
    if not (fetch or links or dirs or extra):
        say(f"model {model_dir}: the same as on {P['source']} ({len(entries)} entries), nothing to copy")
        print(json.dumps({"copied_bytes": 0, "files": 0, "removed": 0, "decided_seconds": round(decided, 3)}))
        return 0
    say(
        f"model {model_dir}: {len(fetch)} file(s), {human(total)} to copy from {P['source']} over the fabric, "
        f"{len(links)} link(s) to set, {len(extra)} entr(y/ies) to remove"
    )
    for relative in extra:
        remove(os.path.join(root, relative))
    for relative in dirs:
        path = os.path.join(root, relative)
        if os.path.lexists(path) and not os.path.isdir(path):
            os.unlink(path)
        os.makedirs(path, exist_ok=True)
    progress = Progress("model", total)
    finisher = Finisher()
    try:
        for relative in sorted(fetch, key=lambda r: entries[r]["size"]):
            fetch_file(channel, root, relative, entries[relative], progress, finisher)
    except BaseException:
        try:
            finisher.close()  # what arrived whole is still put in place
        except CopyError:
            pass  # the first failure is the one to report
        raise
    finisher.close()
    for relative in links:
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{PARTIAL}")
        if os.path.lexists(temporary):
            os.unlink(temporary)
        os.symlink(entries[relative]["target"], temporary)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        os.replace(temporary, path)
    say(progress.line() + f" — {len(fetch)} file(s), {len(links)} link(s), {len(extra)} removed")
    print(
        json.dumps(
            {
                "copied_bytes": progress.done,
                "files": len(fetch),
                "removed": len(extra),
                "decided_seconds": round(decided, 3),
            }
        )
    )
    return 0


def main():
    try:
        if P["role"] == "serve":
            serve()
            return 0
        return receive_image() if P["role"] == "image" else sync_model()
    except CopyError as error:
        say(f"{P['role']} copy from {P['source']} failed: {error}")
        return 1
    except OSError as error:
        say(f"{P['role']} copy from {P['source']} failed: {error}")
        return 1


TOKEN = (P.pop("token", None) or os.environ.get("SPARK_VLLM_COPY_TOKEN", "")).encode()
if not TOKEN:
    print(f"[{P['node']}] no copy token (SPARK_VLLM_COPY_TOKEN)", file=sys.stderr)
    sys.exit(2)
sys.exit(main())
