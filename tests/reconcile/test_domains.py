"""vmpin.reconcile.domains without libvirt-python: one warning, no domains, nothing fails."""

from __future__ import annotations

import logging
import sys

import pytest

import vmpin.runtimes
from vmpin.linux.paths import HostPaths
from vmpin.reconcile import domains
from vmpin.reconcile.reconciler import Reconciler


def test_without_the_extra_domains_are_skipped_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, paths: HostPaths
) -> None:
    # as if libvirt-python were not installed: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "libvirt", None)
    monkeypatch.delitem(sys.modules, "vmpin.runtimes.libvirt", raising=False)
    monkeypatch.delattr(vmpin.runtimes, "libvirt", raising=False)  # set by an earlier import
    monkeypatch.setattr(domains, "_warned", [])
    source = domains.LibvirtDomains(paths, ["test:///default"])
    rc = Reconciler(paths, domains=source)
    with caplog.at_level(logging.WARNING, logger="vmpin.libvirt"):
        assert rc.reconcile(apply=False) == []
        assert rc.audit()["ok"] is True
        source.begin_pass()
        assert source.observe() == []
    said = [r for r in caplog.records if "libvirt domains are not handled" in r.getMessage()]
    assert len(said) == 1
    assert "vmpin[libvirt]" in said[0].getMessage()


def test_test_driver_domain_is_an_error_against_it_not_the_node(paths: HostPaths) -> None:
    """libvirt's daemonless test driver has a running domain but no QEMU behind it: that is one
    error line against that connection's domain; the pass and the audit go on."""
    pytest.importorskip("libvirt")
    source = domains.LibvirtDomains(paths, ["test:///default"])
    rc = Reconciler(paths, domains=source)
    reports = rc.reconcile(apply=False)
    assert [r.id for r in reports] == ["libvirt"]
    (err,) = reports[0].errors
    assert err.startswith("domain test:")
    audit = rc.audit()
    assert audit["errors"] == [f"libvirt: {err}"]
