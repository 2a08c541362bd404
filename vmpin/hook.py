"""``vmpin hook STAGE``: the OCI hook, on the hot path of every container start.

What it does: parse the state on stdin (and the bundle's config.json at create), record or
forget the container in the store, then bring its sandbox into line -- by handing the sandbox
to the running agent over its control socket, or, when no agent answers, by one in-process
reconcile of that sandbox only.

Fail-open: a container must never fail to start because of vmpin, so any problem prints one
line to stderr and exits 0; ``--strict`` makes it exit 1 (the runtime then fails the start).

Kata's quirks (FACTS.md), and how each is handled:

- ``ociVersion``/``status`` may be empty: not required.
- For poststart and poststop the state's ``id`` is the *sandbox* id: the container is found
  by its bundle (recorded at create), never by that id; when it was not recorded, its id is
  taken from the bundle path (containerd and CRI-O name the bundle dir after the container).
- The state's pid is the VMM's (or the shim's thread id) for Kata, the container's init for
  runc: it is stored as the container's pid only for plain containers, and for Kata only
  used as a hint when looking for the VMM.

Lean by rule (see the import-linter contract in pyproject.toml): json, sqlite3 and the
project's small modules; no typer, pydantic, psutil, kubernetes or dataclasses.
"""

from __future__ import annotations

import os
import sys

from vmpin.errors import IdError, SpecError, VmpinError
from vmpin.ids import check_id
from vmpin.oci import STAGES, Identity, State, identify, parse_state, read_config
from vmpin.paths import HostPaths
from vmpin.store import ContainerRec, SandboxRec, Store

CREATE_STAGES = ("prestart", "createRuntime", "createContainer")
HOST_PID_STAGES = ("prestart", "createRuntime", "poststart")

USAGE = "usage: vmpin hook [--strict] STAGE   (STAGE: " + ", ".join(STAGES) + "; state on stdin)"


def main(opts: dict[str, str], args: list[str]) -> int:
    strict = "--strict" in args
    rest = [a for a in args if a != "--strict"]
    stage = rest[0] if rest else ""
    try:
        if len(rest) != 1 or stage not in STAGES:
            raise SpecError(f"bad stage {stage!r}: {USAGE}")
        paths = HostPaths.from_env(opts)
        if sys.stdin is None or sys.stdin.isatty():
            raise SpecError("no OCI state on stdin")
        data = sys.stdin.buffer.read()
        run(paths, stage, data)
        return 0
    except VmpinError as err:
        print(f"vmpin hook {stage or '?'}: {err}", file=sys.stderr)
    except Exception as err:  # fail-open means *any* failure, not only the foreseen ones
        print(f"vmpin hook {stage or '?'}: unexpected {type(err).__name__}: {err}", file=sys.stderr)
    return 1 if strict else 0


def run(paths: HostPaths, stage: str, data: bytes) -> str | None:
    """Handle one hook invocation; returns the sandbox id it touched (None when nothing)."""
    state = parse_state(data, f"hook {stage}: state")
    with Store(paths.state_dir) as store:
        if stage == "poststop":
            sandbox = forget(store, state)
        else:
            sandbox = record(paths, store, stage, state)
        if sandbox is not None:
            sync(paths, store, [sandbox])
        return sandbox


def container_id_from_bundle(bundle: str) -> str | None:
    """containerd: .../<ns>/<id>; CRI-O: .../overlay-containers/<id>/userdata."""
    if not bundle:
        return None
    path = bundle.rstrip("/")
    base = os.path.basename(path)
    if base == "userdata":
        base = os.path.basename(os.path.dirname(path))
    try:
        return check_id(base)
    except IdError:
        return None


def _identity(state: State, annotations: dict[str, str]) -> Identity:
    ident = identify(state.id, annotations)
    if not ident.is_sandbox and ident.sandbox_id == state.id:
        # Kata's poststart/poststop: the id is the sandbox's; the bundle names the container.
        cid = container_id_from_bundle(state.bundle)
        if cid is None or cid == state.id:
            raise SpecError(
                f"state id {state.id!r} is the sandbox id and bundle {state.bundle!r} names no"
                " container: cannot tell which container this is"
            )
        ident = identify(cid, annotations)
    return ident


