"""Container and sandbox ids: what vmpin accepts, so that no id can name a path.

Ids end up in file names (published guest maps, the VM dir lookup ``<vm-dir>/<id>/pid``), so
an id is a single path component of safe characters: runc's own rule (letters, digits,
``_ + - .``), no leading dot (no ``.`` or ``..``), at most 1024 bytes (containerd ids are 64 hex
digits, CRI-O's too; podman's names are shorter).

The check is a set test rather than a regular expression: ``vmpin hook`` checks ids on every
container start, and ``re`` (with enum and functools behind it) is one of its largest import
costs (issue 14).
"""

from __future__ import annotations

from vmpin.core.errors import IdError

# ASCII only: str.isalnum() would also accept non-ASCII letters and digits, which runc refuses.
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_+-.")
_MAX_ID = 1024


def _valid(value: object) -> bool:
    return (isinstance(value, str) and 0 < len(value) <= _MAX_ID and value[0] != "."
            and _ID_CHARS.issuperset(value))


def valid_id(value: object) -> bool:
    """Whether ``value`` is an id vmpin keeps (what :func:`check_id` accepts)."""
    return _valid(value)


def check_id(value: str, what: str = "id") -> str:
    if not _valid(value):
        raise IdError(
            f"{what}: invalid id {value!r} (letters, digits, '_+-.', not starting with '.')"
        )
    return value
