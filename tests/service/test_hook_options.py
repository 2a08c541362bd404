"""The hook's options: host roots alone give its paths without the Settings' module; a policy
given to ``vmpin hook`` behind a global option (vmpin.service.commands_agent) still reaches the
Settings a pass in the hook's process plans with."""

from __future__ import annotations

import pytest

from vmpin.service import hook
from vmpin.service.settings import Settings


def test_host_roots_give_the_paths_settings_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMPIN_VM_DIR", "/env/vm")
    monkeypatch.setenv("VMPIN_STATE_DIR", "/env/state")
    opts = {"state_dir": "/opt/state", "proc": "/opt/proc"}
    settings, paths = hook._settings(opts)
    assert settings is None
    assert paths == Settings.from_env(opts).paths
    assert (paths.state_dir, paths.vm_dir, paths.proc) == ("/opt/state", "/env/vm", "/opt/proc")
    assert hook._settings({}) == (None, Settings.from_env().paths)


def test_a_policy_option_builds_the_settings() -> None:
    opts = {"state_dir": "/opt/state", "helpers": "float", "vcpus": "float"}
    settings, paths = hook._settings(opts)
    assert settings == Settings.from_env(opts)
    assert paths == settings.paths
    assert paths.state_dir == "/opt/state"
    assert (settings.helpers, settings.vcpus, settings.given) == (
        "float",
        "float",
        ("helpers", "vcpus"),
    )


def test_an_unknown_option_is_refused_as_before() -> None:
    with pytest.raises(ValueError, match="unknown settings"):
        hook._settings({"state_dir": "/s", "nonsense": "1"})
