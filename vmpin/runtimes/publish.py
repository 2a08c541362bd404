"""Publish a sandbox's guest map where its guest can read it: the host half of the channel.

Kata shares one directory per sandbox with the guest: on the host
``/run/kata-containers/shared/sandboxes/<sandbox>/mounts/`` (which the runtime populates) is
bind-mounted read-only at ``.../<sandbox>/shared/``, exported over virtio-fs (or 9p), and
seen inside the guest at ``/run/kata-containers/shared/containers/``.  So the host writes

    <publish_dir>/<sandbox>/mounts/vmpin/guest-map.json

and the guest reads ``/run/kata-containers/shared/containers/vmpin/guest-map.json``
(:data:`vmpin.wire.guestmap.DEFAULT_GUEST_MAP`), with nothing but the standard library and no
access to vmpin's host state.  ``docs/guest.md`` is the contract; :mod:`vmpin.wire.guestmap`
holds the format (version, names, limits, reader), so the two sides cannot drift.

Rules this module keeps, and why:

- **Where**: ``HostPaths.publish_dir`` (``--publish-dir`` / ``VMPIN_PUBLISH_DIR``).  A plain
  directory means Kata's layout above.  A value holding ``{sandbox}`` is a template for the
  map's directory (or, ending in ``.json``, for the file itself), for other runtimes'
  layouts, e.g. ``/srv/guests/{sandbox}/vmpin``.
- **Only into a directory that exists**: vmpin creates the map's own directory (``vmpin/``)
  and nothing above it.  When ``mounts/`` is missing, Kata shares nothing with this guest
  (no shared fs, or the sandbox is gone), and creating it would leave a directory behind
  that no one removes -- or resurrect a torn-down sandbox's.
- **Atomic**: a temporary file in the same directory, renamed over the map. A reader sees
  the old map or the new one, never half of one, and a writer killed at any point leaves the
  map whole (the kernel has every write it made). No fsync: what a sync adds is the map
  surviving the host's own crash, and a map describes a running VM, which does not survive
  it (nor does Kata's shared dir, on ``/run``, a tmpfs on a node). On a disk the two syncs
  were 0.4-3 ms of every Kata start and update (docs/benchmarks.md).
- **One writer at a time, by the caller's lock**: vmpin's passes publish under the node's
  plan lock (vmpin.state.locks, in the state dir, owner-only), so the generation counts up
  by one per change even when many hook processes publish at once, and a map of an older
  plan never lands after a newer one.  Nothing here takes a lock on the shared directory:
  ``flock`` needs only an open descriptor, and whoever can open that directory (any user,
  through its 0755; the guest, through virtio-fs) could hold it for ever and stall every
  hook (issue 26).
- **Only on change**: a reconcile pass publishes every Kata sandbox; the map is rewritten
  only when its content (everything but the generation and timestamp) differs from the file
  there, so an idle node writes nothing and the guest's caches stay valid.
- **No symlink followed, nothing but regular files read**: the shared dir and ``vmpin/`` are
  opened with ``O_NOFOLLOW | O_DIRECTORY`` and everything below is done relative to that
  directory fd (``openat``/``renameat``/``unlinkat``), so a ``vmpin`` symlink planted in a
  shared dir cannot make vmpin write the map (or delete temporary files) elsewhere; the old
  map is read through vmpin.linux.files (a FIFO or ``/dev/zero`` there is refused, not read
  while the caller holds its lock).
- **Versioned**: ``"version": 1``; readers ignore unknown keys, so fields can be added
  without a bump; a bump means old readers must refuse the file.
"""

from __future__ import annotations

import errno
import os
import time

from vmpin.core.errors import HostError, PermissionDenied, SpecError
from vmpin.core.ids import check_id
from vmpin.linux.files import (
    MEMO_LIMIT,
    identity,
    load_json,
    read_bytes,
    remember,
    stale_stamp,
    version,
)
from vmpin.linux.paths import HostPaths
from vmpin.wire import guestmap as wire
from vmpin.wire.guestmap import GUEST_SHARED_DIR, MAP_DIRNAME, MAP_FILENAME

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NamedTuple, NoReturn
else:
    from vmpin.lean.records import NamedTuple

