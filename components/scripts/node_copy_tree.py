# The model directory as the fabric copy sees it (node_fabric_copy.py imports it): what is synced (a directory, or a
# Hugging Face snapshot with the blobs its links point at), its manifest (sizes, times, links, the extents of sparse
# files), and what a receiver must fetch, fix or remove to match it. Standard library only, no side effects.
import errno
import os
import shutil
import stat

PARTIAL = ".spark-vllm-partial"  # a file being written: `.NAME` + this, renamed when whole


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


# --- the receiver: what it accepts of a depot's offer ----------------------------------------------------
# The depot is a peer on the fabric, and a node taken must not take the others: a receiver applies nothing of a
# manifest it did not check (paths inside the target, links that stay inside it, no path through a link, modes a
# model file needs, sizes the disk holds), and places every file by a path whose directories are not links.

MAX_ENTRIES = 1_000_000  # a model's files and directories: a Hugging Face repository has hundreds
MODE_BITS = 0o755  # what a model or image file needs: no setuid, setgid or sticky bit, writable by its owner only
KINDS = ("file", "dir", "link")


def file_mode(mode):
    """A file's mode as the receiver applies it, whatever the depot said."""
    return mode & MODE_BITS


def _path_problem(relative):
    if not isinstance(relative, str) or "\x00" in relative or relative.startswith("/"):
        return "leaves the target (a relative path of plain names)"
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "leaves the target (a relative path of plain names)"
    if any(part.startswith(".") for part in parts):
        return "a hidden name: the copy sends none (its own partial files are hidden names)"
    return None


def _entry_problem(relative, entry):
    if not isinstance(entry, dict) or entry.get("type") not in KINDS:
        return "a file, a directory or a link"
    if entry["type"] == "file":
        size, mtime, mode = entry.get("size"), entry.get("mtime_ns"), entry.get("mode")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return "a size (bytes, 0 or more)"
        if not isinstance(mtime, int) or isinstance(mtime, bool):
            return "a modification time (ns)"
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
            return "a mode (permission bits)"
    if entry["type"] == "link":
        target = entry.get("target")
        if not isinstance(target, str) or not target or "\x00" in target or target.startswith("/"):
            return "a link out of the target"
        resolved = os.path.normpath(os.path.join(os.path.dirname(relative), target))
        if resolved == ".." or resolved.startswith("../"):
            return "a link out of the target"
    return None


def offer_problems(root, entries, free_bytes=None):
    """What a receiver whose sync root is `root` refuses of a depot's `entries` (its manifest), one line each;
    [] when every entry may be applied. Nothing is written before this is empty. `free_bytes`: the files must fit
    in that too (the receiver asks with the files it will fetch, once it knows them)."""
    if not isinstance(entries, dict):
        return ["not a manifest: a mapping of paths to entries"]
    if len(entries) > MAX_ENTRIES:
        return [f"{len(entries)} entries: more than a model has ({MAX_ENTRIES})"]
    links = {relative for relative, entry in entries.items() if isinstance(entry, dict) and entry.get("type") == "link"}
    problems, total = [], 0
    for relative, entry in sorted(entries.items(), key=lambda item: repr(item[0])):
        why = _path_problem(relative) or _entry_problem(relative, entry)
        if why is None:
            parents = ["/".join(relative.split("/")[:n]) for n in range(1, relative.count("/") + 1)]
            through = next((parent for parent in parents if parent in links), None)
            why = f"a path through the link {through}" if through else None
        if why is not None:
            problems.append(f"{relative!r}: {why}")
        elif entry["type"] == "file":
            total += entry["size"]
    room = room_problem(root, total, free_bytes)
    return problems + ([room] if room else [])


def room_problem(root, total, free):
    """`total` bytes to write under `root`, where `free` are free (None: not asked): what is refused, or None."""
    if free is not None and total > free:
        return f"{total / 2**30:.1f} GiB to write, the disk has {free / 2**30:.1f} GiB free at {root}"
    return None


def free_bytes(path):
    """What the filesystem holding `path` (or its nearest existing parent) has free for this process."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    found = os.statvfs(path)
    return found.f_bavail * found.f_frsize
