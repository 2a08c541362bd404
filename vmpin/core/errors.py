"""The one error tree of vmpin.

Every failure vmpin reports to a user is a ``VmpinError``; the CLI turns it into one line on
stderr and an exit code, nothing below the CLI exits the process::

    VmpinError
    +-- CpuSetError        a CPU list or mask that does not parse, or names impossible CPUs
    +-- SpecError          OCI state / config.json / resources JSON that is malformed
    |   +-- UnsafeFile         a file others can write that is a symlink, FIFO, device or huge
    |                          (vmpin.linux.files)
    +-- IdError            an id that could name a path outside the state dir
    +-- WireError          a document in one of vmpin's wire formats that is malformed
    |                      (vmpin.wire.errors)
    +-- TopologyError      a sysfs tree that cannot describe the host (vmpin.core.topology)
    +-- PlanError          a placement that cannot be made, e.g. CPUs offline (vmpin.core.planner)
    +-- StateError         the SQLite store: unknown container, schema too new
    +-- HostError          the host refused or changed under us
    |   +-- ProcessGone        a pid/tid exited (or was reused) mid-pass: expected, skip it
    |   +-- PermissionDenied   EPERM/EACCES on an affinity or cgroup write
    |   +-- AffinityRejected   EINVAL: the kernel refused the mask (cpuset cgroup, offline)
    |                          (vmpin.linux.affinity)
    +-- RuntimeKindError   a runtime adapter failed (vmpin.runtimes.errors)
        +-- QmpError           (vmpin.runtimes.qmp)
        +-- LibvirtError       (vmpin.runtimes.libvirt)
        +-- KubeError          the kubelet checkpoint or the API (vmpin.runtimes.kubelet)

This module holds the classes that several layers raise; a class that one layer alone
raises lives in that layer, in the module named above (the one that raises it, or the
layer's ``errors`` module when several of its modules do), so that a process that never
reaches that layer -- the hook at every container start, ``vmpin update`` -- does not create
it: each class created is ~0.1 M instructions (of the nine that moved, the runc hook now
creates one and ``vmpin update`` none: ~0.9 M of each one's ~45 M, a bare interpreter
~39 M).  Catch one by importing it from there.
"""

from __future__ import annotations


class VmpinError(Exception):
    """Base of every error vmpin reports; ``str()`` is the one line a user sees."""

    exit_code = 2


class CpuSetError(VmpinError, ValueError):
    pass


class SpecError(VmpinError, ValueError):
    pass


class IdError(VmpinError, ValueError):
    pass


class StateError(VmpinError):
    pass


class HostError(VmpinError):
    pass


class ProcessGone(HostError):
    """A process or thread exited, or its pid now names another process."""


class PermissionDenied(HostError):
    pass
