"""Write ``cpu_manager_state`` as kubelet writes it (tests stand in for kubelet).

kubelet's v2 form: compact JSON in struct order, ``entries`` omitted when empty, and the
checksum kubelet computes (vmpin refuses a checkpoint whose checksum does not hold, as
kubelet does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vmpin.runtimes.kubelet import v2_checksum


def checkpoint_text(
    default: str, entries: dict[str, dict[str, str]] | None = None, policy: str = "static"
) -> str:
    doc: dict[str, object] = {"policyName": policy, "defaultCpuSet": default}
    if entries:
        doc["entries"] = entries
    doc["checksum"] = v2_checksum(policy, default, entries or {})
    return json.dumps(doc, separators=(",", ":"))


def write_checkpoint(
    path: str | Path, default: str, entries: dict[str, dict[str, str]] | None = None,
    policy: str = "static",
) -> None:  # fmt: skip
    """Replace the file by rename, as kubelet's checkpoint manager does."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(checkpoint_text(default, entries, policy))
    os.replace(tmp, path)
