"""The guest map's wire format (vmpin.wire.guestmap): what the host writes, the guest reads."""

from __future__ import annotations

import json

import pytest

from vmpin.core.errors import WireError
from vmpin.wire import guestmap as wire

BUILT = {
    "sandbox": "sb",
    "mode": "1:1",
    "nvcpus": 2,
    "vcpu_to_host": {"0": 1, "1": 0},
    "siblings": [[0], [1]],
    "containers": {
        "c": {"container": "c", "sandbox": "sb", "host_cpus": "1", "guest_cpus": "0",
              "exact": True, "mode": "1:1", "reason": "1:1", "generation": 3},
    },
}


def test_round_trip() -> None:
    doc = wire.document("sb", BUILT, generation=4)
    m = wire.from_json(wire.to_json(doc))
    assert (m.sandbox, m.generation, m.mode, m.nvcpus) == ("sb", 4, "1:1", 2)
    assert m.vcpu_to_host == {"0": 1, "1": 0}
    assert m.entry("c") == wire.Entry("c", frozenset({0}), True, "1:1", "1:1", 3)
    assert m.entry("other") is None
    # content without a generation is what publish compares
    assert "generation" not in wire.document("sb", BUILT)


def test_entry_generation_defaults_to_the_map_s() -> None:
    doc = wire.document("sb", BUILT, generation=7)
    del doc["containers"]["c"]["generation"]
    entry = wire.from_json(json.dumps(doc)).entry("c")
    assert entry is not None and entry.generation == 7


def test_unknown_keys_are_ignored() -> None:
    doc = {**wire.document("sb", BUILT, generation=1), "future": {"x": 1}}
    assert wire.from_json(json.dumps(doc)).entry("c") is not None


def _doc(**change: object) -> str:
    return json.dumps({**wire.document("sb", BUILT, generation=1), **change})


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ("[]", "not a JSON object"),
        ("{", "not JSON"),
        (_doc(version=2), "has version 2"),
        (_doc(version=None), "has version None"),
        (_doc(containers=[]), "no containers object"),
        (_doc(containers={f"c{i}": {} for i in range(wire.MAX_CONTAINERS + 1)}),
         "more than 1024 containers"),
        (_doc(containers={"": {}}), "container id"),
        (_doc(vcpu_to_host={"a": 1}), "vcpu_to_host"),
        (_doc(sandbox=5), "sandbox is not a string"),
        (" " * (wire.MAX_BYTES + 1), "larger than"),
    ],
)
def test_malformed_maps_are_refused(data: str, why: str) -> None:
    with pytest.raises(WireError, match=why):
        wire.from_json(data, "map X")


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"guest_cpus": "99999"}, "entry of c"),  # past the host's cap (vmpin.core.cpuset)
        ({"guest_cpus": "1-"}, "invalid CPU list"),
        ({"guest_cpus": 1}, "no guest_cpus list"),
        ({"guest_cpus": "0", "reason": "x" * (wire.MAX_REASON + 1)}, "reason"),
        ("0", "no guest_cpus list"),
    ],
)
def test_a_bad_entry_is_an_error_of_that_container_only(entry: object, why: str) -> None:
    m = wire.from_json(_doc(containers={"c": entry, "ok": {"guest_cpus": "1"}}))
    with pytest.raises(WireError, match=why):
        m.entry("c")
    ok = m.entry("ok")
    assert ok is not None and ok.guest_cpus == frozenset({1})
