"""journal.sweep_tmp never takes a live hook's temp file for a dead one.

Seen with 50 hooks at once (issue 30's concurrency test): the sweep read the clock, then
listed the journal; a hook that named its temp file in between had a stamp ahead of that
clock, read as "from an earlier boot", and its file was removed before its rename.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from vmpin.state import journal


def test_a_file_named_while_the_sweep_lists_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Path(journal.journal_dir(str(tmp_path)))
    d.mkdir(parents=True)
    real_listdir = os.listdir

    def listdir_while_a_hook_writes(path: str) -> list[str]:
        # another hook names and creates its temp file while this sweep is under way
        (d / f".{time.monotonic_ns():020d}-4242.json.tmp").write_bytes(b"{")
        return real_listdir(path)

    monkeypatch.setattr(journal.os, "listdir", listdir_while_a_hook_writes)
    assert journal.sweep_tmp(str(tmp_path)) == 0
    assert len(real_listdir(d)) == 1
    # a file of a hook killed long ago, or from an earlier boot, still goes
    (d / f".{time.monotonic_ns() - int(61e9):020d}-1.json.tmp").write_bytes(b"{")
    (d / f".{time.monotonic_ns() + int(3600e9):020d}-2.json.tmp").write_bytes(b"{")
    assert journal.sweep_tmp(str(tmp_path)) == 2
