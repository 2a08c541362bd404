"""vmpin: keep every VM sandbox's QEMU threads, and every plain container, on their CPUs.

This module stays import-free: the OCI hook imports the package on every container start.
"""

__version__ = "0.1.0"
