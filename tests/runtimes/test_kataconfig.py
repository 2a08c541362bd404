"""Kata's configuration files and its own vCPU pinning (vmpin.runtimes.kataconfig), table-driven.

Each case writes real files in a temporary tree laid out as Kata's (``/etc/kata-containers``,
``/usr/share/defaults/kata-containers``, kata-deploy's ``/opt/kata/share/defaults/...``) and
reads it with the same search list syntax as ``--kata-config``.  The TOML bodies are cut from
Kata's shipped ``configuration-qemu.toml`` (its ``[runtime]`` table), with the key changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pytest_mock import MockerFixture

from vmpin.runtimes import kataconfig
from vmpin.runtimes.kataconfig import KataConfig, KataConfigReader, KataConfigs, candidates, read

ROOT = Path(__file__).resolve().parents[2]

#: Kata's [runtime] table as shipped, with enable_vcpus_pinning set to {value}
RUNTIME = """\
[hypervisor.qemu]
path = "/opt/kata/bin/qemu-system-x86_64"
default_vcpus = 1

[runtime]
enable_debug = false
internetworking_model = "tcfilter"
# If enabled, each vCPU thread will be scheduled to a fixed CPU
# qualified condition: num(vCPU threads) == num(CPUs in sandbox's CPUSet)
{line}
sandbox_cgroup_only = true
static_sandbox_resource_mgmt = false
"""


def body(value: str | None) -> str:
    return RUNTIME.format(line="" if value is None else f"enable_vcpus_pinning = {value}")


ETC = "etc/kata-containers/configuration.toml"
USR = "usr/share/defaults/kata-containers/configuration.toml"
OPT = "opt/kata/share/defaults/kata-containers"
#: the default search list, under a test's root
SPEC = f"{{r}}/{ETC}|{{r}}/{USR}:{{r}}/{OPT}/configuration*.toml"


@dataclass
class Case:
    name: str
    files: dict[str, str]
    #: (path relative to the root, pinning) for every file read, in order
    want: list[tuple[str, bool | None]]
    pinning: bool
    #: a piece of the one-line error of each unreadable file
    errors: list[str] = field(default_factory=list)
    spec: str = SPEC


CASES = [
    Case("no-kata-configuration", {}, [], False),
    Case("etc-true", {ETC: body("true")}, [(ETC, True)], True),
    Case("etc-false", {ETC: body("false")}, [(ETC, False)], False),
    Case("key-absent-is-kata-default-false", {ETC: body(None)}, [(ETC, False)], False),
    Case("no-runtime-table", {ETC: '[hypervisor.qemu]\npath = "/q"\n'}, [(ETC, False)], False),
    # Kata reads the first of its two default paths: /etc's overrides /usr/share's
    Case("etc-overrides-usr-share", {ETC: body("false"), USR: body("true")}, [(ETC, False)],
         False),
    Case("usr-share-when-no-etc", {USR: body("true")}, [(USR, True)], True),
    # kata-deploy: one file per runtime class, each read (nothing says which a pod uses)
    Case("per-runtime-class-files",
         {f"{OPT}/configuration-qemu.toml": body("true"),
          f"{OPT}/configuration-clh.toml": body("false")},
         [(f"{OPT}/configuration-clh.toml", False), (f"{OPT}/configuration-qemu.toml", True)],
         True),
    Case("malformed-toml",
         {ETC: "[runtime]\nenable_vcpus_pinning = tru\n"}, [(ETC, None)], False,
         ["not valid TOML", "line 2"]),
    Case("not-a-boolean", {ETC: body('"yes"')}, [(ETC, None)], False,
         ["enable_vcpus_pinning = 'yes': not a boolean"]),
    Case("runtime-not-a-table", {ETC: 'runtime = "qemu"\n'}, [(ETC, None)], False,
         ["[runtime] is not a table"]),
    Case("not-utf8", {ETC: "\udcff"}, [(ETC, None)], False, ["not UTF-8"]),
    # one bad file does not hide another's answer
    Case("malformed-beside-a-pinning-file",
         {ETC: "[runtime\n", f"{OPT}/configuration-qemu.toml": body("true")},
         [(ETC, None), (f"{OPT}/configuration-qemu.toml", True)], True, ["not valid TOML"]),
    Case("none-lists-nothing", {ETC: body("true")}, [], False, spec="none"),
]


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode("utf-8", "surrogateescape"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_read(case: Case, tmp_path: Path) -> None:
    write(tmp_path, case.files)
    spec = case.spec.format(r=tmp_path)
    found = read(spec)
    assert [(os.path.relpath(f.path, tmp_path), f.pinning) for f in found.files] == case.want
    assert found.pinning is case.pinning
    errors = [f.error for f in found.files if f.error is not None]
    assert len(errors) == (1 if case.errors else 0)
    for piece in case.errors:
        assert any(piece in e for e in errors), (piece, errors)
    for e in errors:
        assert "\n" not in e and str(tmp_path) in e  # one line, naming the file
    # what audit and doctor print: one line per file, the pinning and the unreadable ones
    lines = found.lines(spec)
    assert len(lines) == max(1, len(case.want))
    assert all("\n" not in line for line in lines)
    assert len(found.notes()) == sum(1 for _, p in case.want if p is not False)


def test_symlinked_configuration_is_read_once(tmp_path: Path) -> None:
    """kata-deploy links configuration.toml to a runtime class's file: one file, one line."""
    write(tmp_path, {f"{OPT}/configuration-qemu.toml": body("true")})
    (tmp_path / OPT / "configuration.toml").symlink_to("configuration-qemu.toml")
    found = read(f"{tmp_path}/{OPT}/configuration*.toml")
    assert [Path(f.path).name for f in found.files] == ["configuration-qemu.toml"]
    # and a link is followed (Kata follows it), not refused as vmpin refuses planted links
    found = read(f"{tmp_path}/{OPT}/configuration.toml")
    assert [(Path(f.path).name, f.pinning) for f in found.files] == [("configuration.toml", True)]


