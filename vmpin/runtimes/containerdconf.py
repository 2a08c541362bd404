"""containerd's config.toml: point its runc and Kata runtime handlers at vmpin's base specs.

**Edited in place, not dropped in beside.**  containerd 1.x merges an ``imports`` file into
the main config *by plugin section*: a drop-in that sets only
``[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc] base_runtime_spec`` replaces
the node's whole CRI section -- its ``sandbox_image``, CNI and registry settings, every other
handler and the runc handler's own ``runtime_type`` and options fall back to containerd's
defaults (seen with 1.6.20 and ``containerd config dump``; containerd issue #5837, fixed for
2.0 by PR #9982).  A drop-in that carried a copy of the node's CRI section would hide every
later edit of config.toml instead.  So vmpin adds one line per handler to config.toml itself
(kata-deploy, too, edits config.toml for containerd 1.x), every line it adds ends with
:data:`MARK`, and the result is parsed again and must equal the original plus those keys,
or nothing is written.

Which handlers: every ``runtimes.NAME`` table of the CRI plugin whose ``runtime_type`` is
runc's (``io.containerd.runc.v2``, ...: the runc base spec) or Kata's
(``io.containerd.kata*.v2``: the Kata base spec); other runtimes (gVisor, ...) are left
alone.  A config with no handler at all gets containerd's default one, ``runc``, with its
``runtime_type`` spelled out: a ``runtimes.runc`` table replaces containerd's default entry
whole.  No config.toml at all: one is written with just that.

Config ``version = 2`` (containerd 1.5 to 1.7; plugin ``io.containerd.grpc.v1.cri``) is
checked against a real containerd 1.6 by the tests; ``version = 3`` (containerd 2.x; plugin
``io.containerd.cri.v1.runtime``) is edited the same way, from containerd's documentation.
TOML is read with :mod:`tomllib` (Python >= 3.11).
"""

from __future__ import annotations

import json
from typing import Any

from vmpin.core.errors import VmpinError

#: every line vmpin adds to config.toml ends with this comment (uninstall finds them by it)
MARK = "# added by vmpin install"
#: ...or with this one, where it replaced an empty ``base_runtime_spec = ""`` (which
#: ``containerd config default`` writes into every handler)
MARK_WAS_EMPTY = MARK + ' (was "")'

#: the CRI runtime plugin's id per config version
PLUGIN = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
RUNC_TYPES = ("io.containerd.runc.v2", "io.containerd.runc.v1", "io.containerd.runtime.v1.linux")
KATA_PREFIX = "io.containerd.kata"


class ContainerdConfigError(VmpinError):
    """A containerd config vmpin will not edit (and says what to do instead)."""


def _toml() -> Any:
    try:
        import tomllib
    except ImportError as err:  # Python 3.10
        raise ContainerdConfigError(
            "reading containerd's config.toml needs Python >= 3.11 (tomllib)"
        ) from err
    return tomllib


def parse(text: str, where: str) -> dict[str, Any]:
    toml = _toml()
    try:
        doc: dict[str, Any] = toml.loads(text)
    except toml.TOMLDecodeError as err:
        raise ContainerdConfigError(f"{where}: not valid TOML: {err}") from err
    return doc


def kind(runtime_type: object) -> str | None:
    """Which base spec a handler of this ``runtime_type`` gets: runc, kata or none."""
    if runtime_type in RUNC_TYPES:
        return "runc"
    if isinstance(runtime_type, str) and runtime_type.startswith(KATA_PREFIX):
        return "kata"
    return None


def _runtimes(doc: dict[str, Any], plugin: str) -> dict[str, Any]:
    node: Any = doc
    for key in ("plugins", plugin, "containerd", "runtimes"):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return {}
    return node if isinstance(node, dict) else {}


def _version(doc: dict[str, Any], where: str) -> int:
    version = doc.get("version", 1)
    if version not in PLUGIN:
        raise ContainerdConfigError(
            f"{where}: config version {version!r}: vmpin edits versions 2 (containerd 1.5-1.7)"
            " and 3 (containerd 2.x); set base_runtime_spec by hand (docs/hooks.md)"
        )
    return int(version)


def _key(s: str) -> str:
    """A TOML key as vmpin writes it: bare when it can be, else a basic string."""
    if s and all(c.isascii() and (c.isalnum() or c in "-_") for c in s):
        return s
    return json.dumps(s)


def header_keys(line: str) -> tuple[str, ...] | None:
    """The key path of a ``[table]`` header line, or None (not one; an ``[[array]]``)."""
    s = line.strip()
    if not s.startswith("[") or s.startswith("[["):
        return None
    i, keys = 1, []
    while True:
        while i < len(s) and s[i] in " \t":
            i += 1
        if i >= len(s):
            return None
        if s[i] == '"':
            j = i + 1
            while j < len(s) and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            try:
                keys.append(json.loads(s[i : j + 1]))
            except ValueError:
                return None
            i = j + 1
        elif s[i] == "'":
            j = s.find("'", i + 1)
            if j < 0:
                return None
            keys.append(s[i + 1 : j])
            i = j + 1
        else:
            j = i
            while j < len(s) and (s[j].isalnum() or s[j] in "-_"):
                j += 1
            if j == i:
                return None
            keys.append(s[i:j])
            i = j
        while i < len(s) and s[i] in " \t":
            i += 1
        if i < len(s) and s[i] == ".":
            i += 1
            continue
        if i < len(s) and s[i] == "]":
            rest = s[i + 1 :].strip()
            return tuple(keys) if not rest or rest.startswith("#") else None
        return None


