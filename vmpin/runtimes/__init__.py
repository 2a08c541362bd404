"""Adapters to the runtimes around vmpin: OCI, runc state, kubelet, QEMU/VMM, QMP, publishing."""

from vmpin.core.errors import VmpinError


class RuntimeKindError(VmpinError):
    """A runtime adapter failed: the base of each adapter's own error (QmpError, LibvirtError,
    KubeError, in their modules; vmpin.core.errors draws the tree)."""
