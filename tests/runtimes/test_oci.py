"""OCI state (a hook's stdin), config.json, `runc update -r` resources, and identify()."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import IdError, SpecError, VmpinError
from vmpin.linux.paths import HostPaths
from vmpin.runtimes.oci import (
    Identity,
    Resources,
    State,
    detect_runtime,
    identify,
    parse_config,
    parse_resources_json,
    parse_state,
    read_config,
)
from vmpin.wire.hookevent import STAGES

# -- state ------------------------------------------------------------------------------------

RUNC_STATE = {
    # What runc 1.1 hands a createRuntime hook (FACTS.md).
    "ociVersion": "1.0.2-dev",
    "id": "ctr1",
    "status": "creating",
    "pid": 7722,
    "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/ctr1",
    "annotations": {"io.kubernetes.cri.container-type": "container"},
}

KATA_STATE = {
    # Kata's shim: ociVersion and status empty, pid the VMM's.
    "ociVersion": "",
    "id": "3f2a9c",
    "status": "",
    "pid": 4242,
    "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/3f2a9c",
    "annotations": {"io.kubernetes.cri.container-type": "sandbox"},
}

POSTSTOP_STATE = {
    # poststop: the process is gone, so there is no pid.
    "ociVersion": "1.0.2-dev",
    "id": "ctr1",
    "status": "stopped",
    "bundle": "/b/ctr1",
}

VALID_STATES = [
    (
        "runc",
        RUNC_STATE,
        State(
            id="ctr1",
            status="creating",
            pid=7722,
            bundle=RUNC_STATE["bundle"],
            annotations={"io.kubernetes.cri.container-type": "container"},
            oci_version="1.0.2-dev",
        ),
    ),
    (
        "kata",
        KATA_STATE,
        State(
            id="3f2a9c",
            status="",
            pid=4242,
            bundle=KATA_STATE["bundle"],
            annotations={"io.kubernetes.cri.container-type": "sandbox"},
            oci_version="",
        ),
    ),
    ("poststop", POSTSTOP_STATE, State("ctr1", "stopped", None, "/b/ctr1", {}, "1.0.2-dev")),
    ("minimal", {"id": "a"}, State("a", "", None, "", {}, "")),
    (
        "null fields",
        {"id": "a", "status": None, "ociVersion": None, "pid": None, "annotations": None},
        State("a", "", None, "", {}, ""),
    ),
    ("pid 0 is no pid", {"id": "a", "pid": 0}, State("a", "", None, "", {}, "")),
    ("extra fields", {"id": "a", "whatever": [1]}, State("a", "", None, "", {}, "")),
    ("containerd id", {"id": "f" * 64}, State("f" * 64, "", None, "", {}, "")),
]


@pytest.mark.parametrize(("what", "obj", "state"), VALID_STATES, ids=[v[0] for v in VALID_STATES])
def test_parse_state(what: str, obj: dict[str, Any], state: State) -> None:
    text = json.dumps(obj)
    assert parse_state(text) == state
    assert parse_state(text.encode()) == state
    assert parse_state(text + "\n") == state


INVALID_STATES: list[tuple[str, str | bytes, type[Exception], str]] = [
    ("empty stdin", "", SpecError, "empty"),
    ("blank stdin", " \n", SpecError, "empty"),
    ("empty bytes", b"", SpecError, "empty"),
    ("broken JSON", '{"id": "a"', SpecError, "malformed JSON"),
    ("not JSON", "ctr1", SpecError, "malformed JSON"),
    ("not UTF-8", b'{"id": "\xff"}', SpecError, "malformed JSON"),
    ("array", "[]", SpecError, "JSON object"),
    ("string", '"ctr1"', SpecError, "JSON object"),
    ("null", "null", SpecError, "JSON object"),
    ("id missing", '{"pid": 1}', SpecError, "'id'"),
    ("id null", '{"id": null}', SpecError, "'id'"),
    ("id number", '{"id": 5}', SpecError, "'id'"),
    ("id empty", '{"id": ""}', SpecError, "'id'"),
    ("id list", '{"id": ["a"]}', SpecError, "'id'"),
    ("id ../x", '{"id": "../x"}', IdError, "'id'"),
    ("id ..", '{"id": ".."}', IdError, "'id'"),
    ("id with slash", '{"id": "a/b"}', IdError, "'id'"),
    ("id hidden", '{"id": ".a"}', IdError, "'id'"),
    ("id with space", '{"id": "a b"}', IdError, "'id'"),
    ("id with NUL", '{"id": "a\\u0000"}', IdError, "'id'"),
    ("id too long", json.dumps({"id": "a" * 1025}), IdError, "'id'"),
    ("pid negative", '{"id": "a", "pid": -1}', SpecError, "'pid'"),
    ("pid string", '{"id": "a", "pid": "12"}', SpecError, "'pid'"),
    ("pid float", '{"id": "a", "pid": 1.5}', SpecError, "'pid'"),
    ("pid bool", '{"id": "a", "pid": true}', SpecError, "'pid'"),
    ("pid object", '{"id": "a", "pid": {}}', SpecError, "'pid'"),
    ("bundle relative", '{"id": "a", "bundle": "b/c"}', SpecError, "'bundle'"),
    ("bundle dot", '{"id": "a", "bundle": "."}', SpecError, "'bundle'"),
    ("bundle number", '{"id": "a", "bundle": 1}', SpecError, "'bundle'"),
    ("status number", '{"id": "a", "status": 1}', SpecError, "'status'"),
    ("ociVersion number", '{"id": "a", "ociVersion": 1}', SpecError, "'ociVersion'"),
    ("annotations list", '{"id": "a", "annotations": []}', SpecError, "'annotations'"),
    ("annotations string", '{"id": "a", "annotations": "x"}', SpecError, "'annotations'"),
    ("annotation number", '{"id": "a", "annotations": {"k": 1}}', SpecError, "'k'"),
    ("annotation null", '{"id": "a", "annotations": {"k": null}}', SpecError, "'k'"),
    ("annotation object", '{"id": "a", "annotations": {"k": {}}}', SpecError, "'k'"),
]


@pytest.mark.parametrize(
    ("what", "text", "kind", "names"), INVALID_STATES, ids=[v[0] for v in INVALID_STATES]
)
def test_parse_state_invalid(
    what: str, text: str | bytes, kind: type[Exception], names: str
) -> None:
    with pytest.raises(kind) as err:
        parse_state(text, where="stdin")
    assert isinstance(err.value, VmpinError)
    message = str(err.value)
    assert message.startswith("stdin")
    assert names in message


def test_stages() -> None:
    assert STAGES == (
        "prestart",
        "createRuntime",
        "createContainer",
        "startContainer",
        "poststart",
        "poststop",
    )


# -- config.json ------------------------------------------------------------------------------


def _spec(cpu: dict[str, Any] | None = None, annotations: dict[str, Any] | None = None) -> str:
    """A runc-style config.json, with the parts vmpin does not read filled in."""
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2-dev",
        "process": {"args": ["sleep", "inf"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "ctr",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}],
            "resources": {"memory": {"limit": 1 << 30}, "devices": [{"allow": False}]},
        },
    }
    if cpu is not None:
        spec["linux"]["resources"]["cpu"] = cpu
    if annotations is not None:
        spec["annotations"] = annotations
    return json.dumps(spec)


CONFIGS = [
    ("cpus and mems", _spec({"shares": 1024, "cpus": "2-3", "mems": "0"}), "2-3", "0"),
    ("cpus only", _spec({"cpus": "0,56"}), "0,56", None),
    ("mems only", _spec({"mems": "0-1"}), None, "0-1"),
    ("cpu without cpus", _spec({"shares": 2, "quota": 50000, "period": 100000}), None, None),
    ("empty cpus", _spec({"cpus": "", "mems": ""}), None, None),
    ("whitespace cpus", _spec({"cpus": " 4-5\n"}), "4-5", None),
    ("null cpus", _spec({"cpus": None}), None, None),
    ("no cpu", _spec(), None, None),
    ("no resources", json.dumps({"linux": {"namespaces": []}}), None, None),
    ("null resources", json.dumps({"linux": {"resources": None}}), None, None),
    ("no linux", json.dumps({"ociVersion": "1.0.2"}), None, None),
    ("empty object", "{}", None, None),
    # forms the kernel accepts (bitmap_parselist) and runc passes to it verbatim
    ("trailing comma", _spec({"cpus": "0,"}), "0", None),
    ("empty group", _spec({"cpus": "1,,0"}), "0-1", None),
    ("stride", _spec({"cpus": "0-7:2/4"}), "0-1,4-5", None),
    # runc decodes with Go's encoding/json: keys match case-insensitively
    ("keys in other case", json.dumps({"Linux": {"RESOURCES": {"CPU": {"Cpus": "3"}}}}), "3", None),
]


@pytest.mark.parametrize(("what", "text", "cpus", "mems"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_parse_config(what: str, text: str, cpus: str | None, mems: str | None) -> None:
    config = parse_config(text)
    want = Resources(None if cpus is None else CpuSet.parse(cpus), mems)
    assert config.resources[:2] == want[:2]  # (the CPU limit: test_cpu_limit)
    assert config.annotations == {}


def test_parse_config_annotations() -> None:
    annotations = {"io.kubernetes.cri.sandbox-id": "sb1", "x": ""}
    assert parse_config(_spec(annotations=annotations)).annotations == annotations
    assert parse_config(_spec(annotations=annotations).encode()).annotations == annotations


INVALID_CONFIGS = [
    ("backwards cpus", _spec({"cpus": "9-2"}), "linux.resources.cpu.cpus"),
    ("open range", _spec({"cpus": "1-"}), "linux.resources.cpu.cpus"),
    ("only commas", _spec({"cpus": ","}), "linux.resources.cpu.cpus"),
    ("needs the CPU count", _spec({"cpus": "0-N"}), "linux.resources.cpu.cpus"),
    ("cpus number", _spec({"cpus": 3}), "linux.resources.cpu.cpus"),
    ("cpus list", _spec({"cpus": ["0"]}), "linux.resources.cpu.cpus"),
    ("mems number", _spec({"mems": 0}), "linux.resources.cpu.mems"),
    ("cpu not object", _spec("0-3"), "linux.resources.cpu"),  # type: ignore[arg-type]
    ("resources not object", json.dumps({"linux": {"resources": []}}), "linux.resources"),
    ("linux not object", json.dumps({"linux": "x"}), "linux"),
    ("annotations not object", _spec(annotations=["a"]), "annotations"),  # type: ignore[arg-type]
    ("annotation not string", _spec(annotations={"k": True}), "'k'"),
    ("broken JSON", "{", "malformed JSON"),
    ("not an object", "[]", "JSON object"),
    ("empty", "", "malformed JSON"),
]


@pytest.mark.parametrize(
    ("what", "text", "names"), INVALID_CONFIGS, ids=[c[0] for c in INVALID_CONFIGS]
)
def test_parse_config_invalid(what: str, text: str, names: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_config(text, where="/b/config.json")
    message = str(err.value)
    assert message.startswith("/b/config.json")
    assert names in message


def test_backwards_cpus_names_field_and_input() -> None:
    with pytest.raises(SpecError, match=r"linux\.resources\.cpu\.cpus.*'9-2'"):
        parse_config(_spec({"cpus": "9-2"}))


def _containerd_spec(cpu: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
    """A spec shaped as containerd's CRI writes one: most of its bytes are the process, the
    mounts and the seccomp profile, none of which parse_config reads."""
    spec: dict[str, Any] = json.loads(_spec(cpu, annotations))
    spec["process"] = {"args": ["/bin/sh"], "env": [f"V{i}=x" for i in range(20)],
                       "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"]}}  # fmt: skip
    spec["mounts"] = [{"destination": f"/m{i}", "type": "bind", "source": f"/s{i}",
                       "options": ["rbind", "ro"]} for i in range(10)]  # fmt: skip
    spec["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": [f"sys{i}" for i in range(300)], "action": "SCMP_ACT_ALLOW"},
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}]},
    ]}  # fmt: skip
    spec["linux"]["maskedPaths"] = ["/proc/kcore"]
    return spec


def test_parse_config_reads_only_its_members() -> None:
    """The members parse_config reads are what a whole read gives, in a containerd-sized
    spec, with Go's key matching (a "Linux" after "linux" is read too: its resources are the
    last ones); what it does not read is only checked to be JSON: nested past the depth
    limit there is no error (runc reads it), in the resources it is."""
    spec = _containerd_spec({"cpus": "2-3", "mems": "0", "quota": 200000, "period": 100000},
                            {"io.kubernetes.cri.sandbox-id": "sb1"})  # fmt: skip
    config = parse_config(json.dumps(spec).encode())
    assert config.resources == Resources(CpuSet([2, 3]), "0", 200000, 100000)
    assert config.annotations == {"io.kubernetes.cri.sandbox-id": "sb1"}
    text = json.dumps(spec)[:-1] + ', "Linux": {"Resources": {"cpu": {"mems": "1"}}}}'
    assert parse_config(text).resources == Resources(None, "1")
    text = json.dumps(spec)[:-1] + ', "Linux": {"namespaces": []}}'
    assert parse_config(text).resources == config.resources
    deep: Any = "x"
    for _ in range(100):
        deep = [deep]
    spec["linux"]["seccomp"]["x"] = spec["process"]["x"] = deep
    assert parse_config(json.dumps(spec)).resources.cpus == CpuSet([2, 3])
    spec["linux"]["resources"]["x"] = deep
    with pytest.raises(SpecError, match="nested too deeply"):
        parse_config(json.dumps(spec))
    with pytest.raises(SpecError, match="malformed JSON"):
        parse_config(json.dumps(_containerd_spec({}, {}))[:-1] + ', "mounts": [1,]}')


@pytest.mark.parametrize(
    ("annotations", "names"),
    [({"ok": "x", "k": "\ud800"}, "annotation 'k'"), ({"\udc00": "v"}, "annotation key"),
     ({"a": "b", "long": "x" * ((64 << 10) + 1)}, "annotation 'long'"),
     ({"x" * ((64 << 10) + 1): "v"}, "annotation key"),
     # two that fail: the first in the map's order is named (the map is checked at once,
     # then walked for its message)
     ({"ok": "x", "long": "x" * ((64 << 10) + 1), "k": "\ud800"}, "annotation 'long'"),
     ({"ok": "x", "k": "\ud800", "long": "x" * ((64 << 10) + 1)}, "annotation 'k'")],
)  # fmt: skip
def test_annotations_refused_are_named(annotations: dict[str, str], names: str) -> None:
    """The annotation refused is the one named."""
    with pytest.raises(SpecError, match=names):
        parse_config(json.dumps({"annotations": annotations}), where="/b/config.json")
    ok = {"a": "é", "b": "x" * (64 << 10)}
    assert parse_config(json.dumps({"annotations": ok})).annotations == ok


def test_read_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(_spec({"cpus": "1"}, {"a": "b"}))
    config = read_config(str(tmp_path))
    assert config.resources.cpus == CpuSet([1])
    assert config.annotations == {"a": "b"}


def test_read_config_missing(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"no config\.json"):
        read_config(str(tmp_path))


def test_read_config_names_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(_spec({"cpus": "3-1"}))
    with pytest.raises(SpecError, match=str(tmp_path / "config.json")):
        read_config(str(tmp_path))


# -- `runc update -r` ----------------------------------------------------------------------------

RESOURCES = [
    # The LinuxResources document `runc update -r FILE` reads.
    (
        "runc update example",
        {
            "memory": {"limit": 536870912, "reservation": 536870912, "swap": 536870912},
            "cpu": {"shares": 1024, "quota": 100000, "period": 100000, "cpus": "2-3", "mems": "0"},
            "blockIO": {"weight": 500},
        },
        "2-3",
        "0",
    ),
    ("cpus only", {"cpu": {"cpus": "5"}}, "5", None),
    ("shares only", {"cpu": {"shares": 512}}, None, None),
    ("cpu null", {"cpu": None}, None, None),
    ("memory only", {"memory": {"limit": 1}}, None, None),
    ("empty", {}, None, None),
    # what runc update -r accepts that a Python dict lookup would miss
    ("keys in other case", {"CPU": {"CPUS": "1-2", "Mems": "0"}}, "1-2", "0"),
    ("unified cpuset (cgroup v2)", {"unified": {"cpuset.cpus": "4-5"}}, "4-5", None),
    (
        "unified wins over cpu.cpus",
        {"cpu": {"cpus": "1"}, "unified": {"cpuset.cpus": "2"}},
        "2",
        None,
    ),
    ("unified other keys", {"unified": {"cpu.weight": "100"}}, None, None),
    ("stride", {"cpu": {"cpus": "0-7:2/4"}}, "0-1,4-5", None),
]


def test_repeated_keys_decode_as_go_does() -> None:
    # the last value wins, whatever its case; null leaves the earlier one
    text = '{"cpu": {"cpus": "1"}, "Cpu": {"CPUS": "2", "cpus": null}}'
    assert parse_resources_json(text, "-r").cpus == CpuSet.parse("2")


@pytest.mark.parametrize(("what", "obj", "cpus", "mems"), RESOURCES, ids=[r[0] for r in RESOURCES])
def test_parse_resources_json(
    what: str, obj: dict[str, Any], cpus: str | None, mems: str | None
) -> None:
    want = Resources(None if cpus is None else CpuSet.parse(cpus), mems)
    assert parse_resources_json(json.dumps(obj), "-r")[:2] == want[:2]
    assert parse_resources_json(json.dumps(obj).encode(), "-r")[:2] == want[:2]


@pytest.mark.parametrize(
    ("cpu", "quota", "period", "whole"),
    [
        ({"quota": 200000, "period": 100000}, 200000, 100000, 2),  # kubelet: limit 2
        ({"quota": 150000, "period": 100000}, 150000, 100000, None),  # 1.5: not whole
        ({"quota": -1, "period": 100000}, -1, 100000, None),  # no limit
        ({"shares": 1024}, None, None, None),
        ({"Quota": 300000, "PERIOD": 100000}, 300000, 100000, 3),  # Go's folded keys
        ({"quota": 1.5, "period": 100000}, None, 100000, None),  # not an int64: left out
        ({"quota": 100000, "period": 0}, 100000, 0, None),
    ],
)
def test_cpu_limit(cpu: dict[str, Any], quota: int | None, period: int | None,
                   whole: int | None) -> None:  # fmt: skip
    """The CFS limit, read for the count vmpin's allocation takes from it (issue 30)."""
    r = parse_config(_spec(cpu)).resources
    assert (r.quota, r.period, r.whole_cpus) == (quota, period, whole)


