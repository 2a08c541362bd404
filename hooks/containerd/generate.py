#!/usr/bin/env python3
"""Generate containerd's base runtime specs for vmpin: ``ctr oci spec`` plus vmpin's hooks.

The shipped ``base-runtime-spec-{runc,kata}.json`` are this script's output, never hand-edited
(``tests/runtimes/test_base_spec.py`` regenerates them and compares).  Run it with the
containerd version of the node: ``ctr oci spec`` prints containerd's own default Linux spec
(``oci.GenerateSpec``), and the CRI plugin starts every container of a handler that has a
``base_runtime_spec`` from that file instead of from that default.

Two edits, and only two, turn the default into a base spec that changes nothing else:

- ``process.rlimits``, ``process.apparmorProfile`` and ``linux.seccomp`` are removed.  Without
  a base spec the CRI plugin strips them from its default (containerd 1.6
  ``pkg/cri/opts/spec_linux.go`` ``WithoutDefaultSecuritySettings``: "Remove default rlimits");
  with one it keeps whatever the file says (``container_create_linux.go``: "only clear the
  default security settings if the runtime does not have a custom base runtime spec"), so a
  verbatim copy would impose ``ctr oci spec``'s RLIMIT_NOFILE 1024/1024 on every container.
- ``hooks`` is added: the create stage (runc: ``createRuntime``; Kata: ``prestart``, which
  Kata's shim runs at create), ``poststart`` and ``poststop``, each with an explicit ``env``:
  a hook entry without ``env`` inherits containerd's whole environment.

Usage::

    python3 hooks/containerd/generate.py                       # rewrite the shipped files
    python3 hooks/containerd/generate.py --runtime runc --vmpin /opt/venv/bin/vmpin \\
        --env VMPIN_STATE_DIR=/run/vmpin --out /etc/containerd/vmpin/base-runtime-spec-runc.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: the create stage per runtime handler (see docs/hooks.md, "Which stages")
CREATE_STAGE = {"runc": "createRuntime", "kata": "prestart"}
DEFAULT_VMPIN = "/usr/local/bin/vmpin"
#: hooks run with exactly this environment (plus --env): containerd's PATH default.
DEFAULT_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
TIMEOUT = 10


def ctr_default_spec(ctr: str = "ctr") -> dict[str, Any]:
    """``ctr oci spec``: containerd's default Linux spec, as this containerd builds it."""
    out = subprocess.run([ctr, "oci", "spec"], check=True, capture_output=True, text=True)
    spec: dict[str, Any] = json.loads(out.stdout)
    return spec


def base_spec(
    default: dict[str, Any],
    runtime: str,
    vmpin: str = DEFAULT_VMPIN,
    env: list[str] | None = None,
) -> dict[str, Any]:
    """``default`` with CRI's security defaults stripped and vmpin's hooks added."""
    spec = json.loads(json.dumps(default))  # a deep copy
    process = spec.get("process", {})
    process.pop("rlimits", None)
    process.pop("apparmorProfile", None)
    spec.get("linux", {}).pop("seccomp", None)
    hook_env = list(DEFAULT_ENV if env is None else env)
    spec["hooks"] = {
        stage: [
            {
                "path": vmpin,
                "args": ["vmpin", "hook", stage],
                "env": hook_env,
                "timeout": TIMEOUT,
            }
        ]
        for stage in (CREATE_STAGE[runtime], "poststart", "poststop")
    }
    return spec


def dump(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctr", default="ctr", help="the ctr binary (default: ctr on PATH)")
    ap.add_argument("--runtime", choices=sorted(CREATE_STAGE), help="one handler (with --out)")
    ap.add_argument("--out", help="write this file (default: the shipped files beside me)")
    ap.add_argument("--vmpin", default=DEFAULT_VMPIN, help="the vmpin executable hooks run")
    ap.add_argument(
        "--env", action="append", metavar="K=V", help="hook environment (default: PATH only)"
    )
    args = ap.parse_args(argv)
    env = None
    if args.env:
        env = [*DEFAULT_ENV, *args.env]
        bad = [e for e in env if "=" not in e]
        if bad:
            ap.error(f"--env {bad[0]!r}: expected K=V")
    default = ctr_default_spec(args.ctr)
    if args.out or args.runtime:
        if not (args.out and args.runtime):
            ap.error("--runtime and --out go together")
        targets = {args.runtime: args.out}
    else:
        targets = {rt: os.path.join(HERE, f"base-runtime-spec-{rt}.json") for rt in CREATE_STAGE}
    for runtime, out in targets.items():
        with open(out, "w") as f:
            f.write(dump(base_spec(default, runtime, args.vmpin, env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
