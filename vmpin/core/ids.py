"""Container and sandbox ids: what vmpin accepts, so that no id can name a path.

Ids end up in file names (published guest maps, the VM dir lookup ``<vm-dir>/<id>/pid``), so
an id is a single path component of safe characters: runc's own rule (letters, digits,
``_ + - .``), no leading dot (no ``.`` or ``..``), at most 1024 bytes (containerd ids are 64 hex
digits, CRI-O's too; podman's names are shorter).
"""

from __future__ import annotations

import re

from vmpin.core.errors import IdError

_ID = re.compile(r"[A-Za-z0-9_+\-][A-Za-z0-9_+\-.]{0,1023}")


def check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise IdError(
            f"{what}: invalid id {value!r} (letters, digits, '_+-.', not starting with '.')"
        )
    return value