INVALID_RESOURCES = [
    ("backwards", '{"cpu": {"cpus": "3-1"}}', "-r.cpu.cpus"),
    ("not a list", '{"cpu": {"cpus": "a"}}', "-r.cpu.cpus"),
    ("cpus number", '{"cpu": {"cpus": 1}}', "-r.cpu.cpus"),
    ("mems list", '{"cpu": {"mems": [0]}}', "-r.cpu.mems"),
    ("cpu string", '{"cpu": "1"}', "-r.cpu"),
    ("unified cpuset number", '{"unified": {"cpuset.cpus": 1}}', "-r.unified.cpuset.cpus"),
    ("upper-case cpus number", '{"CPU": {"CPUS": 1}}', "-r.cpu.cpus"),
    ("array", "[]", "JSON object"),
    ("null", "null", "JSON object"),
    ("broken", '{"cpu":', "malformed JSON"),
    ("empty", "", "malformed JSON"),
]


@pytest.mark.parametrize(
    ("what", "text", "names"), INVALID_RESOURCES, ids=[r[0] for r in INVALID_RESOURCES]
)
def test_parse_resources_json_invalid(what: str, text: str, names: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_resources_json(text, "-r")
    assert names in str(err.value)


# -- identify ----------------------------------------------------------------------------------

POD = {
    "pod_uid": "8c5f0e4e-1f4a-4f55-9a53-2b6cfb3c9e1d",
    "pod_name": "web-0",
    "pod_namespace": "prod",
}

CONTAINERD_SANDBOX = {
    "io.kubernetes.cri.container-type": "sandbox",
    "io.kubernetes.cri.sandbox-id": "sb1",
    "io.kubernetes.cri.sandbox-name": "web-0",
    "io.kubernetes.cri.sandbox-namespace": "prod",
    "io.kubernetes.cri.sandbox-uid": POD["pod_uid"],
    "io.kubernetes.cri.sandbox-log-directory": "/var/log/pods/prod_web-0_8c5f",
}
CONTAINERD_CONTAINER = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.container-name": "app",
    "io.kubernetes.cri.image-name": "docker.io/library/nginx:1.25",
    "io.kubernetes.cri.sandbox-id": "sb1",
    "io.kubernetes.cri.sandbox-name": "web-0",
    "io.kubernetes.cri.sandbox-namespace": "prod",
    "io.kubernetes.cri.sandbox-uid": POD["pod_uid"],
}
CRIO_SANDBOX = {
    "io.kubernetes.cri-o.ContainerType": "sandbox",
    "io.kubernetes.cri-o.SandboxID": "sb1",
    "io.kubernetes.cri-o.ContainerName": "k8s_POD_web-0_prod_8c5f_0",
    "io.kubernetes.pod.uid": POD["pod_uid"],
    "io.kubernetes.pod.name": "web-0",
    "io.kubernetes.pod.namespace": "prod",
    "io.kubernetes.container.name": "POD",
}
CRIO_CONTAINER = {
    "io.kubernetes.cri-o.ContainerType": "container",
    "io.kubernetes.cri-o.SandboxID": "sb1",
    "io.kubernetes.cri-o.Name": "k8s_app_web-0_prod_8c5f_0",
    "io.kubernetes.pod.uid": POD["pod_uid"],
    "io.kubernetes.pod.name": "web-0",
    "io.kubernetes.pod.namespace": "prod",
    "io.kubernetes.container.name": "app",
}
# podman (libpod) writes CRI-O's keys for pod members, and says who it is.
PODMAN_INFRA = {
    "io.container.manager": "libpod",
    "io.kubernetes.cri-o.ContainerType": "sandbox",
    "io.kubernetes.cri-o.SandboxID": "infra1",
    "io.kubernetes.cri-o.TTY": "false",
}
PODMAN_MEMBER = {
    "io.container.manager": "libpod",
    "io.kubernetes.cri-o.ContainerType": "container",
    "io.kubernetes.cri-o.SandboxID": "infra1",
    "io.kubernetes.cri-o.TTY": "false",
}
PODMAN_ALONE = {"io.container.manager": "libpod", "org.opencontainers.image.stopSignal": "15"}
KATA_SANDBOX = {"io.katacontainers.pkg.oci.container_type": "pod_sandbox"}
KATA_CONTAINER = {
    "io.katacontainers.pkg.oci.container_type": "pod_container",
    "io.katacontainers.pkg.oci.bundle_path": "/run/containerd/k8s.io/c1",
    "io.kubernetes.cri.sandbox-id": "sb1",
    "io.kubernetes.cri.container-name": "app",
}
DOCKERSHIM_SANDBOX = {
    "io.kubernetes.docker.type": "podsandbox",
    "io.kubernetes.pod.name": "web-0",
    "io.kubernetes.pod.namespace": "prod",
    "io.kubernetes.pod.uid": POD["pod_uid"],
}
DOCKERSHIM_CONTAINER = {
    "io.kubernetes.docker.type": "container",
    "io.kubernetes.sandbox.id": "sb1",
    "io.kubernetes.container.name": "app",
    "io.kubernetes.pod.name": "web-0",
    "io.kubernetes.pod.namespace": "prod",
    "io.kubernetes.pod.uid": POD["pod_uid"],
}

