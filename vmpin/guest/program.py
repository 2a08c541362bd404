#!/usr/bin/env python3
"""The guest program as one file: what the zipapp of :mod:`vmpin.guest.bundle` runs.

A guest image may hold only ``python3`` and that one file, called three ways: by kata-agent
directly (argv ``[name, stage]``), by the shipped wrapper
(``hooks/kata-guest/.../vmpin-guest``: ``guest hook STAGE``, as for the package), and as the
follower (``guest follow ARGS`` or ``follow ARGS``).  Each command's module is imported only
once the argv has chosen it: modules in a zip are compiled on every run, and the hook runs
at every container start.
"""

from __future__ import annotations

import sys


def run_as_file() -> None:
    """Hand ``sys.argv`` to the follower or the hook, as the module docstring says; exit
    with its status."""
    argv = sys.argv[1:]
    if argv[:2] == ["guest", "follow"] or argv[:1] == ["follow"]:
        from vmpin.guest.follower import follow_main

        sys.exit(follow_main(argv[2:] if argv[0] == "guest" else argv[1:]))
    from vmpin.guest.hook import main

    sys.exit(main(argv[2:] if argv[:2] == ["guest", "hook"] else argv))


if __name__ == "__main__":
    run_as_file()
