"""Build the guest program as one file (a zipapp) for a guest image.

The guest shares the stdlib-only modules with the host (CPU lists, the guest map's wire
format, ...) instead of keeping copies that drift; a guest image still wants one file it
can copy and run with a bare ``python3``. ``python3 -m zipfile`` semantics: a zip with a
``__main__.py`` runs as ``python3 vmpin-guest.pyz prestart``.
"""

from __future__ import annotations

import os
import zipfile

#: the modules the guest program imports, and nothing else (a test checks the list is closed:
#: the hook and the follower load all of them between them, and nothing more).
GUEST_MODULES = (
    "vmpin/__init__.py",
    "vmpin/core/__init__.py",
    "vmpin/lean/__init__.py",
    "vmpin/lean/records.py",
    "vmpin/core/errors.py",
    "vmpin/core/cpuset.py",
    "vmpin/linux/__init__.py",
    "vmpin/linux/files.py",
    "vmpin/linux/procfs.py",
    "vmpin/linux/affinity.py",
    "vmpin/wire/__init__.py",
    "vmpin/wire/guestmap.py",
    "vmpin/wire/jsonio.py",
    "vmpin/guest/__init__.py",
    "vmpin/guest/common.py",
    "vmpin/guest/cgroups.py",
    "vmpin/guest/pinning.py",
    "vmpin/guest/records.py",
    "vmpin/guest/inputs.py",
    "vmpin/guest/options.py",
    "vmpin/guest/hook.py",
    "vmpin/guest/follower.py",
    "vmpin/guest/program.py",
)

MAIN = "from vmpin.guest.program import run_as_file\nrun_as_file()\n"


def build(dest: str) -> str:
    """Write the zipapp to ``dest`` (mode 0755); returns ``dest``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tmp = f"{dest}.{os.getpid()}.tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("__main__.py", MAIN)
        for rel in GUEST_MODULES:
            z.write(os.path.join(root, rel), rel)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "vmpin-guest.pyz"))
