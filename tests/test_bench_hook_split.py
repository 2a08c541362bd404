"""bench/bench_hook_split.py reads strace's output right: the hook's own calls only, and a
call another traced thread interrupted (``<unfinished ...>`` then ``<... resumed>``) whole."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_hook_split  # noqa: E402 (from bench/)

# strace -f -ttt -T --seccomp-bpf -e trace=execve,connect,sendto,recvfrom,exit_group, of a
# process asking a server thread of its own (30628) over a Unix socket
TRACE = """\
30627 1795813269.914597 execve("/v/py", ["/v/py", "x.py"], 0x7ffd /* 35 vars */) = 0 <0.000307>
30627 1795813269.961120 connect(4, {sa_family=AF_UNIX, sun_path="/s/c"}, 23) = 0 <0.000061>
30627 1795813269.961489 sendto(4, "{\\"op\\":\\"dirty\\"}\\n", 15, 0, NULL, 0 <unfinished ...>
30628 1795813269.961679 recvfrom(5,  <unfinished ...>
30627 1795813269.961720 <... sendto resumed>) = 15 <0.000071>
30628 1795813269.961772 <... recvfrom resumed>"{}\\n", 100, 0, NULL, NULL) = 15 <0.000075>
30628 1795813269.972053 sendto(5, "{\\"done\\":true}\\n", 14, 0, NULL, 0 <unfinished ...>
30627 1795813269.972259 recvfrom(4,  <unfinished ...>
30628 1795813269.972276 <... sendto resumed>) = 14 <0.000080>
30627 1795813269.972315 <... recvfrom resumed>"{}\\n", 100, 0, NULL, NULL) = 14 <0.000041>
30628 1795813269.975309 +++ exited with 0 +++
30627 1795813269.980627 exit_group(0)   = ?
30627 1795813269.982230 +++ exited with 0 +++
"""


def test_marks_of_an_exchange() -> None:
    m = bench_hook_split.marks(TRACE)
    assert m == {"start": 1795813269.914597, "sent": 1795813269.961489 + 0.000071,
                 "answered": 1795813269.972259 + 0.000041, "end": 1795813269.980627}  # fmt: skip


def test_a_request_not_waited_for() -> None:
    """runc-agent: the hook posts and leaves (no recvfrom): answered is when it sent."""
    trace = "".join(line + "\n" for line in TRACE.splitlines() if "recvfrom" not in line)
    m = bench_hook_split.marks(trace)
    assert m["answered"] == m["sent"] == 1795813269.961489 + 0.000071
