"""libvirt's domain lifecycle events, turned into agent work: a started or stopped domain is
planned at once instead of at the next periodic pass.

libvirt delivers events only to a process that runs its event loop
(``virEventRegisterDefaultImpl`` before the connection opens, then ``virEventRunDefaultImpl``
in a loop: :func:`vmpin.runtimes.libvirt.start_event_loop`).  Each configured connection gets
a connection of its own here, with one lifecycle callback; the callback runs on libvirt's
event thread and only queues the domain's UUID, like every other event in the agent (the pass
it wakes observes every domain afresh).  A connection that cannot be opened is logged and
skipped: the periodic pass still covers its domains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vmpin.core.errors import VmpinError
from vmpin.reconcile.domains import LibvirtDomains, adapter

log = logging.getLogger("vmpin.libvirt")


class DomainEvents:
    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns

    @classmethod
    def start(
        cls, domains: LibvirtDomains, notify: Callable[[list[str]], int]
    ) -> DomainEvents | None:
        """Watch every connection of ``domains``; None when libvirt is not installed, or when
        no daemon serves the default connection (then nothing would be watched, and
        libvirt-python stays unloaded until a pass finds a daemon)."""
        if not domains.wanted_uris():
            return None
        lv = adapter()
        if lv is None:
            return None
        lv.start_event_loop()

        def on_event(uuid: str, event: str) -> None:
            log.info("libvirt event", extra={"fields": {"domain": uuid, "lifecycle": event}})
            notify([uuid])

        watched = []
        for conn in lv.connections(domains.paths, domains.wanted_uris()):
            try:
                conn.watch(on_event)
            except VmpinError as err:
                log.warning("libvirt events unavailable", extra={"fields": {"error": str(err)}})
                continue
            watched.append(conn)
        return cls(watched)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
