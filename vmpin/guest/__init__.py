"""The program that runs inside a Kata guest VM: stdlib only, shipped as one file.

Kata drops a container's cpuset inside the guest: guest vCPU numbers are not host CPU
numbers, so the agent cannot apply ``linux.resources.cpu.cpus`` as given, and every
container of a pod runs on every vCPU.  Under vmpin's 1:1 plan the numbers *are* related
(vCPU i runs only on host CPU h), so the host publishes each container's vCPUs
(:mod:`vmpin.runtimes.publish`, the format in ``docs/guest.md``) in the directory Kata
already shares with the guest, and this package applies them: ``vmpin guest hook`` when a
container starts (:mod:`~vmpin.guest.hook`), ``vmpin guest follow`` when the host changes
them later (:mod:`~vmpin.guest.follower`).

It shares the host's stdlib-only modules instead of copying them: CPU lists
(:mod:`vmpin.core.cpuset`, with the host's cap on CPU numbers), the map's wire format
(:mod:`vmpin.wire.guestmap`), procfs readers and sched_setaffinity with read-back
(:mod:`vmpin.linux`); no sqlite3/typer/pydantic/psutil (``tests/guest/test_guest.py`` and
the lint-imports contracts check it).  A guest image gets it as one file, the zipapp of
:mod:`vmpin.guest.bundle` (``python3 -I -S vmpin-guest.pyz prestart``), or as the installed
package.  The hook and the follower load only what each needs (the hook runs at every
container start); the modules, in the layers a contract in ``pyproject.toml`` keeps:

- ``program``: the one-file entry, which hands argv to the hook or the follower;
- ``hook``, ``follower``: the two commands, neither importing the other;
- ``options`` (their command lines), ``inputs`` (the OCI state, the published map),
  ``records`` (what the hook pinned, for the follower), ``pinning`` (cgroup or threads);
- ``cgroups`` (a container's cpuset cgroup), then ``common`` (GuestError, CPU lists).
"""
