"""HostPaths: the roots of every host file vmpin reads or writes, built once and passed down.

Tests point the same adapters at fixture trees or temporary dirs; nothing below the entry
points reads an environment variable or assumes "/proc".  Lean on purpose: the hook imports
it.  A NamedTuple, not a dataclass: ``dataclasses`` pulls in ``inspect``, ~10 ms of the hook's
budget.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from typing import Mapping, NamedTuple
else:
    from vmpin.lean.records import NamedTuple

DEFAULTS: dict[str, str] = {
    "state_dir": "/run/vmpin",
    "vm_dir": "/run/vc/vm",
    "proc": "/proc",
    "sys": "/sys",
    "cgroup": "/sys/fs/cgroup",
    # a search list (vmpin.runtimes.runcstate.runc_roots): runc's own default, then
    # containerd's runc shim, one root per containerd namespace (k8s.io on Kubernetes)
    "runc_root": "/run/runc:/run/containerd/runc/*",
    "kubelet_state": "/var/lib/kubelet/cpu_manager_state",
    # kubelet's configuration file (KubeletConfiguration), read for the CPUs it reserves and
    # its static-policy options when vmpin allocates (vmpin.runtimes.kubeletconfig)
    "kubelet_config": "/var/lib/kubelet/config.yaml",
    "publish_dir": "/run/kata-containers/shared/sandboxes",
    # Kata's configuration files, for its own vCPU pinning (vmpin.runtimes.kataconfig): Kata's
    # two default paths (the first that exists), then kata-deploy's one file per runtime class
    "kata_config": "/etc/kata-containers/configuration.toml"
    "|/usr/share/defaults/kata-containers/configuration.toml"
    ":/opt/kata/share/defaults/kata-containers/configuration*.toml",
}

#: option name -> environment variable, the contract in DESIGN.md plus vmpin's own extras.
ENVVARS: dict[str, str] = {
    "state_dir": "VMPIN_STATE_DIR",
    "vm_dir": "VMPIN_VM_DIR",
    "proc": "VMPIN_PROC_ROOT",
    "sys": "VMPIN_SYSFS_ROOT",
    "cgroup": "VMPIN_CGROUP_ROOT",
    "runc_root": "VMPIN_RUNC_ROOT",
    "kubelet_state": "VMPIN_KUBELET_STATE",
    "kubelet_config": "VMPIN_KUBELET_CONFIG",
    "publish_dir": "VMPIN_PUBLISH_DIR",
    "kata_config": "VMPIN_KATA_CONFIG",
}


class HostPaths(NamedTuple):
    state_dir: str = DEFAULTS["state_dir"]
    vm_dir: str = DEFAULTS["vm_dir"]
    proc: str = DEFAULTS["proc"]
    sys: str = DEFAULTS["sys"]
    cgroup: str = DEFAULTS["cgroup"]
    runc_root: str = DEFAULTS["runc_root"]
    kubelet_state: str = DEFAULTS["kubelet_state"]
    publish_dir: str = DEFAULTS["publish_dir"]
    kata_config: str = DEFAULTS["kata_config"]
    kubelet_config: str = DEFAULTS["kubelet_config"]

    @classmethod
    def from_env(
        cls, overrides: Mapping[str, str | None] | None, env: Mapping[str, str]
    ) -> HostPaths:
        """Options given explicitly win over the environment, which wins over the defaults.
        The one reader of the host roots' variables in ``env``: for
        :meth:`vmpin.service.settings.Settings.from_env`, and for a hook that builds no
        Settings (vmpin.service.hook)."""
        values = {k: env.get(v) or DEFAULTS[k] for k, v in ENVVARS.items()}
        unknown = set(overrides or {}) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown path options {sorted(unknown)}")
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        return cls(**values)

    @property
    def db(self) -> str:
        return os.path.join(self.state_dir, "state.db")

    @property
    def control_socket(self) -> str:
        return os.path.join(self.state_dir, "control.sock")

    @property
    def topology_cache(self) -> str:
        """The host's CPU topology as last read from sysfs (vmpin.linux.sysfs.read_topology)."""
        return os.path.join(self.state_dir, "topology.json")

    @property
    def kata_config_cache(self) -> str:
        """What Kata's configuration files said, as last parsed (vmpin.runtimes.kataconfig)."""
        return os.path.join(self.state_dir, "kata-config.json")
