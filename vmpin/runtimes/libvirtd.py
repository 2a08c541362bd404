"""Where a libvirt daemon answers on this host: settled without libvirt-python.

``qemu:///system`` is the default connection (docs/libvirt.md), handled only when its daemon
runs here (the monolithic libvirtd or the modular virtqemud, each with its socket).  A one-shot
command asks this before it imports :mod:`vmpin.reconcile.domains` (threading, the apply
module) and libvirt-python: on a node without libvirt, a read command loads none of them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

DEFAULT_URIS = ("qemu:///system",)
#: where qemu:///system answers (monolithic libvirtd, or modular virtqemud)
SYSTEM_SOCKETS = ("/run/libvirt/libvirt-sock", "/run/libvirt/virtqemud-sock")


def wanted_uris(uris: Iterable[str]) -> list[str]:
    """The configured URIs, less the default one when no daemon serves it here."""
    return [
        uri
        for uri in uris
        # the default and no daemon on this node: nothing to handle, nothing to report
        if uri not in DEFAULT_URIS or any(os.path.exists(s) for s in SYSTEM_SOCKETS)
    ]
