"""The --json views (vmpin.wire.views): their bytes, pinned; each view is its declaration."""

from __future__ import annotations

import inspect

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.reconcile.report import SandboxReport, ThreadReport
from vmpin.service.commands_read import show_json
from vmpin.wire import jsonio, views
from vmpin.wire.viewschema import check, model


def printed(data: object) -> str:
    """As vmpin.service.commands.emit prints a view."""
    return jsonio.dumps(data, indent=2)


def test_a_container_row_prints_as_before() -> None:
    row = views.container(
        id="c1", sandbox="s1", name="app", cpus="0-1", runtime="kata", is_sandbox=False,
        pod_uid="u", pod_name="p", pod_namespace="ns", cpus_source="oci", pid=7,
        stored_cpus="0", host_differs=True, gone=False,
    )  # fmt: skip
    check("containers", [row])
    assert printed([row]) == """[
  {
    "id": "c1",
    "sandbox": "s1",
    "name": "app",
    "cpus": "0-1",
    "runtime": "kata",
    "is_sandbox": false,
    "pod_uid": "u",
    "pod_name": "p",
    "pod_namespace": "ns",
    "cpus_source": "oci",
    "pid": 7,
    "stored_cpus": "0",
    "host_differs": true,
    "gone": false
  }
]"""


def test_a_sandbox_row_prints_as_before() -> None:
    row = views.sandbox(
        id="s1", runtime="kata", vmm_pid=42, mask="0-1",
        containers=[views.sandbox_container(id="s1", name="pause", cpus=None, is_sandbox=True)],
        pod_uid=None, pod_name="p", pod_namespace="ns", dirty=False, mode="1:1",
        stored_mask="0-1", host_differs=False, vanished=False,
    )  # fmt: skip
    check("sandboxes", [row])
    assert printed(row) == """{
  "id": "s1",
  "runtime": "kata",
  "vmm_pid": 42,
  "mask": "0-1",
  "containers": [
    {
      "id": "s1",
      "name": "pause",
      "cpus": null,
      "is_sandbox": true
    }
  ],
  "pod_uid": null,
  "pod_name": "p",
  "pod_namespace": "ns",
  "dirty": false,
  "mode": "1:1",
  "stored_mask": "0-1",
  "host_differs": false,
  "vanished": false
}"""


def test_show_prints_as_before() -> None:
    r = SandboxReport("s1", "kata", 42)
    r.mask, r.mode, r.reason = CpuSet.parse("0-1"), "1:1", "2 vCPUs on 2 CPUs"
    r.threads.append(ThreadReport(43, "vcpu", 0, "CPU 0/KVM", CpuSet.parse("0"),
                                  CpuSet.parse("0-1")))  # fmt: skip
    out = show_json(r)
    check("show", out)
    assert printed(out) == """{
  "id": "s1",
  "runtime": "kata",
  "vmm_pid": 42,
  "mask": "0-1",
  "mode": "1:1",
  "reason": "2 vCPUs on 2 CPUs",
  "layers": [],
  "threads": [
    {
      "tid": 43,
      "role": "vcpu",
      "index": 0,
      "name": "CPU 0/KVM",
      "desired": "0",
      "actual": "0-1",
      "layer": "",
      "container": null,
      "action": "ok",
      "error": null
    }
  ],
  "guest_map": null,
  "policy": null,
  "containers": [],
  "notes": [],
  "errors": []
}"""


def test_update_prints_as_before() -> None:
    out = views.update(id="c1", sandbox="s1", cpus="3", applied_by="re-pinned")
    check("update", out)
    assert printed(out) == (
        '{\n  "id": "c1",\n  "sandbox": "s1",\n  "cpus": "3",\n  "applied_by": "re-pinned"\n}'
    )


@pytest.mark.parametrize("view", sorted({v for v, _ in views.VIEWS.values()}
                                        | {getattr(views, n) for n in ("sandbox_container",
                                           "thread", "policy", "topology_cpu", "claim",
                                           "violation")}, key=lambda v: v.__name__))  # fmt: skip
def test_a_view_is_its_parameters(view: object) -> None:
    """A view returns its parameters and nothing else (a local would be printed), and its
    model has every key but the EXTRA ones."""
    code = view.__code__  # type: ignore[attr-defined]
    assert code.co_argcount == 0 and code.co_nlocals == code.co_kwonlyargcount
    keys = list(inspect.signature(view).parameters)  # type: ignore[arg-type]
    extra = views.EXTRA.get(view.__name__, ())  # type: ignore[attr-defined]
    assert set(extra) <= set(keys)
    assert list(model(view).model_fields) == [k for k in keys if k not in extra]


def test_a_violation_prints_its_kinds_keys_only_when_given() -> None:
    """Keys defaulting to views.ABSENT are printed only when given: a drift has no
    ``claimants``, a conflict has them after the common keys."""
    common = dict(sandbox="s1", tid=None, role=None, index=None, desired=None, actual="1",
                  container=None, reason="r")  # fmt: skip
    drift = views.violation(kind="drift", **common)  # type: ignore[arg-type]
    assert list(drift) == ["kind", "sandbox", "tid", "role", "index", "desired", "actual",
                           "container", "reason"]  # fmt: skip
    claim = views.claim(sandbox="s1", pod="p", container="c", source="kubelet")
    conflict = views.violation(kind="conflict", claimants=[claim, claim], **common)  # type: ignore[arg-type]
    check("audit", views.audit(ok=False, violations=[drift, conflict], sandboxes=1, threads=0,
                               errors=[]))  # fmt: skip
    assert list(conflict)[-2:] == ["reason", "claimants"]
    assert printed(views.explain(cpu={"cpu": 1})) == '{\n  "cpu": {\n    "cpu": 1\n  }\n}'
