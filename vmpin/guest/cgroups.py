"""A container's cpuset cgroup inside the guest: found, written, widened, read back.

The cgroup is the better of the two ways to pin (:mod:`vmpin.guest.pinning` holds the
choice): it covers every process the container will ever start, where an affinity covers
only the threads that exist now.  Its rules are the kernel's, and differ by version: v1
keeps a child's CPUs within its parent's and answers EACCES otherwise, so a vCPU
hot-plugged after the parent was made is missing there; v2 accepts any list and quietly
intersects it with the parent's.  Widening a parent changes what every sibling may use, so
it happens only when asked (``--widen-parents``) and always says so.
"""

from __future__ import annotations

import errno
import os
from typing import NamedTuple

from vmpin.guest.common import GuestError, errno_text, format_cpus, parse_cpus, read_text


class Cgroup(NamedTuple):
    """A cpuset cgroup: version, its directory, its path below the hierarchy's root."""

    version: int
    path: str
    rel: str
    root: str

    @property
    def cpus_file(self) -> str:
        return os.path.join(self.path, "cpuset.cpus")

    @property
    def effective_file(self) -> str:
        name = "cpuset.effective_cpus" if self.version == 1 else "cpuset.cpus.effective"
        return os.path.join(self.path, name)

    @property
    def tasks_file(self) -> str:
        return os.path.join(self.path, "tasks" if self.version == 1 else "cgroup.threads")


def find_cgroup(proc: str, cgroup_root: str, pid: int) -> Cgroup | None:
    """The cpuset cgroup of ``pid``, None when it has none of its own.

    A v1 ``cpuset`` line wins over v2's ``0::`` line (a controller is bound to one hierarchy
    at a time).  The hierarchy's root ("/") counts as none: it is the whole VM, not the
    container, and v1 does not let anyone write it anyway.
    """
    try:
        lines = read_text(os.path.join(proc, str(pid), "cgroup")).splitlines()
    except OSError:
        raise GuestError(f"process {pid} is gone") from None
    v2_rel = None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        # A cgroup removed under the process shows "/path (deleted)".
        rel = rel.removesuffix(" (deleted)")
        if hid == "0" and controllers == "":
            v2_rel = rel
        elif "cpuset" in controllers.split(","):
            if rel == "/":
                return None
            # Usually mounted at <root>/cpuset; co-mounted ones at <root>/<controller list>.
            for mount in ("cpuset", controllers):
                root = os.path.join(cgroup_root, mount)
                path = os.path.join(root, rel.lstrip("/"))
                if os.path.exists(os.path.join(path, "cpuset.cpus")):
                    return Cgroup(1, path, rel, root)
            return None
    if v2_rel is None or v2_rel == "/":
        return None
    pure = os.path.exists(os.path.join(cgroup_root, "cgroup.controllers"))
    root = cgroup_root if pure else os.path.join(cgroup_root, "unified")
    path = os.path.join(root, v2_rel.lstrip("/"))
    try:
        enabled = read_text(os.path.join(path, "cgroup.controllers")).split()
    except OSError:
        return None
    return Cgroup(2, path, v2_rel, root) if "cpuset" in enabled else None


def _write_cpus(path: str, cpus: frozenset[int]) -> None:
    with open(path, "w") as f:
        f.write(format_cpus(cpus) + "\n")


def ancestors(cg: Cgroup) -> list[Cgroup]:
    """The cgroup's ancestors below the hierarchy's root, outermost first."""
    out: list[Cgroup] = []
    rel = os.path.dirname(cg.rel.rstrip("/"))
    while rel not in ("/", ""):
        out.append(cg._replace(path=os.path.join(cg.root, rel.lstrip("/")), rel=rel))
        rel = os.path.dirname(rel)
    return out[::-1]