#: the part of the layout below each sandbox's directory that Kata shares with the guest.
KATA_SHARED_SUBDIR = "mounts"
#: keys that change on every write, and so are left out when comparing content.
VOLATILE = ("generation", "published_at")
TEMPLATE_FIELD = "{sandbox}"


class Published(NamedTuple):
    """What :func:`publish_map` did: ``written`` False when the map was already there or
    could not be shared (``reason`` says which)."""

    path: str
    written: bool
    generation: int | None
    reason: str


def map_path(paths: HostPaths, sandbox_id: str) -> str:
    """Where the sandbox's map goes on the host (the sandbox id is checked: it names a dir)."""
    check_id(sandbox_id, "sandbox id")
    base = paths.publish_dir
    if TEMPLATE_FIELD in base:
        expanded = base.replace(TEMPLATE_FIELD, sandbox_id)
        if expanded.endswith(".json"):
            return expanded
        return os.path.join(expanded, MAP_FILENAME)
    return os.path.join(base, sandbox_id, KATA_SHARED_SUBDIR, MAP_DIRNAME, MAP_FILENAME)


def guest_path(guest_shared_dir: str = GUEST_SHARED_DIR) -> str:
    """Where the guest sees the map under Kata's layout (its shared dir, then ours)."""
    return os.path.join(guest_shared_dir, MAP_DIRNAME, MAP_FILENAME)


def content(sandbox_id: str, guest_map: Mapping[str, Any]) -> dict[str, Any]:
    """The published document without its volatile keys: what "changed" is judged on.

    ``guest_map`` is :func:`vmpin.core.guestmap.map_sandbox`'s dict; each container entry is what
    ``vmpin guest-map CONTAINER --json`` prints (to which :func:`render` adds a generation).
    The shape is :func:`vmpin.wire.guestmap.document`'s.
    """
    return wire.document(sandbox_id, guest_map)


