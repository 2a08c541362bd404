"""Adapters to the runtimes around vmpin: OCI, runc state, kubelet, QEMU/VMM, QMP, publishing."""