IDENTIFY = [
    ("containerd sandbox", "sb1", CONTAINERD_SANDBOX, Identity("sb1", "sb1", True, **POD)),
    (
        "containerd container",
        "c1",
        CONTAINERD_CONTAINER,
        Identity("c1", "sb1", False, name="app", **POD),
    ),
    ("cri-o sandbox", "sb1", CRIO_SANDBOX, Identity("sb1", "sb1", True, name="POD", **POD)),
    ("cri-o container", "c1", CRIO_CONTAINER, Identity("c1", "sb1", False, name="app", **POD)),
    ("podman infra", "infra1", PODMAN_INFRA, Identity("infra1", "infra1", True)),
    ("podman pod member", "c2", PODMAN_MEMBER, Identity("c2", "infra1", False)),
    ("podman alone", "c3", PODMAN_ALONE, Identity("c3", "c3", True)),
    ("kata sandbox", "sb1", KATA_SANDBOX, Identity("sb1", "sb1", True)),
    ("kata container", "c1", KATA_CONTAINER, Identity("c1", "sb1", False, name="app")),
    # Kata says "container" but nothing names its sandbox: it is not invented.
    (
        "kata container, no sandbox id",
        "c1",
        {"io.katacontainers.pkg.oci.container_type": "pod_container"},
        Identity("c1", "c1", False),
    ),
    ("dockershim sandbox", "sb1", DOCKERSHIM_SANDBOX, Identity("sb1", "sb1", True, **POD)),
    (
        "dockershim container",
        "c1",
        DOCKERSHIM_CONTAINER,
        Identity("c1", "sb1", False, name="app", **POD),
    ),
    ("no annotations", "ctr1", {}, Identity("ctr1", "ctr1", True)),
    ("unrelated annotations", "ctr1", {"org.example/x": "y"}, Identity("ctr1", "ctr1", True)),
    # No type key: a sandbox id naming another container makes this a member.
    (
        "sandbox id only",
        "c1",
        {"io.kubernetes.cri.sandbox-id": "sb1"},
        Identity("c1", "sb1", False),
    ),
    (
        "sandbox id = own id",
        "sb1",
        {"io.kubernetes.cri.sandbox-id": "sb1"},
        Identity("sb1", "sb1", True),
    ),
    # A sandbox is its own sandbox whatever its annotations repeat.
    (
        "sandbox naming another sandbox",
        "sb2",
        {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": "sb1"},
        Identity("sb2", "sb2", True),
    ),
    # First source wins per field: containerd's keys before CRI-O's.
    (
        "containerd before cri-o",
        "c1",
        {**CRIO_CONTAINER, **CONTAINERD_CONTAINER, "io.kubernetes.cri-o.SandboxID": "other"},
        Identity("c1", "sb1", False, name="app", **POD),
    ),
    # Empty values count as absent.
    (
        "empty values",
        "c1",
        {
            "io.kubernetes.cri.container-type": "",
            "io.kubernetes.cri.sandbox-id": "",
            "io.kubernetes.cri-o.SandboxID": "sb1",
        },
        Identity("c1", "sb1", False),
    ),
]


@pytest.mark.parametrize(
    ("what", "cid", "annotations", "identity"), IDENTIFY, ids=[i[0] for i in IDENTIFY]
)
def test_identify(what: str, cid: str, annotations: dict[str, str], identity: Identity) -> None:
    assert identify(cid, annotations) == identity


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", ".x", "x y"])
def test_identify_refuses_bad_sandbox_id(bad: str) -> None:
    with pytest.raises(IdError, match="sandbox id"):
        identify("c1", {"io.kubernetes.cri.sandbox-id": bad})


def test_state_and_config_together(tmp_path: Path) -> None:
    """A createRuntime hook's path: state from stdin, config from its bundle, then who it is."""
    (tmp_path / "config.json").write_text(_spec({"cpus": "8-9"}, CONTAINERD_CONTAINER))
    state = parse_state(json.dumps({**RUNC_STATE, "id": "c1", "bundle": str(tmp_path)}))
    config = read_config(state.bundle)
    who = identify(state.id, config.annotations)
    assert (who.sandbox_id, who.name, config.resources.cpus) == ("sb1", "app", CpuSet([8, 9]))


# -- the runtime, from the state's pid ----------------------------------------------------------
def test_a_pid_whose_command_line_names_the_sandbox_is_asked_about_as_its_vmm(
    paths: HostPaths, mocker: Any
) -> None:
    """No VM dir: the state's pid tells (Kata's VMM, named ``-name sandbox-<id>``).  A pid
    whose command line does not hold the sandbox's id -- a runc container's init, at every
    plain start -- is runc without a look at vmpin.runtimes.vmm; one that does is asked
    about as before (here a process with QEMU's argv, run by the VM dir's owner: root, as
    the VM dir is missing)."""
    import signal
    import subprocess

    from tests.support.qemu_util import wait_until
    from tests.support.session import new_id
    from vmpin.linux import procfs
    from vmpin.runtimes import vmm

    sid = new_id("rt")
    asked = mocker.spy(vmm, "is_vmm_of")
    assert detect_runtime(paths, sid, os.getpid()) == "runc"
    assert detect_runtime(paths, sid, 1 << 22) == "runc"  # (no such process)
    asked.assert_not_called()
    poser = subprocess.Popen(
        ["qemu-system-x86_64", "-c", "sleep 60; :", "qemu", "-name", f"sandbox-{sid}"],
        executable="/bin/sh", start_new_session=True,
    )  # fmt: skip
    try:
        # (the shell's child has the same argv until it has exec'd sleep: wait for the shell's
        # own command line, which is what the check reads)
        assert wait_until(lambda: f"sandbox-{sid}" in procfs.read_text(paths.proc, poser.pid,
                                                                       "cmdline"), 5)  # fmt: skip
        assert detect_runtime(paths, sid, poser.pid) == "kata"
        assert asked.call_count == 1
        # the hook's start time, read before: the command line is read once, and a start
        # time that is not the pid's (reused since) is no VMM
        start = procfs.start_time(paths.proc, poser.pid)
        reads = mocker.spy(procfs, "read_text")
        assert detect_runtime(paths, sid, poser.pid, start) == "kata"
        assert [c.args[2] for c in reads.call_args_list].count("cmdline") == 1
        assert detect_runtime(paths, sid, poser.pid, start - 1) == "runc"
        asked.reset_mock()
        assert detect_runtime(paths, new_id("other"), poser.pid) == "runc"
        asked.assert_not_called()  # (its command line does not name that sandbox)
    finally:
        os.killpg(poser.pid, signal.SIGKILL)
        poser.wait()
