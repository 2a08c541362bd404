"""The one error tree of vmpin.

Every failure vmpin reports to a user is a ``VmpinError``; the CLI turns it into one line on
stderr and an exit code, nothing below the CLI exits the process::

    VmpinError
    +-- CpuSetError        a CPU list or mask that does not parse, or names impossible CPUs
    +-- SpecError          OCI state / config.json / resources JSON that is malformed
    |   +-- UnsafeFile         a file others can write that is a symlink, FIFO, device or huge
    +-- IdError            an id that could name a path outside the state dir
    +-- WireError          a document in one of vmpin's wire formats that is malformed
    +-- TopologyError      a sysfs tree that cannot describe the host
    +-- PlanError          a placement that cannot be made (e.g. CPUs offline)
    +-- StateError         the SQLite store: unknown container, schema too new
    +-- HostError          the host refused or changed under us
    |   +-- ProcessGone        a pid/tid exited (or was reused) mid-pass: expected, skip it
    |   +-- PermissionDenied   EPERM/EACCES on an affinity or cgroup write
    |   +-- AffinityRejected   EINVAL: the kernel refused the mask (cpuset cgroup, offline)
    +-- RuntimeKindError   a runtime adapter failed
        +-- QmpError
        +-- LibvirtError
        +-- KubeError
"""

from __future__ import annotations


class VmpinError(Exception):
    """Base of every error vmpin reports; ``str()`` is the one line a user sees."""

    exit_code = 2


class CpuSetError(VmpinError, ValueError):
    pass


class SpecError(VmpinError, ValueError):
    pass


class UnsafeFile(SpecError):
    """A file others can write, refused unread (vmpin.linux.files): symlink, FIFO, device, huge."""


class WireError(VmpinError, ValueError):
    pass


class IdError(VmpinError, ValueError):
    pass


class TopologyError(VmpinError):
    pass


class PlanError(VmpinError):
    pass


class StateError(VmpinError):
    pass


class HostError(VmpinError):
    pass


class ProcessGone(HostError):
    """A process or thread exited, or its pid now names another process."""


class PermissionDenied(HostError):
    pass


class AffinityRejected(HostError):
    pass


class RuntimeKindError(VmpinError):
    pass


class QmpError(RuntimeKindError):
    pass


class LibvirtError(RuntimeKindError):
    pass


class KubeError(RuntimeKindError):
    pass
