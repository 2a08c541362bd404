"""kubelet's configuration file, as vmpin's allocation reads it (vmpin.runtimes.kubeletconfig)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmpin.core.allocate import Options
from vmpin.core.cpuset import CpuSet
from vmpin.runtimes.kubeletconfig import read_options

YAML = """\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cpuManagerPolicy: none
cpuManagerPolicyOptions:
  full-pcpus-only: "true"
  distribute-cpus-across-numa: "true"
reservedSystemCPUs: "0-1"
"""


@pytest.mark.parametrize(
    ("text", "want", "noted"),
    [
        (YAML, Options(True, CpuSet.parse("0-1"), 1, distribute_across_numa=True), []),
        ("cpuManagerPolicyOptions:\n  align-by-socket: 'True'\n  prefer-align-cpus-by-uncorecache:"
         " '1'\n  strict-cpu-reservation: 't'\n",
         Options(align_by_socket=True, prefer_uncore=True, strict_reservation=True), []),
        # kubelet refuses to start with these two together: vmpin follows neither
        ("cpuManagerPolicyOptions:\n  distribute-cpus-across-numa: 'true'\n"
         "  prefer-align-cpus-by-uncorecache: 'true'\n", Options(), ["cannot be used together"]),
        ("cpuManagerPolicyOptions:\n  distribute-cpus-across-cores: 'true'\n", Options(),
         ["distribute-cpus-across-cores: not followed"]),
        ("cpuManagerPolicyOptions:\n  full-pcpus-only: 'yes'\n", Options(),
         ["'yes' is not a boolean"]),
        ('{"kubeReserved": {"cpu": "500m"}, "systemReserved": {"cpu": "1"}}',
         Options(keep=2), []),
        ("kubeReserved:\n  cpu: 250m\n", Options(keep=1), []),
        ("cpuManagerPolicyOptions:\n  full-pcpus-only: 'false'\n", Options(), []),
        ("reservedSystemCPUs: '3-1'\n", Options(), ["reservedSystemCPUs"]),
        ("kubeReserved:\n  cpu: lots\n", Options(), ["not a CPU quantity"]),
        ("just words\n", Options(), ["not 'key: value'"]),
        ("{not json", Options(), ["kubelet's defaults assumed"]),
    ],
)  # fmt: skip
def test_options(tmp_path: Path, text: str, want: Options, noted: list[str]) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(text)
    got, notes = read_options(str(f))
    assert got == want
    for n in noted:
        assert any(n in note for note in notes), notes
    if not noted:
        assert notes == []


def test_missing_file_is_kubelets_defaults(tmp_path: Path) -> None:
    assert read_options(str(tmp_path / "absent.yaml")) == (Options(), [])


#: a kubeadm node's file, as `kubeadm init` writes it, with the CPU manager's settings added
KUBEADM = """\
apiVersion: kubelet.config.k8s.io/v1beta1
authentication:
  anonymous:
    enabled: false
  webhook:
    cacheTTL: 0s
    enabled: true
clusterDNS:
- 10.96.0.10
clusterDomain: cluster.local
cpuManagerPolicy: none   # vmpin allocates (docs/allocation.md)
cpuManagerPolicyOptions: {full-pcpus-only: "true", "strict-cpu-reservation": 'true'}
kind: KubeletConfiguration
kubeReserved:
  memory: 1Gi
  cpu: "1"
systemReserved:
  cpu: 500m
tlsCipherSuites:
  - TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
staticPodPath: /etc/kubernetes/manifests
"""


def test_a_kubeadm_file(tmp_path: Path) -> None:
    f = tmp_path / "config.yaml"
    f.write_text(KUBEADM)
    got, notes = read_options(str(f))
    assert got == Options(full_pcpus_only=True, reserved=None, keep=2, strict_reservation=True)
    assert notes == []
