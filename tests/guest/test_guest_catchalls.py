"""Fault injection into the guest side's catch-alls: the paths that keep a guest alive when
something nobody foresaw goes wrong.

- ``vmpin guest hook``: any unforeseen exception (not a GuestError) is one line on stderr and
  exit 0, so the container still starts (``--strict``: exit 1); nothing is pinned half-way.
- ``vmpin guest follow``: a pass that blows up is reported and the loop goes on; the next
  change is followed.

The fault is injected at the library edge (``os.sched_setaffinity`` raising an exception no
code path expects, standing in for a bug), and everything else is real: a multi-threaded
process, a published map, the kernel's Cpus_allowed_list.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_mock import MockerFixture

from tests.guest.test_guest import (
    allowed,
    in_root_cpuset,
    plain_process,
    record_of,
    republish,
    threads_of,
    wait_until,
    write_map,
)
from vmpin.guest import follower, hook
from vmpin.guest.options import parse_follow_args

pytestmark = pytest.mark.multi_cpu  # maps name CPU 1; the processes start on every CPU


class InjectedBug(Exception):
    """Not a GuestError, not an OSError: what the catch-all is for."""


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "guest-state"
    monkeypatch.setenv("VMPIN_GUEST_STATE", str(d))
    return d


@pytest.fixture
def proc() -> Iterator[int]:
    if not in_root_cpuset():
        pytest.fail("the affinity path needs this test process in the root cpuset")
    with plain_process() as (pid, _):
        yield pid


def run_hook(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], state: dict[str, Any],
    map_path: Path, *args: str,
) -> tuple[int, list[str]]:
    """``vmpin guest hook prestart ARGS`` in this process: (exit status, stderr lines)."""
    monkeypatch.setenv("VMPIN_GUEST_MAP", str(map_path))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(state).encode())))
    rc = hook.main(["prestart", *args])
    out, err = capsys.readouterr()
    assert out == ""
    return rc, err.splitlines()


def test_guest_hook_unforeseen_error_is_fail_open(
    tmp_path: Path, proc: int, state_dir: Path, mocker: MockerFixture,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    m = write_map(tmp_path / "map.json", {"c": "1"})
    before = {t: allowed(t) for t in threads_of(proc)}
    assert set(before.values()) == {"0-1"}
    mocker.patch("os.sched_setaffinity", side_effect=InjectedBug("injected: a bug"))

    rc, lines = run_hook(monkeypatch, capsys, {"id": "c", "pid": proc}, m)
    assert rc == 0
    assert lines == ["vmpin guest hook prestart: unexpected InjectedBug: injected: a bug"]
    rc, lines = run_hook(monkeypatch, capsys, {"id": "c", "pid": proc}, m, "--strict")
    assert rc == 1 and len(lines) == 1 and "unexpected InjectedBug" in lines[0]
    assert {t: allowed(t) for t in threads_of(proc)} == before  # nothing pinned half-way

    mocker.stopall()  # the same hook, without the fault, does its job
    rc, lines = run_hook(monkeypatch, capsys, {"id": "c", "pid": proc}, m)
    assert (rc, lines) == (0, [])
    assert {allowed(t) for t in threads_of(proc)} == {"1"}


def test_follower_outlives_a_pass_that_blows_up(
    tmp_path: Path, proc: int, state_dir: Path, mocker: MockerFixture,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """The loop runs here, in the main thread (it owns SIGTERM); a helper thread drives it."""
    m = write_map(tmp_path / "map.json", {"loop": "1"})
    rc, _ = run_hook(monkeypatch, capsys, {"id": "loop", "pid": proc}, m)
    assert rc == 0 and {allowed(t) for t in threads_of(proc)} == {"1"}

    real = os.sched_setaffinity
    calls = {"n": 0}

    def first_pass_blows_up(tid: int, cpus: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise InjectedBug("injected: a bug")
        real(tid, cpus)

    mocker.patch("os.sched_setaffinity", side_effect=first_pass_blows_up)
    said: list[str] = []
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            republish(m, "loop", "0")  # the first pass over it blows up ...
            assert wait_until(lambda: any("InjectedBug" in s for s in said), 20), said
            assert {allowed(t) for t in threads_of(proc)} == {"1"}
            republish(m, "loop", "0")  # ... and the loop, still alive, follows the next change
            assert wait_until(lambda: {allowed(t) for t in threads_of(proc)} == {"0"}, 20), said
            assert wait_until(lambda: record_of(state_dir, "loop")["guest_cpus"] == "0", 10)
        except BaseException as err:
            errors.append(err)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the follower's handler stops it

    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    opts = parse_follow_args(["--interval", "0.05"])
    opts = opts._replace(map_path=str(m), state_dir=str(state_dir))
    helper = threading.Thread(target=drive)
    helper.start()
    try:
        rc = follower.follow(opts, said.append)
    finally:
        helper.join(30)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    assert not errors, (errors, said)
    assert rc == 0
    failures = [s for s in said if "InjectedBug" in s]
    assert failures == ["unexpected InjectedBug: injected: a bug"], said