def edit(text: str | None, specs: dict[str, str], where: str) -> tuple[str, list[str]]:
    """``text`` (None: no config.toml) with ``base_runtime_spec`` set on every runc and Kata
    handler, to ``specs[kind]``; and one line per handler saying what was done.

    A handler that already names another base spec is an error (vmpin would take its place);
    one that names vmpin's is left as it is.
    """
    if text is None:
        path = specs["runc"]
        new = (
            f"# no config.toml was here: vmpin uninstall removes this file  {MARK}\n"
            "version = 2\n\n"
            f'[plugins."{PLUGIN[2]}".containerd.runtimes.runc]  {MARK}\n'
            f'  runtime_type = "{RUNC_TYPES[0]}"  {MARK}\n'
            f"  base_runtime_spec = {json.dumps(path)}  {MARK}\n"
        )
        return new, [f"{where}: written (containerd's default runc handler, with {path})"]
    doc = parse(text, where)
    version = _version(doc, where)
    plugin = PLUGIN[version]
    runtimes = _runtimes(doc, plugin)
    todo: dict[str, str] = {}  # handler -> base spec
    notes: list[str] = []
    for name, table in runtimes.items():
        if not isinstance(table, dict):
            continue
        k = kind(table.get("runtime_type"))
        if k is None:
            notes.append(f"{where}: handler {name} ({table.get('runtime_type')}): left alone")
            continue
        have = table.get("base_runtime_spec") or ""
        if have == specs[k]:
            notes.append(f"{where}: handler {name}: already {have}")
        elif have:
            raise ContainerdConfigError(
                f"{where}: handler {name} already has base_runtime_spec {have!r}; vmpin would"
                f" replace it: add vmpin's hooks (from {specs[k]}) to that spec by hand, or"
                " install without containerd (--runtime crio,podman)"
            )
        else:
            todo[name] = specs[k]
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    added_default = not runtimes
    if added_default:  # containerd's default handler, spelled out (it is replaced whole)
        lines += [
            f"{MARK}\n",
            f'[plugins."{plugin}".containerd.runtimes.runc]  {MARK}\n',
            f'  runtime_type = "{RUNC_TYPES[0]}"  {MARK}\n',
            f"  base_runtime_spec = {json.dumps(specs['runc'])}  {MARK}\n",
        ]
        notes.append(f"{where}: handler runc (containerd's default): {specs['runc']}")
    for name, path in todo.items():
        want = ("plugins", plugin, "containerd", "runtimes", name)
        at = next((i for i, ln in enumerate(lines) if header_keys(ln) == want), None)
        key = f"base_runtime_spec = {json.dumps(path)}  {MARK}\n"
        if at is None:  # the table exists only through a sub-table ([...runc.options])
            lines += [f"{MARK}\n", f"[{'.'.join(_key(k) for k in want)}]  {MARK}\n", f"  {key}"]
        else:
            empty = _empty_key(lines, at)
            if empty is not None:
                ln = lines[empty]
                indent = ln[: len(ln) - len(ln.lstrip())]
                lines[empty] = f"{indent}base_runtime_spec = {json.dumps(path)}  {MARK_WAS_EMPTY}\n"
            else:
                lines.insert(at + 1, _indent_after(lines, at) + key)
        notes.append(f"{where}: handler {name}: base_runtime_spec = {path}")
    new = "".join(lines)
    # nothing but those keys may have changed: otherwise vmpin writes nothing
    want_doc = json.loads(json.dumps(doc))
    want_rt = want_doc.setdefault("plugins", {}).setdefault(plugin, {})
    want_rt = want_rt.setdefault("containerd", {}).setdefault("runtimes", {})
    if added_default:
        want_rt["runc"] = {"runtime_type": RUNC_TYPES[0], "base_runtime_spec": specs["runc"]}
    for name, path in todo.items():
        want_rt[name]["base_runtime_spec"] = path
    try:
        got = parse(new, where)
    except ContainerdConfigError:
        got = None
    if got != want_doc:
        raise ContainerdConfigError(
            f"{where}: vmpin could not add base_runtime_spec to it safely (a layout it does not"
            f" edit, e.g. dotted keys); set it by hand: {json.dumps(todo)} (docs/hooks.md)"
        )
    return new, notes


def _empty_key(lines: list[str], header: int) -> int | None:
    """The line of ``base_runtime_spec = ""`` in the table under ``header``, if any."""
    for i in range(header + 1, len(lines)):
        s = lines[i].strip()
        if s.startswith("["):
            return None
        key, eq, value = s.partition("=")
        if eq and key.strip() == "base_runtime_spec":
            value = value.split("#", 1)[0].strip()
            return i if value in ('""', "''") else None
    return None


def _indent_after(lines: list[str], header: int) -> str:
    """The indentation of the first key under a table header (the header's, plus two, if
    the table has none)."""
    for ln in lines[header + 1 :]:
        s = ln.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("["):
            break
        return ln[: len(ln) - len(ln.lstrip())]
    base = lines[header][: len(lines[header]) - len(lines[header].lstrip())]
    return base + "  "


def strip(text: str) -> str:
    """``text`` without the lines vmpin added (:data:`MARK`), for a config.toml changed since
    vmpin wrote it.  None of vmpin's base specs may be left named there."""
    out = []
    for ln in text.splitlines(keepends=True):
        if ln.rstrip().endswith(MARK_WAS_EMPTY):
            out.append(ln[: len(ln) - len(ln.lstrip())] + 'base_runtime_spec = ""\n')
        elif not ln.rstrip().endswith(MARK):
            out.append(ln)
    return "".join(out)