@pytest.mark.parametrize(
    ("name", "pattern", "match"),
    [("configuration-qemu.toml", "configuration*.toml", True),
     ("configuration.toml", "configuration*.toml", True),
     ("configuration.toml.bak", "configuration*.toml", False),
     ("xconfiguration.toml", "configuration*.toml", False),
     ("configuration-qemu-snp.toml", "configuration-*-*.toml", True),
     ("configuration-qemu.toml", "configuration-*-*.toml", False),
     ("a.toml", "*", True)],
)
def test_match(name: str, pattern: str, match: bool) -> None:
    assert kataconfig._match(name, pattern) is match


def test_unreadable_file_is_one_line(tmp_path: Path) -> None:
    fifo = tmp_path / "configuration.toml"
    os.mkfifo(fifo)
    [f] = KataConfigs((kataconfig.read_file(str(fifo)),)).files
    assert f.pinning is None and f.error is not None
    assert f.error.startswith(str(fifo)) and "FIFO" in f.error


def test_cache_is_used_while_the_files_stand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    write(tmp_path, {ETC: body("true")})
    spec, cache = f"{tmp_path}/{ETC}", str(tmp_path / "kata-config.json")
    first = KataConfigReader(spec, cache).read()
    assert first.pinning and json.loads(Path(cache).read_text())["v"] == 1
    # a new process (a new reader) takes the answer from the cache, parsing nothing
    def refuse(path: str) -> KataConfig:
        raise AssertionError(f"parsed {path}")

    monkeypatch.setattr(kataconfig, "read_file", refuse)
    assert KataConfigReader(spec, cache).read() == first
    # a changed file is parsed again
    monkeypatch.undo()
    (tmp_path / ETC).write_text(body("false") + "\n# edited\n")
    again = KataConfigReader(spec, cache).read()
    assert again.pinning is False
    # save=False (a read-only view) leaves the state dir as it found it
    os.unlink(cache)
    KataConfigReader(spec, cache).read(save=False)
    assert not os.path.exists(cache)


