# Copies the image and the model between nodes over the fabric link, with no registry and nothing
# passing through the machine running Pulumi. One script, three roles (its parameters in
# the program, node_params.py; standard library only):
#
# * "serve" — the depot: the main process of the `spark-vllm-depot` container on the source node
#   (host network, bound to the source's fabric address). It serves the one image id it was given
#   (`docker save` through the Docker Engine API) and the files of the model directory, to clients
#   that prove they hold the stack's copy token. It never writes anything.
# * "image" — on a receiving node's host: when the node lacks the image id, streams it from the
#   depot into `docker load` (holding back what `docker load` acts on until it is checked: one image, that
#   id, no names; node_image_archive.py), then checks that exactly that id is now on the node and tags it.
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
import http.client
import json
import os
import queue
import shutil
import socketserver
import sys
import threading
import time
import urllib.parse

from components.scripts.docker_api import UnixConnection, api_prefix, docker_socket, negotiated
from components.scripts.node_common import human, node_voice
from components.scripts.node_contract import COPY_ROLES, ImageCopied, ModelCopied
from components.scripts.node_copy_channel import FRAME, CopyError, accept, connect
from components.scripts.node_copy_tree import (
    PARTIAL,
    extents,
    file_mode,
    free_bytes,
    manifest,
    offer_problems,
    plan,
    remove,
    room_problem,
    stale_partials,
    sync_root,
)
from components.scripts.node_image_archive import ArchiveCheck, ArchiveError
from components.scripts.node_log import say, speak_with
from components.scripts.node_params import given

_GIVEN = given()
P = COPY_ROLES[_GIVEN["role"]].from_json(_GIVEN)  # the depot, an image receiver or a model receiver
speak_with(node_voice(P.node))


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


def containerd_store():
    """Whether this node's Docker keeps its images in containerd (GET /info's DriverStatus names the snapshotter:
    moby daemon/containerd/service.go): there an image's id is its manifest's digest, not its config's."""
    connection, response = docker("GET", "/info")
    body = response.read()
    connection.close()
    try:
        status = (json.loads(body) if response.status == 200 else {}).get("DriverStatus") or []
    except (ValueError, AttributeError):
        return False
    return any(isinstance(row, list) and row[:1] == ["driver-type"] and "containerd" in str(row[1:]) for row in status)


# --- the model directory ----------------------------------------------------------------------------


# A peer has HANDSHAKE_SECONDS to prove the copy token, and at most UNPROVEN_AT_ONCE connections may be proving it:
# more are closed at once, before any greeting (a receiver tries again), so peers without the token cannot tie up
# the depot's threads (a slow handshake held one for 300 s before).
HANDSHAKE_SECONDS = 5
UNPROVEN_AT_ONCE = 16


class Depot(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *args):
        super().__init__(*args)
        self.unproven = threading.BoundedSemaphore(UNPROVEN_AT_ONCE)
        self.dropped, self.said_dropped = 0, 0.0

    def drop(self, peer):
        """A connection over the cap: closed; said at most every 10 s (a flood must not flood the log)."""
        self.dropped += 1
        if time.monotonic() - self.said_dropped >= 10:
            self.said_dropped = time.monotonic()
            print(f"[depot] dropped {peer} ({self.dropped} so far): {UNPROVEN_AT_ONCE} connections are still "
                  "proving the copy token", flush=True)  # fmt: skip