def _strip(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A published document minus its volatile keys, comparable with :func:`content`."""
    out = {k: v for k, v in doc.items() if k not in VOLATILE}
    containers = out.get("containers")
    if isinstance(containers, dict):
        out["containers"] = {
            cid: {k: v for k, v in e.items() if k != "generation"} if isinstance(e, dict) else e
            for cid, e in containers.items()
        }
    return out


def render(
    new: Mapping[str, Any],
    old: Mapping[str, Any] | None,
    now: float | None = None,
    old_content: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The document to write: ``new`` content, one generation past ``old``'s.

    A container's own ``generation`` is the one at which its entry last changed, so a guest
    program can tell whether *its* container's vCPUs moved.  ``old_content``: ``old``'s
    content (:func:`content`), when the caller knows it (a map this process wrote): its
    entries are compared as they are, not stripped of their generation again.
    """
    old_gen = old.get("generation") if old is not None else None
    gen = old_gen + 1 if isinstance(old_gen, int) and old_gen >= 0 else 1
    old_ctrs = old.get("containers") if old is not None else None
    old_ctrs = old_ctrs if isinstance(old_ctrs, dict) else {}
    known = old_content["containers"] if old_content is not None else None
    containers: dict[str, Any] = {}
    for cid, entry in new["containers"].items():
        prev = old_ctrs.get(cid)
        prev_gen = prev.get("generation") if isinstance(prev, dict) else None
        same = (
            isinstance(prev, dict)
            and isinstance(prev_gen, int)
            and (
                known.get(cid) == entry
                if known is not None
                else {k: v for k, v in prev.items() if k != "generation"} == entry
            )
        )
        containers[cid] = {**entry, "generation": prev_gen if same else gen}
    published_at = time.time() if now is None else now
    doc = dict(new)  # (its containers replaced below: the keys are written sorted)
    doc.update(generation=gen, published_at=round(published_at, 3), containers=containers)
    return doc


#: a guest map for 512 vCPUs and 100 containers is ~60 KiB.
MAX_MAP = 1 << 20
#: replaced maps a caller may hold open at once (``publish_map(hold=...)``): a pass over a
#: whole node replaces thousands, and each held file is an open descriptor
HOLD_MAX = 64


def read_published(path: str, dir_fd: int | None = None) -> dict[str, Any] | None:
    """The map now at ``path``; None when absent or unreadable as a map (then rewritten).

    A symlink, FIFO, device or oversized file there is not read (and is replaced by the
    rename that follows)."""
    try:
        raw = read_bytes(path, limit=MAX_MAP, dir_fd=dir_fd, what="guest map")
        doc = load_json(raw, path)
    except (OSError, SpecError):
        return None
    return doc if isinstance(doc, dict) else None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: a replaced map held open: never through a symlink, never blocking on a FIFO
_HOLD_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_dir(path: str, name: str | None = None, dir_fd: int | None = None) -> int:
    """A directory fd that is not reached through a symlink (last component)."""
    try:
        return os.open(name if name is not None else path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        _refuse_dir(err, path if name is None else os.path.join(path, name))


def _refuse_dir(err: OSError, where: str) -> NoReturn:
    """Why the directory ``where`` could not be opened (a symlink's refusal chains nothing)."""
    if err.errno in (errno.ELOOP, errno.ENOTDIR):
        raise HostError(
            f"publishing guest map: {where} is not a directory (a symlink?): refused"
        ) from None
    raise _translate(err, where, "open") from err


def _translate(err: OSError, path: str, what: str) -> HostError:
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"publishing guest map: cannot {what} {path}: {err.strerror}")
    return HostError(f"publishing guest map: cannot {what} {path}: {err.strerror}")


#: map path -> (its identity, (the guest map it holds, its generation)) when a pass last found
#: it current (the content is a function of the sandbox id, which the path names, and the map):
#: an idle pass re-checks each sandbox's map with one lstat instead of two directory opens
#: and a read (2,000 of them in an idle pass, issue 14)
_PUBLISHED: dict[
    str, tuple[tuple[int, int, int, int, int], tuple[Mapping[str, Any], int | None]]
] = {}
#: map path -> (its identity just after this process renamed it there, the document it
#: wrote, that document's content, the version of its directory then when no temp map was
#: left in it, else None): while the file there is that one, a change of content is
#: rendered from it, not from the file read, parsed and compared again (an agent's event pass
#: republishes its VM's map at each update, issue 28).  Only a change: "unchanged" is judged
#: by the file itself (:data:`_PUBLISHED`, a settled version), a version just written being
#: too young to be told from a rewrite in place within the same clock tick; and what a stale
#: memo would cost is the generation only, the map being replaced whole either way.
#: While the directory is still at its version, no entry was made in it since, so no dead
#: writer's temp map can be there to sweep: the next write skips the listing
#: (:func:`_remove_stale_temps`; one listing of the directory, eight system calls, per map
#: written: an agent's event pass writes its VM's map at each update, issue 28).  A temp made
#: within the same clock tick as that version, on a filesystem whose directories do not
#: change size with their entries (not tmpfs, where Kata's shared dirs are), by a writer that
#: then died, is swept at the next write that finds the directory moved instead: a leftover
#: file at worst, never a map lost.
_WRITTEN: dict[
    str,
    tuple[
        tuple[int, int, int, int, int],
        Mapping[str, Any],
        Mapping[str, Any],
        tuple[int, int, int, int, int] | None,
    ],
] = {}


def publish_map(
    paths: HostPaths,
    sandbox_id: str,
    guest_map: Mapping[str, Any],
    *,
    now: float | None = None,
    hold: list[int] | None = None,
) -> Published:
    """Write the sandbox's map for its guest, atomically and only when its content changed.

    Returns what happened; raises :class:`HostError` only when the shared directory exists
    and the write failed (a sandbox with nothing shared is not an error: nothing to do).
    ``guest_map`` is not to change once given (a plan's maps do not): a map found current is
    remembered by it, and checked again with one ``lstat`` while the same one is given.

    ``hold``: the map replaced is kept open, its descriptor appended there (up to
    :data:`HOLD_MAX`), for the caller to close once whoever waits has its answer.  Freeing
    the old file is most of a rename over it on ext4 (~0.22 of ~0.24 ms here, issue 14); an
    open file is freed at its last close instead.  (The agent does this; a short-lived
    process would only move the cost to its exit.)
    """
    path = map_path(paths, sandbox_id)
    known = _PUBLISHED.get(path)
    if (
        known is not None
        and (known[1][0] is guest_map or known[1][0] == guest_map)
        and identity(path) == known[0]
    ):
        # what we found current there before, untouched since: one lstat.
        # (The map given is kept, not the older equal one: that one's plan may go.)
        remember(_PUBLISHED, path, known[0], (guest_map, known[1][1]))
        return Published(path, False, known[1][1], "unchanged")
    new = content(sandbox_id, guest_map)
    directory, fname = os.path.split(path)
    shared, name = os.path.split(directory)
    try:
        shared_fd = _open_dir(shared)
    except HostError:
        if not os.path.lexists(shared):
            return Published(path, False, None, f"not shared with a guest: {shared} does not exist")
        raise
    created = False
    try:
        try:
            dir_fd = os.open(name, _DIR_FLAGS, dir_fd=shared_fd)
        except FileNotFoundError:
            # a first map: its directory is made here (opened first: one call fewer for
            # every later map than a mkdir that finds it there)
            try:
                os.mkdir(name, 0o755, dir_fd=shared_fd)
                created = True
            except FileExistsError:
                pass
            except FileNotFoundError:
                # The shared dir went away between the open and the mkdir: the sandbox is gone.
                return Published(
                    path, False, None, f"not shared with a guest: {shared} vanished"
                )
            except OSError as err:
                raise _translate(err, directory, "create") from err
            dir_fd = _open_dir(shared, name, shared_fd)
        except OSError as err:
            _refuse_dir(err, directory)
    finally:
        os.close(shared_fd)
    try:
        # (no lock here: the caller holds the node's plan lock, see the module's docstring)
        ident = identity(fname, dir_fd)
        wrote = _WRITTEN.pop(path, None)
        if created and ident is None:
            # A directory this call made, where no other writer put a map before this one
            # looked: nothing to compare, no temp file to sweep (a node's first pass
            # makes one per sandbox, issue 14).
            _PUBLISHED.pop(path, None)  # (a map of an earlier directory by that name)
            doc = render(new, None, now)
            _write_atomically(dir_fd, directory, path, doc, replacing=False)
            _wrote(path, fname, dir_fd, doc, new, False)
            return Published(path, True, doc["generation"], "written")
        old_content: Mapping[str, Any] | None = None
        if wrote is not None and ident is not None and wrote[0] == ident and wrote[2] != new:
            old: Mapping[str, Any] | None = wrote[1]  # (ours, untouched since: see _WRITTEN)
            old_content = wrote[2]
        else:
            old = read_published(fname, dir_fd)
            if old is not None and _strip(old) == new:
                gen = old.get("generation")
                gen = gen if isinstance(gen, int) else None
                if ident is not None:
                    remember(_PUBLISHED, path, ident, (guest_map, gen))
                return Published(path, False, gen, "unchanged")
        _PUBLISHED.pop(path, None)
        doc = render(new, old, now, old_content)
        # (no entry made in the directory since this process's last map there left none
        # but it: nothing to sweep, see _WRITTEN)
        clean = wrote is not None and wrote[3] is not None and _dir_version(dir_fd) == wrote[3]
        if not clean:
            clean = _remove_stale_temps(dir_fd, fname)
        _write_atomically(dir_fd, directory, path, doc, replacing=ident is not None, hold=hold)
        _wrote(path, fname, dir_fd, doc, new, clean)
        return Published(path, True, doc["generation"], "written")
    finally:
        os.close(dir_fd)


def _wrote(
    path: str,
    fname: str,
    dir_fd: int,
    doc: Mapping[str, Any],
    new: Mapping[str, Any],
    clean: bool,
) -> None:
    """Remember the map just renamed to ``fname`` (:data:`_WRITTEN`); ``clean``: no temp
    map was left in its directory before that (its version is then remembered too)."""
    ident = identity(fname, dir_fd)
    if ident is None:
        return
    if len(_WRITTEN) >= MEMO_LIMIT:
        _WRITTEN.clear()
    _WRITTEN[path] = (ident, doc, new, _dir_version(dir_fd) if clean else None)


def _dir_version(dir_fd: int) -> tuple[int, int, int, int, int] | None:
    """The version of the directory ``dir_fd`` (:func:`vmpin.linux.files.version`)."""
    try:
        return version(os.fstat(dir_fd))
    except OSError:
        return None


#: a temporary map older than this was left by a writer that died (a live one writes its
#: map in about a millisecond)
TMP_MAX_AGE = 60.0


def _dead_writer(name: str, prefix: str, dir_fd: int) -> bool:
    """Whether the temp file ``name`` (``<prefix><pid>.<monotonic ns>.tmp``) is a dead
    writer's: its pid is gone, or it is older than :data:`TMP_MAX_AGE` (a pass that went on
    without the node lock may be writing beside this one) by the monotonic stamp in its name,
    as the journal's temp files are aged (:func:`vmpin.linux.files.stale_stamp`); a name
    without one (an older vmpin's) by its mtime."""
    pid, _, rest = name[len(prefix) :].partition(".")
    if pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
    stale = stale_stamp(rest.split(".", 1)[0], TMP_MAX_AGE, time.monotonic_ns())
    if stale is not None:
        return stale
    try:
        return time.time() - os.lstat(name, dir_fd=dir_fd).st_mtime > TMP_MAX_AGE
    except OSError:
        return False


def _remove_stale_temps(dir_fd: int, fname: str) -> bool:
    """Temp files left by a writer that died mid-write; whether none is left (a live
    writer's is kept)."""
    prefix = f".{fname}."
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return False
    clean = True
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        if not _dead_writer(name, prefix, dir_fd):
            clean = False
            continue
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            clean = False
    return clean


def _write_atomically(
    dir_fd: int,
    directory: str,
    path: str,
    doc: Mapping[str, Any],
    *,
    replacing: bool = True,
    hold: list[int] | None = None,
) -> None:
    """Temp file + rename, relative to ``dir_fd``: the guest sees the old map or the new one
    (no fsync: see the module's docstring).  ``replacing``: a file is there to rename over;
    ``hold``: see :func:`publish_map`."""
    data = wire.to_json(doc)
    fname = os.path.basename(path)
    tmp = f".{fname}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
    except OSError as err:
        raise _translate(err, os.path.join(directory, tmp), "create") from err
    try:
        try:
            # 0644 whatever the umask: the guest reads it through virtio-fs/9p as another user.
            os.fchmod(fd, 0o644)
            if replacing:
                # Blocks allocated before the write: ext4 then has no delayed allocation to
                # flush when the rename below replaces the old map (its auto_da_alloc), ~0.1
                # of the rename's ~0.35 ms here (issue 14); the rest is freeing the old file.
                # (A rename to a new name flushes nothing.)  A filesystem that cannot
                # preallocate just writes.
                try:  # noqa: SIM105 (contextlib stays off the Kata hook's path)
                    os.posix_fallocate(fd, 0, len(data))
                except OSError:
                    pass
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        if replacing and hold is not None and len(hold) < HOLD_MAX:
            try:  # noqa: SIM105 (contextlib stays off the Kata hook's path)
                hold.append(os.open(fname, _HOLD_FLAGS, dir_fd=dir_fd))
            except OSError:
                pass  # (gone meanwhile, or a FIFO planted there: nothing to hold)
        os.replace(tmp, fname, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as err:
        try:  # noqa: SIM105 (contextlib stays off the Kata hook's path)
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise _translate(err, path, "write") from err


def remove_map(paths: HostPaths, sandbox_id: str) -> bool:
    """Remove the sandbox's published map (and its ``vmpin/`` dir when empty); True if removed.

    Kata removes the whole shared directory with the sandbox, so this is only for a sandbox
    vmpin stops managing while it runs, and for templates outside Kata's tree.
    """
    path = map_path(paths, sandbox_id)
    _PUBLISHED.pop(path, None)
    _WRITTEN.pop(path, None)
    directory = os.path.dirname(path)
    try:
        dir_fd = _open_dir(directory)
    except HostError:
        if not os.path.lexists(directory):
            return False
        raise
    try:
        os.unlink(os.path.basename(path), dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as err:
        raise _translate(err, path, "remove") from err
    finally:
        os.close(dir_fd)
    try:  # noqa: SIM105 (contextlib stays off the Kata hook's path)
        os.rmdir(directory)
    except OSError:
        pass  # not empty (someone else's files), or already gone
    return True