def test_reader_reparses_only_on_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's observer keeps one reader: a stat per file per pass, a parse per change."""
    write(tmp_path, {ETC: body("true")})
    parsed: list[str] = []
    real = kataconfig.read_file
    monkeypatch.setattr(kataconfig, "read_file", lambda p: parsed.append(p) or real(p))
    reader = KataConfigReader(f"{tmp_path}/{ETC}")
    for _ in range(3):
        assert reader.read().pinning
    assert len(parsed) == 1
    (tmp_path / ETC).write_text(body("false"))
    assert not reader.read().pinning and len(parsed) == 2
    (tmp_path / ETC).unlink()
    assert reader.read() == KataConfigs()


def test_candidates_alternatives_and_order(tmp_path: Path) -> None:
    write(tmp_path, {USR: "", f"{OPT}/configuration-b.toml": "", f"{OPT}/configuration-a.toml": ""})
    spec = f"{tmp_path}/missing.toml|{tmp_path}/{USR}::{tmp_path}/{OPT}/configuration*.toml"
    got = candidates(spec)
    assert [os.path.relpath(p, tmp_path) for p in got] == [
        USR, f"{OPT}/configuration-a.toml", f"{OPT}/configuration-b.toml"]


def test_cached_answer_keeps_tomllib_off_the_hook_path(tmp_path: Path) -> None:
    """A process that finds the answer cached imports neither tomllib nor re (the hook's rule:
    tests/service/test_hook_imports.py); one that must parse does, once."""
    write(tmp_path, {ETC: body("true")})
    spec, cache = f"{tmp_path}/{ETC}", str(tmp_path / "kata-config.json")
    probe = (
        "import sys\n"
        "from vmpin.runtimes.kataconfig import KataConfigReader\n"
        f"found = KataConfigReader({spec!r}, {cache!r}).read()\n"
        "print(found.pinning, 'tomllib' in sys.modules, 're' in sys.modules)\n"
    )

    def run() -> str:
        return subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True,
                              text=True, check=True, env={"PYTHONPATH": str(ROOT)},
                              timeout=60).stdout.strip()

    assert run() == "True True True"  # no cache yet: parsed (and the answer kept)
    assert run() == "True False False"  # the cache stands: nothing parsed, nothing imported


def test_a_readers_pass_stats_each_file_once(tmp_path: Path, mocker: MockerFixture) -> None:
    """The agent's observer reads the search list at every pass (issue 28): the list taken
    apart once, then one ``stat`` a file (a link followed: no path resolved component by
    component) and one of a pattern's directory, listed again only when it changed (a file
    that comes is found)."""
    from vmpin.linux.files import SETTLE_NS

    write(tmp_path, {USR: body("true"), f"{OPT}/configuration-qemu.toml": body("false")})
    (tmp_path / OPT / "configuration.toml").symlink_to("configuration-qemu.toml")
    spec = f"{tmp_path}/{ETC}|{tmp_path}/{USR}:{tmp_path}/{OPT}/configuration*.toml"
    time.sleep(2 * SETTLE_NS / 1e9)  # (the directory's version old enough to be kept)
    reader = KataConfigReader(spec)
    first = reader.read()
    assert [Path(f.path).name for f in first.files] == ["configuration.toml",
                                                         "configuration-qemu.toml"]
    stat = mocker.spy(kataconfig.os, "stat")
    listdir = mocker.spy(kataconfig.os, "listdir")
    realpath = mocker.spy(kataconfig.os.path, "realpath")
    assert reader.read() is first
    # ETC missing, USR, OPT, then the two names in OPT (the link is the file it points to)
    assert stat.call_count == 5 and listdir.call_count == 0 and realpath.call_count == 0
    write(tmp_path, {f"{OPT}/configuration-clh.toml": body("true")})
    again = reader.read()
    assert listdir.call_count == 1
    assert [Path(f.path).name for f in again.files] == [
        "configuration.toml", "configuration-clh.toml", "configuration-qemu.toml"]
    assert again.pinning
