"""procfs translates OSError once: a task that exited is ProcessGone, a refusal is
PermissionDenied, anything else a HostError naming what was read."""

from __future__ import annotations

import errno
import os
from pathlib import Path

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


def test_kernel_release_is_unames() -> None:
    """The running kernel's release, as ``uname -r`` gives it (the real /proc)."""
    major, minor = os.uname().release.split(".")[:2]
    digits = minor[: len(minor) - len(minor.lstrip("0123456789"))]
    assert procfs.kernel_release("/proc") == (int(major), int(digits))


@pytest.mark.parametrize(
    ("text", "want"),
    [("6.1.0-18-amd64\n", (6, 1)), ("5.15.0-91-generic", (5, 15)), ("6.18rc1", (6, 18)),
     ("", None), ("6", None), ("x.y", None)],
)
def test_kernel_release_parsed_or_none(
    tmp_path: Path, text: str, want: tuple[int, int] | None
) -> None:
    root = tmp_path
    (root / "sys" / "kernel").mkdir(parents=True)
    (root / "sys" / "kernel" / "osrelease").write_text(text)
    assert procfs.kernel_release(str(root)) == want
    assert procfs.kernel_release(str(root / "missing")) is None
