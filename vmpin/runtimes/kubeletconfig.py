"""kubelet's configuration file, read for what vmpin's own allocation must honour (issue 30).

A KubeletConfiguration (``/var/lib/kubelet/config.yaml`` on kubeadm nodes; JSON is YAML too)
says which CPUs kubelet keeps for the system and how its static policy would choose; when
vmpin allocates in kubelet's place (policy ``none``: docs/allocation.md) it follows the same:

- ``reservedSystemCPUs`` (a CPU list): never allocated, they stay in the shared pool;
- else ``kubeReserved.cpu`` + ``systemReserved.cpu`` (quantities: ``"1"``, ``"500m"``): as
  kubelet's static policy, that many whole CPUs (rounded up) are reserved, the first in its
  order;
- ``cpuManagerPolicyOptions`` (:data:`OPTIONS`): ``full-pcpus-only``,
  ``distribute-cpus-across-numa``, ``align-by-socket``, ``prefer-align-cpus-by-uncorecache``
  and ``strict-cpu-reservation`` set :class:`vmpin.core.allocate.Options` (docs/allocation.md
  says what each does).  A value is read as kubelet's ``strconv.ParseBool`` reads it; a pair
  kubelet refuses to start with (``prefer-align-cpus-by-uncorecache`` with
  ``distribute-cpus-across-numa``) is a note and neither is followed; options vmpin does not
  follow (``distribute-cpus-across-cores``, unknown ones) are named in the notes.

Read only; a file that is missing means kubelet's defaults (nothing reserved explicitly: one
CPU kept), a file that cannot be read or parsed is a note and the defaults.

JSON is read as JSON.  YAML is read by :func:`_block_yaml`, which knows only what these keys
need -- top-level ``key: scalar`` and ``key:`` followed by an indented block of ``key:
scalar`` (or a flow mapping ``{a: b}``) -- and skips everything else (lists, deeper
nesting, block scalars).  A YAML library is not stdlib: the hook, which may settle
allocations, runs from a stdlib-only file (vmpin.service.hookfile).
"""

from __future__ import annotations

import math