class DepotHandler(socketserver.BaseRequestHandler):
    entries = None  # the manifest this connection was given: the only files it may ask for

    def handle(self):
        sock, peer = self.request, self.client_address[0]
        if not self.server.unproven.acquire(blocking=False):
            self.server.drop(peer)
            return
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            channel = accept(sock, TOKEN)
        except (CopyError, OSError) as error:
            print(f"[depot] refused {peer}: {error}", flush=True)
            return
        finally:
            self.server.unproven.release()
        sock.settimeout(300)
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
                    reason = f"{P.node} cannot serve the {operation}: {type(error).__name__}: {error}"
                    print(f"[depot] {peer}: {reason}", flush=True)
                    channel.send(b"X", reason[:2000].encode())
                    return
        except (CopyError, OSError) as error:
            print(f"[depot] {peer}: {error}", flush=True)

    def send_image(self, channel, peer):
        image_id = P.image_id
        info = image_info(image_id) if image_id else None
        if info is None:
            channel.send(b"X", f"the depot serves no image (or {image_id} is gone from {P.node})".encode())
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
        if not P.model_dir:
            channel.send(b"X", b"the depot serves no model")
            return
        self.entries, problems = manifest(P.model_dir)
        channel.send_json({"root": sync_root(P.model_dir), "entries": self.entries, "problems": problems})

    def send_file(self, channel, path):
        entry = (self.entries or {}).get(path) if isinstance(path, str) else None
        if entry is None or entry["type"] != "file":
            channel.send(b"X", f"{path!r} is not a file of the model".encode())
            return
        full = os.path.join(sync_root(P.model_dir), path)
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
    depot = Depot((P.address, P.port), DepotHandler)
    served = ", ".join(x for x in (P.image_id and "image " + P.image_id[:19], P.model_dir) if x)
    print(f"[depot] {P.node} serves {served} on {P.address}:{P.port}", flush=True)
    if P.image_id:
        try:
            api_prefix()
            print(f"[depot] {negotiated['said']}", flush=True)
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
            if now - self.last >= P.progress_seconds:
                self.last = now
                say(self.line())

    def line(self):
        elapsed = max(time.monotonic() - self.started, 1e-6)
        share = f" of {human(self.total)} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.what}: {human(self.done)}{share}, {human(self.done / elapsed)}/s, {elapsed:.0f} s"


def receive_image():
    expected = P.image_id
    if image_info(expected) is not None:
        tag(expected)
        say(f"image {expected[:19]} is already on this node: nothing to copy")
        print(json.dumps(ImageCopied(image_id=expected, copied_bytes=0).to_json()))
        return 0
    channel = connect(P.address, P.port, TOKEN, P.source)
    channel.send_json({"op": "image"})
    offer = channel.receive_json()
    if offer["id"] != expected:
        raise CopyError(f"the depot on {P.source} serves {offer['id']}, not {expected}: run `pulumi up` again")
    say(
        f"copying image {expected[:19]} from {P.source} over the fabric ({human(offer['size'])} unpacked; "
        f"{negotiated['said']})"
    )
    progress = Progress("image", offer["size"])
    failure = []
    check = ArchiveCheck(expected, by_index=containerd_store())  # node_image_archive.py: what docker load may act on

    def body():
        try:
            while True:
                kind, payload = channel.receive()
                if kind == b"E":
                    check.finish()
                    return
                progress.add(len(payload))
                for piece in check.feed(payload):
                    yield bytes(piece)
        except (CopyError, OSError, ArchiveError) as error:
            failure.append(error)
            raise

    try:
        connection, response = docker(
            "POST", "/images/load?quiet=1", body=body(), headers={"Content-Type": "application/x-tar"}, timeout=600
        )
        answer = response.read().decode(errors="replace")
        connection.close()
    except (OSError, http.client.HTTPException, CopyError, ArchiveError) as error:
        raise load_failed(failure[0] if failure else error, progress) from error
    if failure:
        raise load_failed(failure[0], progress)
    errors = [m for m in (json.loads(line) for line in answer.splitlines() if line.strip()) if "error" in m]
    if response.status != 200 or errors:
        raise CopyError(f"docker load refused the archive: {response.status} {errors or answer[:300]}")
    if image_info(expected) is None:
        raise CopyError(f"after the copy {expected} is not on this node: the archive held another image")
    tag(expected)
    say(progress.line() + " — loaded, image id checked")
    print(json.dumps(ImageCopied(image_id=expected, copied_bytes=progress.done).to_json()))
    return 0


def load_failed(cause, progress):
    """What a receiver says when the stream into `docker load` ended early: the archive refused, or the copy cut."""
    if isinstance(cause, ArchiveError):
        return CopyError(f"the depot on {P.source} sent an image archive that {cause}; refused before `docker load` "
                         "had it whole, nothing was loaded")  # fmt: skip
    return CopyError(f"the copy was cut after {human(progress.done)}: {cause}; nothing was loaded")


