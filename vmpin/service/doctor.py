"""``vmpin doctor``: check the state dir, and rebuild a store that cannot be used from the host.

vmpin's store is a cache of facts the host also holds, so a corrupt database is moved aside
(never deleted: it is evidence) and rebuilt:

- plain containers from runc's state (``<runc-root>/<id>/state.json``: the bundle in the
  ``bundle=`` label runc keeps for ``runc list``, the init pid and its start time), each
  turned into the same journal event a ``createRuntime`` hook would have written and applied
  by the store's one ingest path;
- Kata sandboxes from the VM dir (``<vm-dir>/<id>/pid``, checked against the QEMU command
  line); their containers' CPU sets return with their next hook or ``vmpin update``, and
  kubelet's checkpoint keeps feeding CPU sets to containers the store knows.

Checks, each one line: the state dir is a real directory, writable, with free space; the
database opens and passes ``PRAGMA quick_check``; how many journal events are pending,
quarantined (``journal/bad/``) or left half-written by killed hooks.

Then what the node's Kata configuration says about Kata's own vCPU pinning (one line per file
``--kata-config`` lists, vmpin.runtimes.kataconfig): ``[runtime] enable_vcpus_pinning = true``
means Kata pins vCPUs itself and vmpin follows its layout; a file that cannot be read is named
with what is wrong.  These lines inform and never make the state dir unhealthy.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from typing import Any

from vmpin.core.errors import VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.runtimes import runcstate, vmm
from vmpin.runtimes.kataconfig import read
from vmpin.runtimes.oci import State, hook_event
from vmpin.state import journal
from vmpin.state.records import SandboxRec
from vmpin.state.store import Store

#: below this much free space in the state dir, hooks' events may not be recorded.
MIN_FREE = 4 << 20


def _check_db(path: str) -> str | None:
    """None when the database is usable, else why not."""
    if not os.path.lexists(path):
        return None
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = db.execute("PRAGMA quick_check").fetchall()
            db.execute("SELECT COUNT(*) FROM containers").fetchone()
        finally:
            db.close()
    except sqlite3.Error as err:
        return str(err)
    if rows != [("ok",)]:
        return "; ".join(str(r[0]) for r in rows[:3])
    return None


def move_aside(path: str) -> str:
    """Rename the database and its WAL/shm files to ``<name>.corrupt-<time>``; the new name."""
    suffix = time.strftime(".corrupt-%Y%m%dT%H%M%S", time.gmtime())
    for extra in ("", "-wal", "-shm"):
        if os.path.lexists(path + extra):
            os.rename(path + extra, path + suffix + extra)
    return path + suffix


def _runc_bundle(state: dict[str, Any]) -> str | None:
    config = state.get("config")
    labels = config.get("labels") if isinstance(config, dict) else None
    for label in labels if isinstance(labels, list) else []:
        if isinstance(label, str) and label.startswith("bundle="):
            return label[len("bundle=") :]
    return None


def rebuild(paths: HostPaths, store: Store) -> list[str]:
    """Record what the host says is running; one line per container or sandbox recovered."""
    out: list[str] = []
    ids: list[str] = []
    # runc_root is a search list ("/run/runc:/run/containerd/runc/*"): each root it names
    # (issue 26: the raw option string was listed as one directory, so nothing was found)
    for root in runcstate.runc_roots(paths):
        try:
            ids.extend(n for n in sorted(os.listdir(root)) if n not in ids)
        except OSError:
            continue
    for cid in ids:
        try:
            state = runcstate.read_state(paths, cid)
            pid = runcstate.runc_init_pid(paths, cid)
            bundle = _runc_bundle(state) if state else None
            if state is None or pid is None or not bundle:
                continue
            event = hook_event(paths, "createRuntime", State(cid, "running", pid, bundle, {}))
            journal.append(paths.state_dir, event)
            out.append(f"container {cid}: recovered from runc state (bundle {bundle})")
        except VmpinError as err:
            out.append(f"container {cid}: not recovered: {err}")
    store.ingest()
    try:
        sandboxes = sorted(os.listdir(paths.vm_dir))
    except OSError:
        sandboxes = []
    for sid in sandboxes:
        try:
            found = vmm.find_vmm(paths, sid, scan=False)
        except VmpinError as err:
            out.append(f"sandbox {sid}: not recovered: {err}")
            continue
        if found is not None and store.sandbox(sid) is None:
            store.put_sandbox(SandboxRec(sid, "kata", found.pid, found.start))
            out.append(f"sandbox {sid}: recovered from {paths.vm_dir} (QEMU pid {found.pid})")
    return out


def kata_lines(paths: HostPaths) -> list[str]:
    """Kata's configuration files and their ``enable_vcpus_pinning``, read afresh."""
    return read(paths.kata_config).lines(paths.kata_config)


def doctor(paths: HostPaths, *, repair: bool = True) -> tuple[bool, list[str]]:
    """(healthy after what was done, lines to print)."""
    ok, lines = _state_dir(paths, repair)
    return ok, lines + kata_lines(paths)


def _state_dir(paths: HostPaths, repair: bool) -> tuple[bool, list[str]]:
    lines: list[str] = []
    ok = True
    d = paths.state_dir
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return True, [f"{d}: does not exist yet (created at the first hook or command)"]
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return False, [f"{d}: not a directory (a symlink?): point --state-dir at a real directory"]
    if not os.access(d, os.W_OK):
        ok = False
        lines.append(f"{d}: not writable (read-only?): hooks cannot record events")
    vfs = os.statvfs(d)
    free = vfs.f_bavail * vfs.f_frsize
    if free < MIN_FREE:
        ok = False
        lines.append(f"{d}: only {free} bytes free: hooks' events may not be recorded")
    db = paths.db
    why = _check_db(db)
    if why is None:
        lines.append(f"{db}: ok")
    elif not repair:
        ok = False
        lines.append(f"{db}: unusable ({why}): run `vmpin doctor` without --dry-run to rebuild")
    else:
        aside = move_aside(db)
        lines.append(f"{db}: unusable ({why}): moved aside to {aside}")
        with Store(d, ingest=False) as store:
            found = rebuild(paths, store)
            lines.extend(found)
            recovered = sum(1 for line in found if ": recovered from" in line)
        lines.append(
            f"{db}: rebuilt from the host ({recovered} containers and sandboxes recovered)"
            if recovered
            else f"{db}: rebuilt empty: the host showed no runc container or Kata VM"
            f" (runc roots {paths.runc_root}, VM dir {paths.vm_dir})"
        )
    pending = journal.backlog(d)
    bad = journal.quarantined(d)
    lines.append(f"{journal.journal_dir(d)}: {pending} entries pending")
    if bad:
        lines.append(
            f"{journal.bad_dir(d)}: {bad} entries quarantined (each with a .reason file;"
            " delete them once read)"
        )
    if repair:
        swept = journal.sweep_tmp(d)
        if swept:
            lines.append(f"{journal.journal_dir(d)}: removed {swept} files of killed hooks")
    return ok, lines
