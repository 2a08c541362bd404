"""procfs translates OSError once: a task that exited is ProcessGone, a refusal is
PermissionDenied, anything else a HostError naming what was read."""

from __future__ import annotations

import errno
import os

import pytest

from vmpin.core.errors import HostError, PermissionDenied, ProcessGone
from vmpin.linux import procfs


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (errno.ENOENT, ProcessGone),
        (errno.ESRCH, ProcessGone),
        (errno.EACCES, PermissionDenied),
        (errno.EPERM, PermissionDenied),
        (errno.EIO, HostError),
        (errno.EMFILE, HostError),
    ],
)
def test_an_oserror_is_translated_by_its_errno(code: int, kind: type[HostError]) -> None:
    got = procfs._translate(OSError(code, os.strerror(code)), 7, None, "stat")
    assert type(got) is kind
    if kind is HostError:
        assert str(got) == f"pid 7: stat: {os.strerror(code)}"


def test_a_task_that_is_gone_reads_as_process_gone() -> None:
    with pytest.raises(ProcessGone, match=r"pid 4194305 is gone \(stat\)"):
        procfs.start_time("/proc", 4194305)  # (beyond PID_MAX_LIMIT: never a process)