def widen_ancestors(cg: Cgroup, cpus: frozenset[int]) -> list[str]:
    """Add ``cpus`` to every ancestor that lacks them, outermost first; what was widened.

    v1 checks each write against the parent, hence the order.  A v2 ancestor with an empty
    ``cpuset.cpus`` inherits its parent's and is left as it is.
    """
    done: list[str] = []
    for up in ancestors(cg):
        try:
            have = parse_cpus(read_text(up.cpus_file))
        except OSError as err:
            raise GuestError(f"reading {up.cpus_file}: {errno_text(err)}", False) from None
        if (cg.version == 2 and not have) or cpus <= have:
            continue
        wider = have | cpus
        try:
            _write_cpus(up.cpus_file, wider)
        except OSError as err:
            raise GuestError(
                f"widening {up.cpus_file} to {format_cpus(wider)}: {errno_text(err)}", False
            ) from None
        done.append(f"{up.cpus_file} {format_cpus(have)} -> {format_cpus(wider)}")
    return done


def _parent_lacks(cg: Cgroup, cpus: frozenset[int]) -> tuple[Cgroup, frozenset[int]] | None:
    """v1 only: the parent and its CPUs when they do not include ``cpus``, else None."""
    parents = ancestors(cg)
    if cg.version != 1 or not parents:
        return None
    try:
        have = parse_cpus(read_text(parents[-1].cpus_file))
    except (OSError, GuestError):
        return None
    return None if cpus <= have else (parents[-1], have)


def pin_cgroup(cg: Cgroup, cpus: frozenset[int], widen_parents: bool) -> list[str]:
    """Set the cgroup's ``cpuset.cpus`` and check the effective set; notes for the report."""
    notes: list[str] = []
    want = format_cpus(cpus)
    try:
        _write_cpus(cg.cpus_file, cpus)
    except OSError as err:
        # cgroup v1 answers EACCES (not EINVAL) when a child would exceed its parent.
        lacks = _parent_lacks(cg, cpus) if err.errno in (errno.EACCES, errno.EPERM) else None
        if lacks is None:
            raise GuestError(f"cannot set {cg.cpus_file} to {want}: {errno_text(err)}") from None
        parent, have = lacks
        if not widen_parents:
            raise GuestError(
                f"cannot set {cg.cpus_file} to {want}: cgroup v1 keeps a child within its "
                f"parent, and {parent.cpus_file} is {format_cpus(have) or '(empty)'}; "
                "not widened (--widen-parents would)",
                fallback=False,
            ) from None
        notes += ["widened " + w for w in widen_ancestors(cg, cpus)]
        try:
            _write_cpus(cg.cpus_file, cpus)
        except OSError as err2:
            raise GuestError(
                f"cannot set {cg.cpus_file} to {want} even after widening its "
                f"parents: {errno_text(err2)}",
                fallback=False,
            ) from None
    effective = read_effective(cg)
    if effective != cpus:
        # v2 accepts any list and intersects it with the parent's: say who narrowed it.
        raise GuestError(
            f"{cg.cpus_file} set to {want}, but the kernel gives "
            f"{format_cpus(effective) or '(none)'} (an ancestor's cpuset lacks "
            "CPUs; not widened)",
            fallback=False,
        )
    return notes


def read_effective(cg: Cgroup) -> frozenset[int]:
    """The CPUs the cgroup's tasks may use (asked for, within every ancestor's)."""
    # v1 before Linux 3.16 has no effective_cpus: there, what was written is what holds.
    for name in (cg.effective_file, cg.cpus_file):
        try:
            return parse_cpus(read_text(name))
        except FileNotFoundError:
            continue
        except OSError as err:
            raise GuestError(f"reading back {name}: {errno_text(err)}") from None
    raise GuestError(f"{cg.path} has no cpuset files any more (container removed?)")


def cgroup_tasks(cg: Cgroup) -> list[int]:
    try:
        return sorted({int(t) for t in read_text(cg.tasks_file).split()})
    except OSError as err:
        raise GuestError(f"reading {cg.tasks_file}: {errno_text(err)}") from None
