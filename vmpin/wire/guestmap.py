"""The guest map's wire format: one home for its version, names, limits and (de)serialisation.

The host builds a sandbox's map (:func:`vmpin.core.guestmap.map_sandbox`), publishes it
(:mod:`vmpin.runtimes.publish`, adding ``generation`` and ``published_at``), prints a
container's entry (``vmpin guest-map``), and the guest program reads it
(:mod:`vmpin.guest.inputs`).  All of them take the format from here, so they cannot drift.

Format ``1`` (``docs/guest.md``)::

    {"version": 1, "sandbox": ID, "generation": N, "published_at": T, "mode": M,
     "nvcpus": N, "vcpu_to_host": {"0": 3, ...}, "siblings": [[0, 1], ...],
     "containers": {ID: {"container": ID, "sandbox": ID, "host_cpus": LIST|null,
                         "guest_cpus": LIST, "exact": BOOL, "mode": M, "reason": TEXT,
                         "generation": N}}}

Readers ignore keys they do not know (a newer host may add some); another ``version`` is
refused, because the host bumps it only when old readers would misread the file.  CPU lists
are parsed by :class:`vmpin.core.cpuset.CpuSet` -- the host's parser and its cap, so the
guest cannot accept a CPU (99999) the host would refuse.

Standard library only, no ``typing`` or ``re`` at run time: the guest program imports this
inside a small guest image, and the host hook path imports it too.
"""

from __future__ import annotations

from vmpin.core.cpuset import CpuSet
from vmpin.core.errors import CpuSetError, WireError
from vmpin.wire import jsonio as json  # json without re: the hook reaches this module

TYPE_CHECKING = False  # mypy takes it as true; typing stays unimported (vmpin.lean.records)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, NamedTuple
else:
    from vmpin.lean.records import NamedTuple

#: the published map's format version (docs/guest.md).
FORMAT_VERSION = 1
#: the map's directory and file name, under the directory Kata shares with the guest.
MAP_DIRNAME = "vmpin"
MAP_FILENAME = "guest-map.json"
#: where Kata shows the host's ``<publish dir>/<sandbox>/mounts/`` inside the guest.
GUEST_SHARED_DIR = "/run/kata-containers/shared/containers"
DEFAULT_GUEST_MAP = f"{GUEST_SHARED_DIR}/{MAP_DIRNAME}/{MAP_FILENAME}"

#: limits a reader enforces: a map is small (one entry per container of one pod); anything
#: bigger is not a map vmpin wrote, and is refused before it costs the guest memory.
MAX_BYTES = 1 << 20
MAX_CONTAINERS = 1024
#: container ids are at most 1024 bytes (vmpin.core.ids); text fields are capped likewise.
MAX_TEXT = 1024
#: ``reason`` is a sentence for people; the host writes far less.
MAX_REASON = 4096


class Entry(NamedTuple):
    """One container's line of the map, as a reader needs it (``guest_cpus``: vCPU indexes,
    parsed and capped by :class:`CpuSet`, kept as a frozenset for cheap comparison)."""

    container: str
    guest_cpus: frozenset[int]
    exact: bool
    mode: str
    reason: str
    generation: int


class GuestMap(NamedTuple):
    """A published map, its envelope checked; entries are parsed when asked for, so one bad
    entry is an error against that container, not against the whole sandbox."""

    sandbox: str
    generation: int
    mode: str
    nvcpus: int
    #: vCPU index (a string: JSON keys are) -> the host CPU it is pinned to 1:1.
    vcpu_to_host: Mapping[str, int]
    containers: Mapping[str, object]
    where: str = "guest map"

    def entry(self, container_id: str) -> Entry | None:
        """The container's entry, None when the map does not name it."""
        raw = self.containers.get(container_id)
        if raw is None:
            return None
        return entry_from_json(raw, container_id, self.generation, self.where)


def document(
    sandbox_id: str, built: Mapping[str, Any], generation: int | None = None
) -> dict[str, Any]:
    """The JSON document for ``built`` (:func:`vmpin.core.guestmap.map_sandbox`'s dict).

    Without ``generation`` it is the content publish compares to judge "changed"; the
    publisher adds ``generation`` and ``published_at``.
    """
    containers = built.get("containers") or {}
    doc: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "sandbox": sandbox_id,
        "mode": built.get("mode"),
        "nvcpus": built.get("nvcpus"),
        "vcpu_to_host": dict(built.get("vcpu_to_host") or {}),
        "siblings": [list(g) for g in built.get("siblings") or []],
        "containers": {cid: dict(entry) for cid, entry in sorted(containers.items())},
    }
    if generation is not None:
        doc["generation"] = generation
    return doc


def to_json(doc: Mapping[str, Any]) -> bytes:
    """The bytes written to the map file (sorted keys: equal maps are equal files)."""
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _text(raw: Mapping[str, Any], key: str, where: str, limit: int = MAX_TEXT) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str) or len(value) > limit:
        raise WireError(f"{where}: {key} is not a string of at most {limit} characters")
    return value


def _count(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    # bool is an int in Python and in no JSON producer's mind: refuse it.
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _vcpu_to_host(raw: object, where: str) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and k.isdigit() and isinstance(v, int) and not isinstance(v, bool)
        for k, v in raw.items()
    ):
        raise WireError(f"{where}: vcpu_to_host is not an object of vCPU index -> host CPU")
    return dict(raw)


def entry_from_json(raw: object, container_id: str, default_generation: int, where: str) -> Entry:
    """One container entry; ``guest_cpus`` must be a valid CPU list."""
    if not isinstance(raw, dict) or not isinstance(raw.get("guest_cpus"), str):
        raise WireError(f"{where}: entry of {container_id} has no guest_cpus list")
    try:
        cpus = frozenset(CpuSet.parse(raw["guest_cpus"]))
    except CpuSetError as err:
        raise WireError(f"{where}: entry of {container_id}: {err}") from None
    return Entry(
        container_id,
        cpus,
        raw.get("exact") is True,
        _text(raw, "mode", where),
        _text(raw, "reason", where, MAX_REASON),
        _count(raw, "generation", default_generation),
    )


def from_json(data: bytes | str, where: str = "guest map") -> GuestMap:
    """Parse and check a published map; :class:`WireError` names what is wrong and ``where``."""
    if len(data) > MAX_BYTES:
        raise WireError(f"{where} is larger than {MAX_BYTES} bytes")
    try:
        raw = json.loads(data)
    except ValueError as err:
        raise WireError(f"{where} is not JSON: {err}") from None
    except RecursionError:  # json's C decoder recurses: ~1,000 levels end it (issue 26)
        raise WireError(f"{where} is JSON nested too deeply") from None
    if not isinstance(raw, dict):
        raise WireError(f"{where} is not a JSON object")
    version = raw.get("version")
    if version != FORMAT_VERSION:
        raise WireError(f"{where} has version {version!r}; this reader knows {FORMAT_VERSION}")
    containers = raw.get("containers")
    if not isinstance(containers, dict):
        raise WireError(f"{where} has no containers object")
    if len(containers) > MAX_CONTAINERS:
        raise WireError(f"{where} names more than {MAX_CONTAINERS} containers")
    if not all(0 < len(cid) <= MAX_TEXT for cid in containers):
        raise WireError(f"{where} has an empty container id or one longer than {MAX_TEXT}")
    return GuestMap(
        _text(raw, "sandbox", where),
        _count(raw, "generation", 0),
        _text(raw, "mode", where),
        _count(raw, "nvcpus", 0),
        _vcpu_to_host(raw.get("vcpu_to_host"), where),
        containers,
        where,
    )
