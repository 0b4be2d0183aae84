# The model directory as the fabric copy sees it (node_fabric_copy.py, which this is prepended to by
# components.plan.programs.SCRIPT_HELPERS): what is synced (a directory, or a Hugging Face snapshot with the
# blobs its links point at), its manifest (sizes, times, links, the extents of sparse files), and
# what a receiver must fetch, fix or remove to match it. Standard library only, no side effects.
import errno
import os
import shutil
import stat


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
