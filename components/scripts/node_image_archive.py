# What an image receiver (node_fabric_copy.py imports it)
# lets through to `docker load`: the depot's `docker save` of one image id, and nothing else. `docker load` acts on
# an archive's metadata — manifest.json (each image's config and RepoTags), index.json (OCI, names in annotations),
# repositories (the legacy name → id map) — so a depot (or whoever holds the copy token) could otherwise load
# more images than the one asked for and give any of them a name this node already uses (`haproxy:3.0`, the
# router's image: the next container made from that name runs what the depot chose). The id check after the load
# comes too late for that.
#
# So the archive is read as it streams (a tar: 512-byte headers, data padded to 512): the data of layers passes
# on at once; each metadata file is held back until it is whole and checked; whatever breaks a rule ends the
# stream before `docker load` has the archive's end (its request body is cut, so it loads nothing). The rules
# mirror what `docker load` reads (moby image/tarexport/load.go; archive/tar's header-only types): exactly one
# image, the id asked for (its config's digest; where Docker keeps images in containerd, the digest index.json
# names: moby daemon/containerd/image_exporter.go strips the names of an image saved by its id); no name
# anywhere; each metadata file once, a regular file at the top, at most 1 MiB; no absolute or `..` path, no path
# through a link placed earlier, no device or FIFO. The archive's own bytes are what Docker checks (the id is a
# digest of them). Standard library only.
import json
import posixpath

BLOCK = 512
ARCHIVE_METADATA = ("manifest.json", "index.json", "repositories")
METADATA_LIMIT = 1 << 20
NAME_ANNOTATIONS = ("io.containerd.image.name", "org.opencontainers.image.ref.name")
HEADER_ONLY = {b"1", b"2", b"5"}  # links and directories: no data follows (whatever their size says)
KNOWN = {b"0", b"\0", b"7", *HEADER_ONLY}  # what `docker save` writes; devices, FIFOs, GNU's other kinds are not


class ArchiveError(Exception):
    pass


def octal_or_binary(field):
    """A tar number field: octal text, or base-256 when its first byte has the high bit (GNU, sizes over 8 GiB)."""
    if field and field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        return value if not field[0] & 0x40 else -1
    text = field.split(b"\0", 1)[0].strip(b" \0")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ArchiveError(f"holds a tar header with an unreadable number {field!r}") from None


def pax_records(data):
    """The key=value records of a PAX header ("%d %s=%s\n" each)."""
    records, at = {}, 0
    while at < len(data):
        space = data.find(b" ", at)
        length = int(data[at:space]) if space > at and data[at:space].isdigit() else 0
        if length <= 0 or at + length > len(data):
            raise ArchiveError("holds a PAX header that cannot be read")
        key, _, value = data[space + 1 : at + length - 1].partition(b"=")
        records[key.decode(errors="replace")] = value.decode(errors="replace")
        at += length
    return records


def padded(size):
    return (size + BLOCK - 1) // BLOCK * BLOCK


class Pieces(list):
    """What may go on now, as pieces of the chunks fed (a layer's data passes as slices of them, uncopied)."""

    def extend(self, piece):
        if len(piece):
            self.append(piece)


