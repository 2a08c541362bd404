"""The agent's watch on changes that fire no hook: runc's state.json and kubelet's checkpoint.

Why: the CRI's UpdateContainerResources (kubelet moving a container's CPUs) makes containerd
run ``runc update --resources -``, which rewrites the cgroup and runc's ``state.json`` and runs
no OCI hook; kubelet's static CPU manager rewrites ``cpu_manager_state`` when it hands CPUs out
or back.  The periodic pass would notice both, seconds later; this watch notices them within
milliseconds through inotify and only *marks work*: it names the sandboxes concerned to a
callback (the agent's ``notify``, which queues an event pass for each).  It never plans,
never writes the store, and is no part of the hook path.

What is watched (all inotify, one thread):

- every runc root (:func:`vmpin.runtimes.runcstate.runc_roots`) for container directories
  appearing and going; each container directory for ``state.json`` being replaced (runc
  writes a temporary file and renames it over: ``IN_MOVED_TO``; ``IN_CLOSE_WRITE`` covers a
  writer that rewrites in place).  The directory's name is the container id.
- for a ``DIR/*`` root (containerd's namespaces), DIR itself, so a namespace created later is
  picked up; for a root missing now, its parent (runc creates its root with the first
  container); anything still missing is looked for again every ``rescan`` seconds.  A
  container directory watched only after it appeared counts as changed: its state may have
  been rewritten before the watch was in place.
- the directory of kubelet's checkpoint, for that file name (kubelet writes a temporary file
  and renames it over the checkpoint, so a watch on the file itself would go stale).

Container ids map to sandboxes through the store (the watcher's own connection; it only
reads, after applying the hooks' journal as every reader does); a change to a container
vmpin has not recorded is ignored (its hook, or the periodic pass, brings it in).  A
checkpoint change marks every sandbox.  Events read in one batch are folded into one
callback.

Library: ``inotify_simple`` (maintained, tiny, typed errors as OSError), not hand-written
ctypes: the struct layout of ``inotify_event`` and the variable-length name parsing are
exactly what such a wrapper gets right once.  It is imported here only, lazily by the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable

import inotify_simple

from vmpin.core.errors import VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.runcstate import runc_roots
from vmpin.state.store import Store

log = logging.getLogger("vmpin.service.watch")

_F = inotify_simple.flags
#: a runc root: container directories come and go
ROOT_MASK = _F.CREATE | _F.MOVED_TO | _F.DELETE | _F.ONLYDIR
#: a container directory, and the checkpoint's directory: a file replaced or rewritten
FILE_MASK = _F.MOVED_TO | _F.CLOSE_WRITE
#: containerd's namespace parent: namespaces appear
PARENT_MASK = _F.CREATE | _F.MOVED_TO | _F.ONLYDIR
RUNC_STATE = "state.json"


class Watcher:
    """One inotify instance and its thread; ``on_dirty(sandbox_ids)`` is called from it."""

    def __init__(
        self,
        paths: HostPaths,
        on_dirty: Callable[[list[str]], object],
        *,
        rescan: float = 2.0,
        on_error: Callable[[str, BaseException], object] | None = None,
    ) -> None:
        self.paths = paths
        self.on_dirty = on_dirty
        #: told of an error the watch outlives (the agent counts it and says it once a
        #: minute, :meth:`vmpin.service.logs.Faults.report`); by default a warning each time
        self.on_error = on_error or (lambda where, err: log.warning("%s: %s", where, err))
        self.rescan = rescan
        self._ino = inotify_simple.INotify()
        #: watch descriptor -> (path, kinds); kinds: "root", "container", "parent", "kubelet"
        #: (one directory can be several: the checkpoint's dir may also be a root's parent)
        self._wds: dict[int, tuple[str, frozenset[str]]] = {}
        #: path -> (watch descriptor, mask)
        self._watched: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kubelet_dir, self._kubelet_name = os.path.split(paths.kubelet_state)
        self.batches = 0  # callbacks made (for tests and status)

    # -- watches --------------------------------------------------------------------------
    def _add(self, path: str, mask: int, kind: str) -> bool:
        old_wd, old_mask = self._watched.get(path, (-1, 0))
        if old_wd >= 0 and kind in self._wds[old_wd][1]:
            return True
        try:
            # the same inode gives the same descriptor, its mask replaced: pass the union
            wd = self._ino.add_watch(path, mask | old_mask)
        except OSError as err:
            # ENOENT: not there (yet); ENOSPC: fs.inotify.max_user_watches reached -- the
            # periodic pass still covers what is not watched.
            if err.errno != 2:
                log.warning("cannot watch %s: %s", path, err.strerror)
            return False
        kinds = self._wds[old_wd][1] if old_wd == wd else frozenset()
        self._wds[wd] = (path, kinds | {kind})
        self._watched[path] = (wd, mask | old_mask)
        return True

    def scan(self) -> set[str]:
        """Watch every root, container directory and parent that exists now; the containers
        newly watched (their state may have changed before the watch was in place)."""
        new: set[str] = set()
        for entry in self.paths.runc_root.split(":"):
            if entry.endswith("/*"):
                self._add(entry[:-2] or "/", PARENT_MASK, "parent")
            elif entry and not os.path.isdir(entry):
                # not there yet (runc makes its root with the first container): watch the
                # parent for it, so the first container's updates are not missed
                self._add(os.path.dirname(entry.rstrip("/")) or "/", PARENT_MASK, "parent")
        for root in runc_roots(self.paths):
            if not self._add(root, ROOT_MASK, "root"):
                continue
            try:
                with os.scandir(root) as it:
                    dirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for d in dirs:
                if d not in self._watched and self._add(d, FILE_MASK, "container"):
                    new.add(os.path.basename(d))
        if self._kubelet_dir:
            self._add(self._kubelet_dir, FILE_MASK, "kubelet")
        return new

    # -- events ---------------------------------------------------------------------------
    def _changes(self, events: list[inotify_simple.Event]) -> tuple[set[str], bool]:
        """(container ids whose runc state changed, whether kubelet's checkpoint changed)."""
        containers: set[str] = set()
        kubelet = False
        for ev in events:
            if ev.mask & _F.IGNORED:  # the watched directory went away
                gone = self._wds.pop(ev.wd, None)
                if gone is not None:
                    self._watched.pop(gone[0], None)
                continue
            path, kinds = self._wds.get(ev.wd, ("", frozenset()))
            if "container" in kinds and ev.name == RUNC_STATE:
                containers.add(os.path.basename(path))
            new_dir = ev.name and ev.mask & _F.ISDIR and ev.mask & (_F.CREATE | _F.MOVED_TO)
            # a new container: its state.json may already be in place
            if (
                "root" in kinds
                and new_dir
                and self._add(os.path.join(path, ev.name), FILE_MASK, "container")
            ):
                containers.add(ev.name)
            if "parent" in kinds and new_dir:
                containers |= self.scan()  # a new namespace directory, or a root appearing
            if "kubelet" in kinds and ev.name == self._kubelet_name:
                kubelet = True
        return containers, kubelet

    def _sandboxes(self, store: Store, containers: set[str], everything: bool) -> list[str]:
        if everything:
            return [s.id for s in store.sandboxes()]
        recs = {cid: store.container(cid) for cid in sorted(containers)}
        if None in recs.values() and store.ingest():
            # hooks journal their events when the store is busy; every reader applies them
            recs = {cid: store.container(cid) for cid in recs}
        found: list[str] = []
        for rec in recs.values():
            if rec is not None and rec.sandbox_id not in found:
                found.append(rec.sandbox_id)
        return found

    def run(self) -> None:
        """The thread: read events, mark work, until :meth:`close`.

        An error from the host (EMFILE, ENOMEM, EIO on a read, a scan or the store) is told
        to ``on_error`` and the watch goes on a second later with a fresh scan: what it
        missed meanwhile, the periodic pass sees (issue 26: the thread ended instead, and the
        watch with it)."""
        store: Store | None = None
        scanned = False
        since_scan = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if not scanned:
                        self.scan()
                        scanned = True
                    store, since_scan = self._turn(store, since_scan)
                except (VmpinError, OSError, MemoryError, sqlite3.Error) as err:
                    self.on_error("watch", err)
                    scanned = False
                    self._stop.wait(1.0)
        finally:
            if store is not None:
                store.close()

    def _turn(self, store: Store | None, since_scan: float) -> tuple[Store | None, float]:
        """One read of events (at most 0.2 s) and the work they mark: the store connection
        (opened at the first change that needs it), and the time since the last scan."""
        events = self._ino.read(timeout=200, read_delay=None)
        if self._stop.is_set():
            return store, since_scan
        containers, kubelet = self._changes(events)
        if not events:
            since_scan += 0.2
            if since_scan >= self.rescan:  # roots that could not be watched before
                since_scan = 0.0
                containers |= self.scan()
        if not containers and not kubelet:
            return store, since_scan
        try:
            if store is None:
                store = Store(self.paths.state_dir, ingest=False)
            ids = self._sandboxes(store, containers, kubelet)
        except (VmpinError, OSError, sqlite3.Error) as err:
            self.on_error("watch: cannot map changes to sandboxes", err)
            return store, since_scan
        if ids:
            self.batches += 1
            self.on_dirty(ids)
        return store, since_scan

    def start(self) -> Watcher:
        self._thread = threading.Thread(target=self.run, name="vmpin-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            self._ino.close()


def start(
    paths: HostPaths,
    on_dirty: Callable[[list[str]], object],
    on_error: Callable[[str, BaseException], object] | None = None,
) -> Watcher | None:
    """A running watcher, or None (logged) when inotify is unavailable: the periodic pass
    then stays the only way such changes are seen."""
    try:
        return Watcher(paths, on_dirty, on_error=on_error).start()
    except OSError as err:
        log.warning(
            "no inotify watch (%s): updates without hooks wait for the periodic pass", err.strerror
        )
        return None
