"""bench/bench_hook_agent.py splits the agent's marks right: per request, from its accept, each
phase's end; a request without every phase (a status probe) left out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_hook_agent


def _request(t0: float) -> list[tuple[str, float]]:
    marks = [("admit>", t0), ("admit<", t0 + 0.0015)]
    t = t0
    for name, _ in bench_hook_agent.PHASES[1:]:
        t += 0.001
        marks += [(name + ">", t), (name + "<", t + 0.0005)]
    return marks


def test_each_complete_request_gives_each_phase_its_end_from_the_accept() -> None:
    probe = [("admit>", 0.5), ("admit<", 0.5001), ("handle>", 0.5002), ("handle<", 0.5003)]
    got = bench_hook_agent.phases(_request(1.0) + probe + _request(2.0))
    assert list(got) == [name for name, _ in bench_hook_agent.PHASES]
    assert all(len(v) == 2 for v in got.values()), got  # (the status probe left out)
    # admit ends at its "<" (1.5 ms after the accept here), send at its ">" (9 ms)
    assert round(got["admit"][0], 6) == 1.5 and round(got["send"][1], 6) == 9.0
    assert round(got["ingest"][0], 6) == 3.5  # (at its "<")
