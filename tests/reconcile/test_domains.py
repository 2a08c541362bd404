"""vmpin.reconcile.domains at its edges: no libvirt-python (one warning, no domains, the node
goes on), and a domain that cannot be read (an error against it, never the node's)."""

from __future__ import annotations

import logging
import sys

import pytest

import vmpin.runtimes
from vmpin.core.planner import Policy
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
        assert rc.reconcile(apply=True) == []
        assert rc.audit()["ok"] is True
        assert source.sandboxes(lambda _sid: Policy()) == []
    said = [r for r in caplog.records if "libvirt domains are not handled" in r.getMessage()]
    assert len(said) == 1
    assert "vmpin[libvirt]" in said[0].getMessage()


def test_domain_without_qemu_is_an_error_against_it_not_the_node(paths: HostPaths) -> None:
    """libvirt's daemonless test driver runs a domain with no QEMU behind it (no monitor):
    one error naming that domain; the observation, plan and audit of the node go on."""
    pytest.importorskip("libvirt")
    source = domains.LibvirtDomains(paths, ["test:///default"])
    (obs,) = source.sandboxes(lambda _sid: Policy())
    assert obs.runtime == "libvirt" and obs.vmm is None
    (err,) = obs.errors
    assert err.startswith("domain test:")
    rc = Reconciler(paths, domains=source)
    plan = rc.plan()
    assert [sp.runtime for sp in plan.sandboxes] == ["libvirt"]
    # audit's kind "error": against that domain's connection, and nothing else
    violations = rc.audit()["violations"]
    assert [(v["kind"], v["sandbox"], v["reason"]) for v in violations] == [
        ("error", "libvirt:test:///default", err)
    ]