from vmpin.core.allocate import Options
from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import VmpinError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: static-policy options vmpin's allocation follows: kubelet's name -> Options field (the
#: rest are named as not followed)
OPTIONS = {
    "full-pcpus-only": "full_pcpus_only",
    "distribute-cpus-across-numa": "distribute_across_numa",
    "align-by-socket": "align_by_socket",
    "prefer-align-cpus-by-uncorecache": "prefer_uncore",
    "strict-cpu-reservation": "strict_reservation",
}
#: pairs kubelet refuses to start with (NewStaticPolicyOptions); vmpin follows neither
EXCLUSIVE = (("prefer-align-cpus-by-uncorecache", "distribute-cpus-across-numa"),)
#: Go's strconv.ParseBool
_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def read_options(path: str) -> tuple[Options, list[str]]:
    """The allocation's options from kubelet's configuration file, and notes on it."""
    import os

    from vmpin.linux.files import read_bytes

    if not os.path.lexists(path):
        return Options(), []
    try:
        raw = read_bytes(path, what="kubelet config")
    except (OSError, VmpinError) as err:
        return Options(), [f"kubelet config {path}: {err}: kubelet's defaults assumed"]
    try:
        doc = _load(raw)
    except Exception as err:  # a parser's own error types: the file is the problem
        return Options(), [f"kubelet config {path}: {err}: kubelet's defaults assumed"]
    if not isinstance(doc, dict):
        return Options(), [f"kubelet config {path}: not a mapping: kubelet's defaults assumed"]
    return options_from(doc, path)


def options_from(doc: dict[str, Any], path: str = "kubelet config") -> tuple[Options, list[str]]:
    notes: list[str] = []
    opts = doc.get("cpuManagerPolicyOptions") or {}
    if not isinstance(opts, dict):
        notes.append(f"{path}: cpuManagerPolicyOptions is not a mapping: ignored")
        opts = {}
    chosen: dict[str, bool] = {}
    ignored = []
    for name, value in sorted(opts.items()):
        word = str(value).strip()
        if word not in _TRUE + _FALSE:
            notes.append(f"{path}: cpuManagerPolicyOptions {name}: {word!r} is not a boolean:"
                         " ignored")  # fmt: skip
        elif name in OPTIONS:
            chosen[OPTIONS[name]] = word in _TRUE
        elif word in _TRUE:
            ignored.append(name)
    if ignored:
        notes.append(f"{path}: cpuManagerPolicyOptions {', '.join(ignored)}: not followed by"
                     " vmpin's allocation")  # fmt: skip
    for a, b in EXCLUSIVE:
        if chosen.get(OPTIONS[a]) and chosen.get(OPTIONS[b]):
            notes.append(f"{path}: cpuManagerPolicyOptions {a} and {b} cannot be used together"
                         " (kubelet refuses them): neither followed")  # fmt: skip
            chosen[OPTIONS[a]] = chosen[OPTIONS[b]] = False
    reserved: CpuSet | None = None
    keep = 1
    text = doc.get("reservedSystemCPUs")
    if isinstance(text, str) and text.strip():
        try:
            reserved = CpuSet.parse(text)
        except VmpinError as err:
            notes.append(f"{path}: reservedSystemCPUs {text!r}: {err}: ignored")
    else:
        total = 0.0
        for key in ("kubeReserved", "systemReserved"):
            section = doc.get(key)
            if isinstance(section, dict) and section.get("cpu") is not None:
                try:
                    total += _cpu_quantity(str(section["cpu"]))
                except ValueError:
                    notes.append(f"{path}: {key}.cpu {section['cpu']!r}: not a CPU quantity")
        keep = max(1, math.ceil(total))
    return Options(
        full_pcpus_only=chosen.get("full_pcpus_only", False),
        reserved=reserved,
        keep=keep,
        distribute_across_numa=chosen.get("distribute_across_numa", False),
        align_by_socket=chosen.get("align_by_socket", False),
        prefer_uncore=chosen.get("prefer_uncore", False),
        strict_reservation=chosen.get("strict_reservation", False),
    ), notes


def _cpu_quantity(text: str) -> float:
    """A Kubernetes CPU quantity: ``2``, ``1.5``, ``500m``."""
    text = text.strip()
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


def _load(raw: bytes) -> Any:
    text = raw.decode("utf-8")
    if text.lstrip().startswith("{"):
        from vmpin.wire import jsonio

        return jsonio.loads(text)
    return _block_yaml(text)


def _block_yaml(text: str) -> dict[str, Any]:
    """The top-level scalars and one-level mappings of a block-style YAML document."""
    out: dict[str, Any] = {}
    section: dict[str, Any] | None = None
    child_indent: int | None = None
    for n, line in enumerate(text.splitlines(), 1):
        body = _uncomment(line).rstrip()
        if not body.strip() or body.strip() in ("---", "..."):
            continue
        indent = len(body) - len(body.lstrip(" "))
        body = body.strip()
        if body.startswith("- ") or body == "-":
            continue  # a list's item: no key read here holds a list
        key, sep, value = body.partition(":")
        if not sep:
            if indent == 0:
                raise ValueError(f"line {n}: not 'key: value': {line.strip()!r}")
            continue  # the rest of a multi-line value
        key, value = _scalar(key), value.strip()
        if indent == 0:
            section, child_indent = None, None
            if not value:
                out[key] = section = {}
            elif value.startswith("{") and value.endswith("}"):
                out[key] = _flow(value)
            else:
                out[key] = _scalar(value)
            continue
        if section is None:
            continue
        if child_indent is None:
            child_indent = indent
        if indent == child_indent:
            section[key] = _flow(value) if value.startswith("{") else _scalar(value)
    return out


def _uncomment(line: str) -> str:
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def _scalar(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _flow(text: str) -> dict[str, str]:
    """``{a: b, c: "d"}`` (no nesting)."""
    out = {}
    for item in text.strip()[1:-1].split(","):
        key, sep, value = item.partition(":")
        if sep:
            out[_scalar(key)] = _scalar(value)
    return out