def tag(image_id):
    """Give the loaded image the configured tag too (not for a digest or an id: those name it already)."""
    reference = P.reference or ""
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
    no_link_on_the_way(root, relative)
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, f".{name}{PARTIAL}")
    channel.send_json({"op": "file", "path": relative})
    header = channel.receive_json()
    header = header if isinstance(header, dict) else {}
    spans = header.get("extents")
    if (
        header.get("size") != entry["size"]
        or not isinstance(spans, list)
        or not all(
            isinstance(span, list) and len(span) == 2 and 0 <= span[0] and 0 <= span[1] and sum(span) <= entry["size"]
            for span in spans
        )
    ):
        raise CopyError(f"{relative}: the depot sends another size or data beyond it than its manifest said")
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
        os.fchmod(handle, file_mode(entry["mode"]))  # no setuid, setgid or sticky bit, whatever the depot said
    except BaseException:
        os.close(handle)
        os.unlink(partial)
        raise
    finisher.put(handle, partial, final, header["mtime_ns"])


def place_link(root, relative, target):
    """A symbolic link at `relative` under `root` to `target`, put in place whole (a link made aside, then renamed
    over)."""
    no_link_on_the_way(root, relative)
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}{PARTIAL}")
    if os.path.lexists(temporary):
        os.unlink(temporary)
    os.symlink(target, temporary)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    os.replace(temporary, path)


def no_link_on_the_way(root, relative):
    """Refuse a path whose directories under `root` include a link (one an earlier copy placed, or anyone)."""
    current = root
    for part in relative.split("/")[:-1]:
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise CopyError(f"{relative}: {os.path.relpath(current, root)} is a link; nothing is written through one")


def sync_model():
    model_dir = P.model_dir.rstrip("/") or "/"
    started = time.monotonic()
    channel = connect(P.address, P.port, TOKEN, P.source)
    channel.send_json({"op": "manifest"})
    offer = channel.receive_json()
    if offer["problems"]:
        raise CopyError(f"the model on {P.source} cannot be copied as it is: " + "; ".join(offer["problems"][:10]))
    root, entries = offer["root"], offer["entries"]
    if root != sync_root(model_dir):
        raise CopyError(f"the depot copies {root}, this node expects {sync_root(model_dir)}")
    refused = offer_problems(root, entries)
    if refused:
        raise CopyError(f"the depot's offer is refused, nothing was written ({len(refused)} problem(s)): "
                        + "; ".join(refused[:10]))  # fmt: skip
    os.makedirs(model_dir, exist_ok=True)
    stale_partials(model_dir)
    fetch, links, dirs, extra = plan(model_dir, root, entries)
    total = sum(entries[r]["size"] for r in fetch)
    room = room_problem(root, total, free_bytes(root))
    if room:
        raise CopyError(f"the depot's offer is refused, nothing was written: {room}")
    decided = time.monotonic() - started
    if not (fetch or links or dirs or extra):
        say(f"model {model_dir}: the same as on {P.source} ({len(entries)} entries), nothing to copy")
        print(json.dumps(ModelCopied(copied_bytes=0, files=0, removed=0, decided_seconds=round(decided, 3)).to_json()))
        return 0
    say(
        f"model {model_dir}: {len(fetch)} file(s), {human(total)} to copy from {P.source} over the fabric, "
        f"{len(links)} link(s) to set, {len(extra)} entr(y/ies) to remove"
    )
    for relative in extra:
        remove(os.path.join(root, relative))
    for relative in dirs:
        no_link_on_the_way(root, relative)
        path = os.path.join(root, relative)
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
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
        place_link(root, relative, entries[relative]["target"])
    say(progress.line() + f" — {len(fetch)} file(s), {len(links)} link(s), {len(extra)} removed")
    decided = round(decided, 3)
    copied = ModelCopied(copied_bytes=progress.done, files=len(fetch), removed=len(extra), decided_seconds=decided)
    print(json.dumps(copied.to_json()))
    return 0


def main():
    try:
        if P.role == "serve":
            serve()
            return 0
        return receive_image() if P.role == "image" else sync_model()
    except CopyError as error:
        say(f"{P.role} copy from {P.source} failed: {error}")
        return 1
    except OSError as error:
        say(f"{P.role} copy from {P.source} failed: {error}")
        return 1


TOKEN = (getattr(P, "token", None) or os.environ.get("SPARK_VLLM_COPY_TOKEN", "")).encode()
if not TOKEN:
    print(f"[{P.node}] no copy token (SPARK_VLLM_COPY_TOKEN)", file=sys.stderr)
    sys.exit(2)
sys.exit(main())