class ArchiveCheck:
    """`feed(chunk)` returns what may go on to `docker load` now (Pieces: bytes-like, in order; a memoryview is
    valid while its chunk is); `finish()` at the stream's end. Either raises ArchiveError, saying what the archive
    holds that it may not."""

    def __init__(self, image_id, by_index=False):
        self.expected = image_id.split(":", 1)[-1]
        self.by_index = by_index  # the receiving Docker keeps images in containerd: the id is index.json's digest
        self.header = bytearray()  # a header block in progress
        self.remaining = 0  # bytes of the current entry's data (padded) still to come
        self.held = None  # a metadata entry (its headers and data) or an extended header, held back
        self.held_kind = None  # ("metadata", name, size, start) or ("extended", typeflag, size, start): start of data
        self.next_name, self.next_size = None, None  # what a PAX or GNU long-name header says of the next entry
        self.links = set()  # paths of the links placed so far
        self.seen = set()
        self.zero_blocks = 0
        self.index_digest = None  # what index.json, read before manifest.json (Docker writes them in that order), names

    def feed(self, chunk):
        out, data, at = Pieces(), memoryview(chunk), 0
        while at < len(data):
            if self.zero_blocks >= 2:  # after the archive's end `docker load` reads nothing: neither is it sent
                return out
            if self.remaining:
                take = min(self.remaining, len(data) - at)
                (self.held if self.held is not None else out).extend(data[at : at + take])
                self.remaining -= take
                at += take
                if not self.remaining and self.held is not None:
                    self.entry_done(out)
                continue
            take = min(BLOCK - len(self.header), len(data) - at)
            self.header.extend(data[at : at + take])
            at += take
            if len(self.header) == BLOCK:
                block = bytes(self.header)
                self.header.clear()
                self.read_header(block, out)
        return out

    def finish(self):
        if self.remaining or self.header or self.held is not None:
            raise ArchiveError("ends inside an entry")
        if "manifest.json" not in self.seen:
            raise ArchiveError("has no manifest.json")

    def read_header(self, block, out):
        if block == bytes(BLOCK):
            self.zero_blocks += 1
            out.extend(block)
            return
        if self.zero_blocks:
            raise ArchiveError("goes on after an empty block")
        kind, size = block[156:157], octal_or_binary(block[124:136])
        if size < 0:
            raise ArchiveError("holds an entry of negative size")
        if kind in (b"x", b"g", b"L"):
            if size > METADATA_LIMIT or (self.held is not None and self.held_kind[0] != "extended"):
                raise ArchiveError(f"holds an extended header of {size} bytes")
            self.held = self.held if self.held is not None else bytearray()
            self.held.extend(block)
            self.held_kind, self.remaining = ("extended", kind, size, len(self.held)), padded(size)
            if not size:
                self.entry_done(out)
            return
        self.entry(block, kind, size, out)

    def entry(self, block, kind, size, out):
        size = self.next_size if self.next_size is not None else size
        name = self.next_name or self.ustar_name(block)
        self.next_name, self.next_size = None, None
        path = self.checked_path(name)
        if kind not in KNOWN:
            raise ArchiveError(f"holds an entry of type {kind!r} ({path[:200]}): a device, a FIFO or not Docker's")
        extended = self.held if self.held is not None else bytearray()
        self.held = None
        self.remaining = 0 if kind in HEADER_ONLY else padded(size)
        if kind in (b"1", b"2"):
            self.links.add(path)
        if path in ARCHIVE_METADATA:
            if kind not in (b"0", b"\0", b"7") or path in self.seen or size > METADATA_LIMIT:
                raise ArchiveError(f"holds {path} twice, as other than a file, or over 1 MiB")
            self.seen.add(path)
            self.held, self.held_kind = bytearray(extended + block), ("metadata", path, size, len(extended) + BLOCK)
            if not self.remaining:
                self.entry_done(out)
            return
        out.extend(extended)
        out.extend(block)

    @staticmethod
    def ustar_name(block):
        name = block[0:100].split(b"\0", 1)[0]
        if block[257:263] == b"ustar\0":  # POSIX; GNU's "ustar  " has no prefix there
            prefix = block[345:500].split(b"\0", 1)[0]
            name = prefix + b"/" + name if prefix else name
        return name.decode(errors="replace")

    def checked_path(self, name):
        if name.startswith("/") or "\0" in name:
            raise ArchiveError(f"holds an absolute path ({name[:200]})")
        parts = [part for part in name.split("/") if part not in ("", ".")]
        if ".." in parts or not parts:
            raise ArchiveError(f"holds a path outside the archive ({name[:200]})")
        path = "/".join(parts)
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in self.links:
                raise ArchiveError(f"holds a path through a link ({path[:200]})")
        return path

    def entry_done(self, out):
        kind, *facts = self.held_kind
        if kind == "extended":
            typeflag, size, start = facts
            records = self.held[start : start + size]
            if typeflag == b"L":
                self.next_name = bytes(records).split(b"\0", 1)[0].decode(errors="replace")
            elif typeflag == b"x":
                found = pax_records(bytes(records))
                self.next_name = found.get("path", self.next_name)
                if "size" in found and not found["size"].isdigit():
                    raise ArchiveError("holds a PAX size that is not a number")
                if "size" in found:
                    self.next_size = int(found["size"])
            elif {"path", "size"} & pax_records(bytes(records)).keys():
                raise ArchiveError("holds a global PAX header that names paths or sizes")
            return  # held until the entry it describes is read
        name, size, start = facts
        self.check_metadata(name, bytes(self.held[start : start + size]))
        out.extend(self.held)
        self.held, self.held_kind = None, None

    def check_metadata(self, name, content):
        try:
            found = json.loads(content.decode())
        except (UnicodeDecodeError, ValueError):
            raise ArchiveError(f"holds a {name} that is not JSON") from None
        if name == "manifest.json":
            self.check_manifest(found)
        elif name == "repositories":
            if found != {}:
                names = sorted(found) if isinstance(found, dict) else found
                raise ArchiveError(f"names images in repositories ({str(names)[:200]}): `docker load` would tag them")
        else:
            self.check_index(found)

    def check_index(self, found):
        """index.json (the OCI layout, Docker 25 and later): one image, no name. Its descriptor's digest is the
        image's id where Docker keeps images in containerd (what `docker images` shows there)."""
        manifests = found.get("manifests") if isinstance(found, dict) else None
        if not isinstance(manifests, list) or len(manifests) > 1 or not all(isinstance(m, dict) for m in manifests):
            raise ArchiveError("holds an index.json that is not one image's")
        first = manifests[0] if manifests else {}
        annotations = first.get("annotations") if isinstance(first.get("annotations"), dict) else {}
        named = [str(annotations.get(key))[:200] for key in NAME_ANNOTATIONS if key in annotations]
        if named:
            raise ArchiveError(f"names its image in index.json ({', '.join(named)}): `docker load` would tag it")
        digest = first.get("digest")
        self.index_digest = digest.split(":", 1)[-1] if isinstance(digest, str) else None

    def check_manifest(self, found):
        if not isinstance(found, list) or len(found) != 1 or not isinstance(found[0], dict):
            count = len(found) if isinstance(found, list) else "no list of"
            raise ArchiveError(f"holds {count} images, not the one asked for")
        image = found[0]
        config = image.get("Config")
        name = posixpath.basename(config) if isinstance(config, str) else None
        digest = name[: -len(".json")] if name and name.endswith(".json") else name  # (str.removesuffix: 3.9)
        if self.by_index:
            found, said = self.index_digest, f"sha256:{self.index_digest}" if self.index_digest else "index.json names"
        else:
            found, said = digest, str(config)[:200]
        if found != self.expected:  # the id `docker load` gives what it loads, on this node's Docker
            raise ArchiveError(f"holds the image {said}, not sha256:{self.expected}")
        if image.get("RepoTags") not in (None, []):
            tags = image.get("RepoTags")
            raise ArchiveError(f"names its image {str(tags)[:200]} in manifest.json: `docker load` would tag it")
