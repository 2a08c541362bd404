"""vmpin.runtimes.containerdconf: base_runtime_spec added to containerd's config.toml in place.

Table-driven over config layouts seen on nodes; where containerd is installed, its own
``containerd --config F config dump`` (which starts no daemon) is the judge: the edited config
must load as the original with ``base_runtime_spec`` set on exactly the runc and Kata
handlers.  The last test shows why it is not a drop-in: the same key through ``imports``
wipes the node's CRI settings in containerd 1.x.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vmpin.runtimes import containerdconf as cc

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (so is the config editor)

SPECS = {"runc": "/opt/vmpin/containerd/base-runtime-spec-runc.json",
         "kata": "/opt/vmpin/containerd/base-runtime-spec-kata.json"}  # fmt: skip
V2 = 'plugins."io.containerd.grpc.v1.cri".containerd.runtimes'
V3 = "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes"

#: name -> (config.toml, {handler: kind given a base spec})
LAYOUTS = {
    "config default (empty key)": (
        f'version = 2\n[{V2}.runc]\n  base_runtime_spec = ""\n'
        f'  runtime_type = "io.containerd.runc.v2"\n  [{V2}.runc.options]\n'
        "    SystemdCgroup = true\n",
        {"runc": "runc"},
    ),
    "kata-deploy handlers": (
        f'version = 2\n[{V2}.runc]\nruntime_type = "io.containerd.runc.v2"\n'
        f'[{V2}.kata-qemu]\nruntime_type = "io.containerd.kata-qemu.v2"\n'
        f'[{V2}.kata-clh]\nruntime_type = "io.containerd.kata-clh.v2"\n'
        f'[{V2}."kata.io"]\nruntime_type = "io.containerd.kata.v2"\n',
        {"runc": "runc", "kata-qemu": "kata", "kata-clh": "kata", "kata.io": "kata"},
    ),
    "only a sub-table names the handler": (
        f'version = 2\n[{V2}.runc.options]\n  SystemdCgroup = true\n'
        f'[{V2}.runc]\n  runtime_type = "io.containerd.runc.v2"\n',
        {"runc": "runc"},
    ),
    "implicit handler table": (
        f'version = 2\n[{V2}.runc.options]\n  SystemdCgroup = true\n'
        f'[{V2}.crun]\n  runtime_type = "io.containerd.runc.v2"\n',
        {"crun": "runc"},
    ),
    "no handler at all: containerd's default runc": (
        'version = 2\nroot = "/var/lib/containerd"\n[plugins."io.containerd.grpc.v1.cri"]\n'
        '  sandbox_image = "example/pause:1"\n',
        {"runc": "runc"},
    ),
    "other runtimes left alone": (
        f'version = 2\n[{V2}.runsc]\n  runtime_type = "io.containerd.runsc.v1"\n'
        f'[{V2}.runc]\n  runtime_type = "io.containerd.runc.v2"  # the default\n',
        {"runc": "runc"},
    ),
    "containerd 2.x (version 3)": (
        f"version = 3\n[{V3}.runc]\n  runtime_type = 'io.containerd.runc.v2'\n"
        f"[{V3}.kata]\n  runtime_type = 'io.containerd.kata.v2'\n",
        {"runc": "runc", "kata": "kata"},
    ),
    "no trailing newline": (
        f'version = 2\n[{V2}.runc]\n  runtime_type = "io.containerd.runc.v2"',
        {"runc": "runc"},
    ),
}


def handlers(doc: dict[str, object]) -> dict[str, dict[str, object]]:
    plugins = doc["plugins"]
    assert isinstance(plugins, dict)
    plugin = plugins.get("io.containerd.grpc.v1.cri") or plugins["io.containerd.cri.v1.runtime"]
    out: dict[str, dict[str, object]] = plugin["containerd"]["runtimes"]
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_edit(name: str) -> None:
    text, want = LAYOUTS[name]
    new, notes = cc.edit(text, SPECS, "config.toml")
    got = {h: t.get("base_runtime_spec") for h, t in handlers(tomllib.loads(new)).items()}
    assert {h: v for h, v in got.items() if v} == {h: SPECS[k] for h, k in want.items()}
    assert len(notes) >= len(want)
    # idempotent: vmpin's own path is left as it is
    again, _ = cc.edit(new, SPECS, "config.toml")
    assert again == new
    # and every line it added is marked: strip gives the original back (trailing newline aside)
    assert cc.strip(new) == (text if text.endswith("\n") else text + "\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'version = 2\n[{V2}.runc]\n  base_runtime_spec = "/etc/gpu.json"\n'
         '  runtime_type = "io.containerd.runc.v2"\n',
         "handler runc already has base_runtime_spec '/etc/gpu.json'"),
        ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n'
         '  runtimes.runc.runtime_type = "io.containerd.runc.v2"\n',
         "could not add base_runtime_spec to it safely"),
        ('[plugins.cri.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"\n',
         "config version 1: vmpin edits versions 2"),
        ("version = 4\n", "config version 4"),
        ("version = 2\n[a\n", "not valid TOML"),
    ],
)  # fmt: skip
def test_refused(text: str, message: str) -> None:
    with pytest.raises(cc.ContainerdConfigError, match=message.replace("[", r"\[")):
        cc.edit(text, SPECS, "config.toml")


@pytest.mark.parametrize(
    ("line", "keys"),
    [
        ('[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]',
         ("plugins", "io.containerd.grpc.v1.cri", "containerd", "runtimes", "runc")),
        ("  [ plugins . 'io.containerd.cri.v1.runtime' . x ]  # c",
         ("plugins", "io.containerd.cri.v1.runtime", "x")),
        ('[a."b\\"c"]', ("a", 'b"c')),
        ("[[array]]", None),
        ("key = [1]", None),
        ("[a] b", None),
        ("[a.]", None),
    ],
)  # fmt: skip
def test_header_keys(line: str, keys: tuple[str, ...] | None) -> None:
    assert cc.header_keys(line) == keys


# -- containerd itself ------------------------------------------------------------------------
needs_containerd = pytest.mark.skipif(shutil.which("containerd") is None,
                                      reason="containerd is not installed")  # fmt: skip


def dump(config: Path) -> list[str]:
    """``containerd config dump``: the config as containerd loads it (no daemon started)."""
    out = subprocess.run(["containerd", "--config", str(config), "config", "dump"],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return [ln for ln in out.stdout.splitlines() if not ln.startswith("imports = ")]


def diff(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    assert len(a) == len(b)
    return [(x.strip(), y.strip()) for x, y in zip(a, b, strict=True) if x != y]


@needs_containerd
def test_containerd_loads_exactly_the_added_keys(tmp_path: Path) -> None:
    default = subprocess.run(["containerd", "config", "default"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    kata = (f'\n    [{V2}.kata-qemu]\n      runtime_type = "io.containerd.kata-qemu.v2"\n'
            f'      [{V2}.kata-qemu.options]\n        ConfigPath = "/opt/kata/qemu.toml"\n')
    text = default.replace(f"\n      [{V2}]\n", f"\n      [{V2}]\n{kata}", 1)
    assert text != default
    before, after = tmp_path / "before.toml", tmp_path / "after.toml"
    before.write_text(text)
    after.write_text(cc.edit(text, SPECS, "config.toml")[0])
    assert sorted(diff(dump(before), dump(after))) == [
        ('base_runtime_spec = ""', f'base_runtime_spec = "{SPECS["kata"]}"'),
        ('base_runtime_spec = ""', f'base_runtime_spec = "{SPECS["runc"]}"'),
    ]


@needs_containerd
def test_a_drop_in_would_wipe_the_nodes_cri_settings(tmp_path: Path) -> None:
    """Why vmpin edits config.toml: containerd 1.x merges an imported file plugin by plugin,
    so a drop-in that only adds base_runtime_spec replaces the whole CRI section."""
    version = subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout
    if " 1." not in version:
        pytest.skip(f"containerd 2.x merges imports key by key: {version}")
    drop = tmp_path / "vmpin.toml"
    drop.write_text(f'version = 2\n[{V2}.runc]\n  base_runtime_spec = "{SPECS["runc"]}"\n')
    main = tmp_path / "config.toml"
    main.write_text(f'version = 2\nimports = ["{drop}"]\n[plugins."io.containerd.grpc.v1.cri"]\n'
                    f'  sandbox_image = "example/pause:9"\n[{V2}.runc]\n'
                    '  runtime_type = "io.containerd.runc.v2"\n')  # fmt: skip
    loaded = "\n".join(dump(main))
    assert f'base_runtime_spec = "{SPECS["runc"]}"' in loaded
    assert "example/pause:9" not in loaded  # the node's sandbox image: gone
    assert 'runtime_type = "io.containerd.runc.v2"' not in loaded  # runc's type: gone