def _detect_runtime(paths: HostPaths, sandbox_id: str, hint_pid: int | None) -> str:
    """Kata when the sandbox has a VM dir or the state pid is its QEMU; plain otherwise."""
    if os.path.isdir(os.path.join(paths.vm_dir, sandbox_id)):
        return "kata"
    if hint_pid:
        from vmpin import vmm

        if vmm.is_vmm_of(paths, hint_pid, sandbox_id):
            return "kata"
    return "runc"


def record(paths: HostPaths, store: Store, stage: str, state: State) -> str | None:
    """Record a container at its first create stage; later stages only re-check its sandbox."""
    existing = store.container_by_bundle(state.bundle) if state.bundle else None
    if existing is None and stage in CREATE_STAGES:
        existing = store.container(state.id)
    # Only prestart and createRuntime run in the host's pid namespace: createContainer and
    # startContainer see the container's own (pid 1), and Kata's pid is the VMM's.
    host_pid = state.pid if stage in HOST_PID_STAGES else None
    if existing is not None:
        if host_pid and existing.pid is None and _runtime_of(store, existing) == "runc":
            pid_start = _start_time(paths, host_pid)
            store.put_container(existing._replace(pid=host_pid, pid_start=pid_start))
        return existing.sandbox_id
    if not state.bundle:
        raise SpecError(f"hook {stage}: state has no bundle")
    config = read_config(state.bundle)
    annotations = {**config.annotations, **state.annotations}
    ident = _identity(state, annotations)
    sandbox = store.sandbox(ident.sandbox_id)
    runtime = sandbox.runtime if sandbox else _detect_runtime(paths, ident.sandbox_id, host_pid)
    pid = host_pid if runtime == "runc" else None
    if sandbox is None:
        # For Kata the state pid may be the VMM: kept as an unverified hint (no start time).
        hint = host_pid if runtime == "kata" else None
        store.put_sandbox(
            SandboxRec(
                ident.sandbox_id,
                runtime,
                hint,
                None,
                ident.pod_uid,
                ident.pod_name,
                ident.pod_namespace,
            )
        )
    store.put_container(
        ContainerRec(
            id=ident.container_id,
            sandbox_id=ident.sandbox_id,
            is_sandbox=ident.is_sandbox,
            name=ident.name,
            pod_uid=ident.pod_uid,
            pod_name=ident.pod_name,
            pod_namespace=ident.pod_namespace,
            cpus=config.resources.cpus,
            cpus_source="spec",
            mems=config.resources.mems,
            bundle=state.bundle,
            pid=pid,
            pid_start=_start_time(paths, pid) if pid else None,
        )
    )
    return ident.sandbox_id


def _runtime_of(store: Store, rec: ContainerRec) -> str | None:
    sandbox = store.sandbox(rec.sandbox_id)
    return sandbox.runtime if sandbox else None


def _start_time(paths: HostPaths, pid: int) -> int | None:
    from vmpin import procfs

    try:
        return procfs.start_time(paths.proc, pid)
    except VmpinError:
        return None


def forget(store: Store, state: State) -> str | None:
    """poststop: find the container by bundle (Kata sends the sandbox id), then forget it."""
    rec = store.container_by_bundle(state.bundle) if state.bundle else None
    if rec is None:
        candidate = store.container(state.id)
        # By id only when the id is the container's own: a Kata poststop of a non-sandbox
        # container carries the sandbox id, and must not tear the whole sandbox down.
        ident = identify(state.id, state.annotations) if state.annotations else None
        if candidate is not None and (ident is None or ident.is_sandbox == candidate.is_sandbox):
            rec = candidate
    if rec is None:
        return None
    store.delete_container(rec.id)
    return None if rec.is_sandbox else rec.sandbox_id


def sync(paths: HostPaths, store: Store, sandbox_ids: list[str]) -> None:
    """Hand the sandboxes to the agent, or reconcile them here when no agent answers."""
    from vmpin.control import notify

    if notify(paths, sandbox_ids):
        return
    from vmpin.reconciler import Reconciler
    from vmpin.settings import guest_float, policy_from

    rec = Reconciler(
        paths, store, policy=policy_from(), float_policy=guest_float(), qmp_timeout=0.1
    )
    for report in rec.reconcile(sandbox_ids):
        for err in report.errors:
            print(f"vmpin: sandbox {report.id}: {err}", file=sys.stderr)
