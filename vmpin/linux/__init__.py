"""Readers and writers of the Linux host (procfs, sysfs, cgroups, affinity).

Stdlib only; each takes its root as a parameter.
"""
