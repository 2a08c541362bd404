#!/usr/bin/env python3
"""Generate vmpin's hook configs: containerd's base runtime specs and the hooks.d files.

The shipped ``base-runtime-spec-{runc,kata}.json`` beside this script and
``hooks/oci-hooks.d/vmpin-*.json`` are this script's output, never hand-edited
(``tests/runtimes/test_base_spec.py`` regenerates them and compares).  The documents
themselves are made by :mod:`vmpin.runtimes.hookconfig`, which ``vmpin install`` uses too: one
home for the hook entry, whoever writes it.

Run it with the containerd version of the node: ``ctr oci spec`` prints containerd's own
default Linux spec (``oci.GenerateSpec``), and the CRI plugin starts every container of a
handler that has a ``base_runtime_spec`` from that file instead of from that default.

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
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # vmpin from this checkout, installed or not

from vmpin.runtimes.hookconfig import (  # noqa: E402
    CREATE_STAGE,
    DEFAULT_ENV,
    DEFAULT_VMPIN,
    TIMEOUT,
    base_spec,
    dump,
    hooks_d,
)

__all__ = ["CREATE_STAGE", "DEFAULT_ENV", "DEFAULT_VMPIN", "TIMEOUT", "base_spec",
           "ctr_default_spec", "dump", "hooks_d", "main"]  # fmt: skip


def ctr_default_spec(ctr: str = "ctr") -> dict[str, Any]:
    """``ctr oci spec``: containerd's default Linux spec, as this containerd builds it."""
    out = subprocess.run([ctr, "oci", "spec"], check=True, capture_output=True, text=True)
    spec: dict[str, Any] = json.loads(out.stdout)
    return spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctr", default="ctr", help="the ctr binary (default: ctr on PATH)")
    ap.add_argument("--runtime", choices=sorted(CREATE_STAGE), help="one handler (with --out)")
    ap.add_argument("--out", help="write this file (default: the shipped files)")
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
        hooks_dir = os.path.join(os.path.dirname(HERE), "oci-hooks.d")
        for name, doc in hooks_d(args.vmpin, env).items():
            with open(os.path.join(hooks_dir, name), "w") as f:
                f.write(dump(doc))
    for runtime, out in targets.items():
        with open(out, "w") as f:
            f.write(dump(base_spec(default, runtime, args.vmpin, env)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
