"""A Kata sandbox as containerd runs it: no vmpin hook for the pod sandbox (pause) container.

containerd never applies ``base_runtime_spec`` to the sandbox container (seen on containerd
1.6, tests/e2e/test_containerd.py), so the first hook vmpin sees for a Kata pod is the first
app container's.  vmpin learns the sandbox from it: the sandbox id from the CRI annotations,
the runtime from the VM dir ``<vm dir>/<sandbox id>`` that Kata made, the VMM from its
pidfile.  Real QEMU started as Kata starts it; the hooks are run the way Kata's shim runs
them (poststart with the sandbox id).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.test_e2e_kata import (  # noqa: F401  (qemu, kata: fixtures)
    Kata,
    affinities,
    kata,
    qemu,
    sid,
)
from tests.support.qemu_util import QemuHandle

pytestmark = [pytest.mark.qemu, pytest.mark.multi_cpu]


def test_sandbox_learned_from_first_app_container_without_pause_hook(
    qemu: Callable[..., QemuHandle], kata: Kata  # noqa: F811
) -> None:
    q = qemu(sid("ctdkata"), smp=2)
    # no hook ran for the pause container: vmpin has recorded nothing yet
    assert not (Path(kata.env["VMPIN_STATE_DIR"]) / "state.db").exists()
    kata.create_container(q, "app1", "1")
    sandboxes = json.loads(kata.vmpin("sandboxes", "--json").stdout)
    assert [(s["id"], s["runtime"], s["vmm_pid"], s["mask"]) for s in sandboxes] == [
        (q.sandbox_id, "kata", q.pid, "1")
    ]
    assert set(affinities(q.pid).values()) == {"1"}, affinities(q.pid)
    assert kata.vmpin("audit", "--json").returncode == 0

    kata.create_container(q, "app2", "0")  # the mask is the union of the app containers
    assert kata.show(q.sandbox_id)["mask"] == "0-1"
    used = {c for v in affinities(q.pid).values() for c in v.replace("-", ",").split(",")}
    assert used == {"0", "1"}, affinities(q.pid)  # every thread inside the new mask
    assert kata.vmpin("audit", "--json").returncode == 0
