"""A real libvirtd for tests, and real domains on it (not a conftest: import what you use).

``libvirtd_uri`` (session-scoped fixture) makes sure virtlogd and libvirtd run: when they do
not already, it starts them by hand as FACTS.md says (``virtlogd -d``; ``libvirtd -d``; no
systemd here), and at the end stops exactly the pids it started (read from the pid files
they wrote, checked against their start time), never by name.  Daemons someone else started
are used and left alone.  Skips when libvirt-python or the daemons are not installed.

``domain_factory`` defines and starts real domains (KVM where /dev/kvm works, TCG otherwise
or when KVM refuses) with random names, ``<vcpu>`` >= 2 and ``<iothreads>``; each is destroyed
and undefined at the end even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.support.qemu_util import kvm_usable, wait_until
from tests.support.session import new_id

URI = "qemu:///system"
SOCKET = "/run/libvirt/libvirt-sock"
QEMU = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
#: the daemons and their pid files (libvirt's defaults for root).
DAEMONS = (("virtlogd", "/run/virtlogd.pid"), ("libvirtd", "/run/libvirtd.pid"))


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _running(pidfile: str, comm: str) -> int | None:
    """The pid in ``pidfile`` when that process is alive and is ``comm``."""
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/comm") as f:
            return pid if f.read().strip() == comm else None
    except (OSError, ValueError):
        return None


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def _stop(pid: int, start: int | None) -> None:
    if start is None or _start_time(pid) != start:
        return  # already gone, or the pid is someone else's now
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _start_time(pid) == start and time.monotonic() < deadline:
        time.sleep(0.05)
    if _start_time(pid) == start:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def libvirtd_uri() -> Iterator[str]:
    pytest.importorskip("libvirt")
    if os.geteuid() != 0:
        pytest.skip("libvirtd for qemu:///system needs root")
    for daemon, _ in DAEMONS:
        if shutil.which(daemon) is None:
            pytest.skip(f"{daemon} is not installed (apt-get install libvirt-daemon-system)")
    started: list[tuple[int, int | None]] = []
    try:
        for daemon, pidfile in DAEMONS:
            if _running(pidfile, daemon) is None:
                subprocess.run([daemon, "-d"], check=True, timeout=30)
                wait_until(lambda p=pidfile, d=daemon: _running(p, d) is not None, 10)  # type: ignore[misc]
                pid = _running(pidfile, daemon)
                assert pid is not None
                started.append((pid, _start_time(pid)))
        assert wait_until(lambda: _answers(SOCKET), 20), f"libvirtd does not answer on {SOCKET}"
        yield URI
    finally:
        for pid, start in reversed(started):
            _stop(pid, start)


def domain_xml(
    name: str,
    vcpus: int,
    iothreads: int,
    kvm: bool,
    mask: str | None = None,
    maxvcpus: int | None = None,
) -> str:
    # No kernel and no disk: the firmware spins briefly and idles, like the Kata-style QEMUs
    # of qemu_util.  No <cpu>: libvirt's default model avoids -cpu host's MSR 0x10a abort
    # under this nested KVM (FACTS.md).
    from vmpin.runtimes.libvirt import MASK_NS

    meta = (
        f"<metadata><vmpin:mask xmlns:vmpin='{MASK_NS}' cpus='{mask}'/></metadata>"
        if mask is not None
        else ""
    )
    return f"""<domain type='{"kvm" if kvm else "qemu"}'>
  <name>{name}</name>{meta}
  <memory unit='MiB'>128</memory>
  <vcpu placement='static' current='{vcpus}'>{maxvcpus or vcpus}</vcpu>
  <iothreads>{iothreads}</iothreads>
  <features><acpi/></features>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <devices><emulator>{QEMU}</emulator></devices>
</domain>"""


@dataclass
class DomainHandle:
    name: str
    uuid: str
    dom: object
    kvm: bool


@pytest.fixture
def domain_factory(libvirtd_uri: str) -> Iterator[Callable[..., DomainHandle]]:
    import libvirt

    conn = libvirt.open(libvirtd_uri)
    made: list[object] = []

    def make(
        vcpus: int = 2, iothreads: int = 1, mask: str | None = None, maxvcpus: int | None = None
    ) -> DomainHandle:
        name = new_id("vmpin-domain")  # names its creator, like every test id
        err: Exception | None = None
        for kvm in (True, False) if kvm_usable() else (False,):
            dom = conn.defineXML(domain_xml(name, vcpus, iothreads, kvm, mask, maxvcpus))
            made.append(dom)
            try:
                dom.create()
                return DomainHandle(name, dom.UUIDString(), dom, kvm)
            except libvirt.libvirtError as e:  # KVM refused: the same domain under TCG
                err = e
                dom.undefine()
                made.remove(dom)
        raise AssertionError(f"domain {name} does not start: {err}")

    try:
        yield make
    finally:
        for dom in made:
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()  # type: ignore[attr-defined]
            with contextlib.suppress(libvirt.libvirtError):
                dom.undefine()  # type: ignore[attr-defined]
        conn.close()
