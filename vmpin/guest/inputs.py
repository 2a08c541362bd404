"""What the host hands the guest: the container's OCI state on stdin, and the published map.

Both come from outside the guest program and are checked before anything is pinned: a
malformed state or map is one line on stderr, never a guess.  The map's format is the
host's own module (:mod:`vmpin.wire.guestmap`), so reader and writer cannot drift; this
module only turns its errors into the guest's and waits for a map published late.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

from vmpin.core.errors import VmpinError, WireError
from vmpin.guest.common import GuestError
from vmpin.linux.files import read_bytes
from vmpin.wire import guestmap as wire
from vmpin.wire.guestmap import Entry, GuestMap


class State(NamedTuple):
    """What the hook needs from the OCI state: the container's id and its pid (0: none)."""

    id: str
    pid: int
    bundle: str


def parse_state(data: bytes) -> State:
    """The OCI state JSON (``{"id", "pid", "bundle", ...}``); pid is optional (poststop)."""
    try:
        raw = json.loads(data)
    except ValueError as err:
        raise GuestError(f"OCI state on stdin is not JSON: {err}") from None
    except RecursionError:
        raise GuestError("OCI state on stdin is JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise GuestError("OCI state on stdin is not a JSON object")
    cid = raw.get("id")
    if not isinstance(cid, str) or not cid:
        raise GuestError("OCI state on stdin has no container id")
    pid = raw.get("pid") or 0
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise GuestError(f"OCI state of {cid}: bad pid {pid!r}")
    bundle = raw.get("bundle")
    return State(cid, pid, bundle if isinstance(bundle, str) else "")


def read_map(path: str) -> GuestMap:
    """Read and check the published map (:func:`vmpin.wire.guestmap.from_json`)."""
    try:
        data = read_bytes(path, limit=wire.MAX_BYTES, what="guest map")
    except FileNotFoundError:
        raise GuestError(
            f"no guest map at {path} (vmpin on the host has not published one "
            "for this sandbox, or Kata shares no directory with the guest)"
        ) from None
    except OSError as err:
        raise GuestError(f"cannot read guest map {path}: {err.strerror}") from None
    except VmpinError as err:  # a symlink, FIFO, device or huge file: refused unread
        raise GuestError(str(err)) from None
    try:
        return wire.from_json(data, f"guest map {path}")
    except WireError as err:
        raise GuestError(str(err)) from None


def lookup(guest_map: GuestMap, container_id: str) -> Entry | None:
    """The container's entry, None when the map does not name it."""
    try:
        return guest_map.entry(container_id)
    except WireError as err:
        raise GuestError(str(err)) from None


def find_entry(path: str, container_id: str, wait: float) -> Entry:
    """The container's entry, polling up to ``wait`` seconds for the host to publish it.

    The host publishes from its own hooks, which may finish after the agent starts this
    one; and virtio-fs may serve a cached directory entry for about a second.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            entry = lookup(read_map(path), container_id)
            if entry is not None:
                return entry
            err = GuestError(f"container {container_id} is not in the guest map {path}")
        except GuestError as e:
            err = e
        if time.monotonic() >= deadline:
            raise err
        time.sleep(0.1)
