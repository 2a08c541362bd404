"""Helpers shared by the tests and the benchmarks: real QEMU and runc harnesses, fixture
sysfs trees, a fake VMM, a counting affinity backend."""
