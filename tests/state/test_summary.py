"""The node summary's rules, as a table: what a plain container may do beside VMs without the
node being re-planned (vmpin.state.summary), and the file that carries them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pytest_mock import MockerFixture

from vmpin.core.cpuset import CpuSet
from vmpin.state import summary
from vmpin.state.summary import Summary
from vmpin.wire.hookevent import HookEvent, Identity


def _s(**kw: object) -> Summary:
    base: dict[str, object] = {
        "vms": ("vm1",), "checkpoint": "-", "online": "0-7", "pool": CpuSet.parse("0-3"),
        "private": CpuSet.parse("6-7"), "contended": CpuSet.parse("5"),
        "claimed": CpuSet.parse("4-7"), "isolate": CpuSet(), "shared": CpuSet(),
    }  # fmt: skip
    base.update(kw)
    return Summary(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cpus", "infra", "kw", "why"),
    [
        ("0-3", False, {}, None),  # the shared pool
        ("1", False, {}, None),
        ("5", False, {}, "claimed by a VM's pod"),  # another pod's own CPU, outside the pool
        ("6", False, {}, "a VM's own"),  # a CPU a vCPU may have to itself
        (None, False, {}, "a VM's own"),  # no set: its cgroup's parent's, any CPU
        ("5", True, {}, None),  # an infra container's set claims nothing
        ("6", True, {}, "a VM's own"),  # ... but its threads still run there
        ("5", False, {"pool": None}, None),  # no pool, no claims (plan._claims)
        ("2", False, {"pool": None, "isolate": CpuSet.parse("2")}, "helper threads"),
        ("2", False, {"pool": None, "isolate": CpuSet.parse("2"), "shared": CpuSet.parse("2")},
         None),
    ],
)
def test_what_a_new_container_may_do(
    cpus: str | None, infra: bool, kw: dict[str, object], why: str | None
) -> None:
    got = summary.needs_pass(_s(**kw), None if cpus is None else CpuSet.parse(cpus), infra)
    assert (got is None) if why is None else (got is not None and why in got), got


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        ("0-3", "0-1", None),
        ("5", "0-3", "a VM's own"),  # gives up a CPU one VM shares with it alone
        ("0-3", "6", "a VM's own"),
        (None, "1", None),
    ],
)
def test_what_an_update_may_do(old: str | None, new: str, why: str | None) -> None:
    got = summary.change_needs_pass(
        _s(), None if old is None else CpuSet.parse(old), CpuSet.parse(new), False
    )
    assert (got is None) if why is None else (got is not None and why in got), got


def test_events_are_judged_by_stage() -> None:
    ident = Identity("c", "p", False, name="c")
    s = _s()
    create = HookEvent("createRuntime", "c", "/b", {}, ident=ident, cpus=CpuSet.parse("0-3"),
                       runtime="runc")  # fmt: skip
    assert summary.event_needs_pass(s, create) is None
    assert summary.event_needs_pass(s, create._replace(runtime="kata"))
    assert summary.event_needs_pass(s, create._replace(ident=None))
    gone = create._replace(stage="poststop")
    assert summary.event_needs_pass(s, gone) is None
    # contended: may be the VM's
    assert summary.event_needs_pass(s, gone._replace(cpus=CpuSet.parse("5")))
    assert summary.event_needs_pass(s, gone._replace(cpus=None))  # unknown: any CPU


def test_the_file_round_trips_and_anything_else_is_no_summary(tmp_path: Path) -> None:
    s = _s()
    assert summary.parse(summary.to_text(s)) == s
    assert summary.parse(summary.to_text(_s(pool=None, vms=()))) == _s(pool=None, vms=())
    summary.write(str(tmp_path), s)
    got = summary.read(str(tmp_path))
    assert got is not None and got[1] == s and summary.current(str(tmp_path), got[0])
    for text in ("", "vmpin node summary 2\n", summary.to_text(s).replace("private", "x"),
                 summary.to_text(s).replace("6-7", "7-6")):  # fmt: skip
        assert summary.parse(text) is None, text
    Path(summary.path(str(tmp_path))).write_bytes(b"\xff\xfe")
    assert summary.read(str(tmp_path)) is None
    summary.remove(str(tmp_path))
    assert summary.read(str(tmp_path)) is None
    assert not summary.current(str(tmp_path), got[0])


def test_the_vm_dir_is_listed_again_once_it_changed(tmp_path: Path) -> None:
    """A pass's summary inputs take the VM dir's names from the last listing while the
    directory is that version (one stat), and list it again once an entry came or went."""
    import os
    import time

    from vmpin.linux.files import SETTLE_NS
    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.summarizer import Summarizer
    from vmpin.state.store import Store

    vm = tmp_path / "vm"
    (vm / "a").mkdir(parents=True)
    paths = HostPaths(state_dir=str(tmp_path / "state"), vm_dir=str(vm))
    with Store(paths.state_dir) as store:
        summarizer = Summarizer(paths, store)
        assert summarizer.inputs()[0] == ["a"]
        time.sleep(2 * SETTLE_NS / 1e9)  # (settled: kept from now on)
        listed = summarizer.inputs()[0]
        assert summarizer.inputs()[0] is listed  # the same version: not listed again
        (vm / "b").mkdir()
        assert summarizer.inputs()[0] == ["a", "b"]  # (even within the kernel's tick)
        os.rmdir(vm / "a")
        assert summarizer.inputs()[0] == ["b"]


def test_a_pass_writes_the_summary_once_per_change(tmp_path: Path, mocker: MockerFixture) -> None:
    """The summary is written when its text changes (made once, compared, then written: not
    made again by the write), and not rewritten while it stands."""
    from vmpin.linux.paths import HostPaths
    from vmpin.reconcile.summarizer import Summarizer
    from vmpin.state.store import Store

    one, two = _s(), _s(private=CpuSet.parse("7"))
    made = mocker.patch.object(Summarizer, "_summary", return_value=one)
    saved = mocker.spy(summary, "save_cache")
    texts = mocker.spy(summary, "to_text")
    paths = HostPaths(state_dir=str(tmp_path / "state"), vm_dir=str(tmp_path / "vm"))
    plan: Any = object()  # (what the summary is made of is _summary's: patched)
    with Store(paths.state_dir) as store:
        summarizer = Summarizer(paths, store)
        assert summarizer.write(plan, [], "-", "0-7")
        assert (saved.call_count, texts.call_count) == (1, 1)
        got = summary.read(paths.state_dir)
        assert got is not None and got[1] == one
        assert summarizer.write(plan, [], "-", "0-7")  # the same summary: not written again
        assert saved.call_count == 1 and summary.read(paths.state_dir) == got
        made.return_value = two
        assert summarizer.write(plan, [], "-", "0-7")  # a change is
        assert (saved.call_count, texts.call_count) == (2, 3)
        got = summary.read(paths.state_dir)
        assert got is not None and got[1] == two
