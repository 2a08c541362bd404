"""The runtime adapters' error base, in vmpin.core.errors' tree (which draws it).

Each adapter's own error subclasses it in the adapter's module (QmpError in
vmpin.runtimes.qmp, KubeError in vmpin.runtimes.kubelet, LibvirtError in
vmpin.runtimes.libvirt); vmpin.runtimes.runcstate raises it itself.  Here, apart from the
package's ``__init__``, because the plain container hook reads the OCI state
(vmpin.runtimes.oci) and no adapter's: it does not create this class (~0.1 M instructions of
its ~44 M, a bare interpreter ~39 M: bench/bench_hook_ir.py).  Stdlib only.
"""

from __future__ import annotations

from vmpin.core.errors import VmpinError


class RuntimeKindError(VmpinError):
    """A runtime adapter failed."""
