"""How an engine is told to run vmpin's hook: the one home of every hook entry vmpin ships.

Two shapes carry the same OCI hook entry (``path``, ``args``, ``env``, ``timeout``):

- **hooks.d** (CRI-O, podman; oci-hooks(5), schema ``1.0.0``): one file per stage, because the
  stage is in ``args`` (the OCI state does not carry it); ``when: {always: true}``, since vmpin
  must see every container;
- **a base runtime spec** (containerd's CRI, per runtime handler): containerd's own default
  spec (``ctr oci spec``) with CRI's security defaults removed and a ``hooks`` section added,
  as ``hooks/containerd/generate.py`` explains.

``hooks/oci-hooks.d/*.json`` and ``hooks/containerd/base-runtime-spec-*.json`` are this
module's output with the defaults below (``hooks/containerd/generate.py`` writes them;
``tests/runtimes/test_base_spec.py`` regenerates and compares), and ``vmpin install`` writes
the same documents with the installed hook's path and environment: a change here reaches both.

``containerd-default-spec.json`` beside this module is ``ctr oci spec`` of containerd 1.6.20
(Debian 12's), re-indented: the default the shipped base specs are made from, and what
``vmpin install`` uses when it cannot run the node's own ``ctr``.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: the create stage per containerd runtime handler kind (docs/hooks.md, "Which stages"):
#: runc runs createRuntime at the same point as prestart; Kata's shim runs prestart at create.
CREATE_STAGE = {"runc": "createRuntime", "kata": "prestart"}
#: the stages of the hooks.d files: prestart is the create stage every engine runs (CRI-O,
#: podman; runtime-spec 1.2 deprecates it, but every version still runs it).
HOOKS_D_STAGES = ("prestart", "poststart", "poststop")
DEFAULT_VMPIN = "/usr/local/bin/vmpin"
#: hooks run with exactly this environment (plus what the installer adds): containerd's PATH
#: default.  runc gives a hook nothing else; Kata's shim gives an entry *without* env its own.
DEFAULT_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
#: seconds: a hung hook is killed by the runtime instead of holding up the start
TIMEOUT = 10
#: what containerd-default-spec.json was made with
PACKAGED_DEFAULT_FROM = "containerd 1.6.20 (ctr oci spec)"
PACKAGED_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "containerd-default-spec.json")  # fmt: skip


def hook_entry(
    stage: str, vmpin: str = DEFAULT_VMPIN, env: list[str] | None = None
) -> dict[str, Any]:
    """The OCI hook entry that runs ``vmpin hook STAGE``."""
    return {
        "path": vmpin,
        "args": ["vmpin", "hook", stage],
        "env": list(DEFAULT_ENV if env is None else env),
        "timeout": TIMEOUT,
    }


def hooks_d(vmpin: str = DEFAULT_VMPIN, env: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """The hooks.d files: file name -> document (one per stage)."""
    return {
        f"vmpin-{stage}.json": {
            "version": "1.0.0",
            "hook": hook_entry(stage, vmpin, env),
            "when": {"always": True},
            "stages": [stage],
        }
        for stage in HOOKS_D_STAGES
    }


def base_spec(
    default: dict[str, Any], runtime: str, vmpin: str = DEFAULT_VMPIN, env: list[str] | None = None
) -> dict[str, Any]:
    """``default`` (``ctr oci spec``) with CRI's security defaults stripped and vmpin's hooks.

    Without a base spec, containerd's CRI plugin strips rlimits, the AppArmor profile and
    seccomp from its default (1.6 ``WithoutDefaultSecuritySettings``); with one it keeps
    whatever the file says, so they are stripped here.  ``default`` is left alone.
    """
    spec: dict[str, Any] = json.loads(json.dumps(default))  # a deep copy
    process = spec.get("process", {})
    process.pop("rlimits", None)
    process.pop("apparmorProfile", None)
    spec.get("linux", {}).pop("seccomp", None)
    spec["hooks"] = {
        stage: [hook_entry(stage, vmpin, env)]
        for stage in (CREATE_STAGE[runtime], "poststart", "poststop")
    }
    return spec


def packaged_default() -> dict[str, Any]:
    """containerd-default-spec.json: ``ctr oci spec`` of :data:`PACKAGED_DEFAULT_FROM`."""
    with open(PACKAGED_DEFAULT) as f:
        spec: dict[str, Any] = json.load(f)
    return spec


def dump(doc: dict[str, Any]) -> str:
    """How every shipped and installed document is written (stable: the installer compares)."""
    return json.dumps(doc, indent=2) + "\n"
