"""What every part of the guest program shares: its one error, CPU lists, two file helpers.

Every failure inside the guest ends as one line on stderr (the hook is fail-open, the
follower keeps following), so the guest has one exception of its own whose ``str()`` *is*
that line; the host's errors (:mod:`vmpin.core.errors`) are translated into it where they
come in.  CPU lists follow the host's rules (:mod:`vmpin.core.cpuset`): a list the host
publishes parses here exactly as it was written there.
"""

from __future__ import annotations

import errno

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError


class GuestError(Exception):
    """One failure of the hook; ``str()`` is the line printed on stderr.

    ``fallback`` says whether pinning threads' affinity is still worth a try after a cgroup
    write failed (not when the cgroup's parent excludes the CPUs: affinity cannot reach
    them either, and a half-applied affinity would only mislead).
    """

    def __init__(self, message: str, fallback: bool = True) -> None:
        super().__init__(message)
        self.fallback = fallback


# -- CPU lists (the Linux list format: "0-3,8"): vmpin.core.cpuset's rules -------------------
def parse_cpus(text: str) -> frozenset[int]:
    """Parse a Linux CPU list strictly (the host's parser): "" is empty, "0,", "3-0" are errors."""
    try:
        return frozenset(CpuSet.parse(text))
    except CpuSetError as err:
        raise GuestError(str(err)) from None


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """The Linux list format, ranges collapsed: {0, 1, 2, 5} -> "0-2,5"."""
    return CpuSet(cpus).to_list()


# -- files -------------------------------------------------------------------------------------
def read_text(path: str) -> str:
    """A small kernel or state file as text (undecodable bytes replaced)."""
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def errno_text(err: OSError) -> str:
    """``EACCES (Permission denied)``: the errno's name, which a report line keeps."""
    return f"{errno.errorcode.get(err.errno or 0, '?')} ({err.strerror})"
