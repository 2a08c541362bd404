"""The bounds on what the agent serves (vmpin.service.limits), on real socket pairs: the caps
under each fd limit, who is evicted and who is refused, one deadline per request."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from vmpin.service.limits import CONTROL_CAP, METRICS_CAP, Cut, Slots, arrived, caps, read_request


@pytest.mark.parametrize(
    "nofile, control, metrics",
    [
        (64, 4, 1),  # the least: every endpoint still takes one
        (256, 19, 2),  # the flood tests' agent
        (1024, 75, 10),  # systemd's default soft limit (the unit before issue 26)
        (4096, CONTROL_CAP, METRICS_CAP),
        (65536, CONTROL_CAP, METRICS_CAP),  # deploy/systemd/vmpin.service
        (1 << 20, CONTROL_CAP, METRICS_CAP),
    ],
)
def test_caps_leave_three_quarters_of_the_fds_to_the_passes(
    nofile: int, control: int, metrics: int
) -> None:
    assert caps(nofile) == (control, metrics)
    # held (a cap) plus evicted not yet closed (at most two caps) per endpoint
    assert 3 * (control + metrics) <= max(nofile // 4, 15)


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def _pair(pairs: list[tuple[socket.socket, socket.socket]]) -> tuple[socket.socket, socket.socket]:
    """(the agent's end, the client's end)"""
    pair = socket.socketpair()
    pairs.append(pair)
    return pair


def test_the_oldest_slow_sender_is_evicted_for_a_newcomer(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    dropped: Counter[str] = Counter()
    slots = Slots("control", 2, lambda reason: dropped.update([reason]), ends=(b"\n",))
    (a, a_client), (b, _), (c, _) = _pair(pairs), _pair(pairs), _pair(pairs)
    first, second = slots.admit(a), slots.admit(b)
    assert first is not None and second is not None and slots.open() == 2
    third = slots.admit(c)
    assert third is not None and first.evicted and not second.evicted
    assert a_client.recv(10) == b""  # shut down: its owner's recv sees the end
    assert dropped == Counter(["evicted"])
    assert slots.open() == 3  # (until the evicted one's owner releases it)
    assert not slots.answering(first)
    slots.release(first)
    slots.release(first)  # (twice is once)
    assert slots.open() == 2


def test_a_whole_request_is_never_evicted_and_every_slot_answered_refuses(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    dropped: Counter[str] = Counter()
    slots = Slots("control", 2, lambda reason: dropped.update([reason]), ends=(b"\n",))
    (a, a_client), (b, b_client), (c, _) = _pair(pairs), _pair(pairs), _pair(pairs)
    a_client.sendall(b'{"op": "status"}\n')
    assert arrived(a, (b"\n",)) and not arrived(b, (b"\n",))
    honest = slots.admit(a, whole=True)
    slow = slots.admit(b)
    assert honest is not None and slow is not None
    # b's line arrives before its thread had the GIL to read it: peeked, it is kept too
    b_client.sendall(b"{}\n")
    assert slots.admit(c) is None
    assert dropped == Counter(["over_cap"])
    assert not honest.evicted and not slow.evicted
    assert slots.answering(honest) and slots.answering(slow)


def test_an_admission_waits_for_evicted_connections_to_close(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    """At most a cap of evicted connections pending (twice that for a whole request): past
    that an admission waits for one to be released, up to EVICT_WAIT, then refuses."""
    from vmpin.service.limits import EVICT_WAIT

    dropped: Counter[str] = Counter()
    slots = Slots("metrics", 1, lambda reason: dropped.update([reason]), ends=(b"\r\n\r\n",))
    first = slots.admit(_pair(pairs)[0])
    second = slots.admit(_pair(pairs)[0])  # evicts the first: one pending, not released
    assert first is not None and first.evicted and second is not None
    t = time.monotonic()
    assert slots.admit(_pair(pairs)[0]) is None  # a slow newcomer may not make a second
    assert EVICT_WAIT <= time.monotonic() - t < 1.0
    t = time.monotonic()  # (before the timer starts: else a late t makes the wait look short)
    threading.Timer(0.02, slots.release, (first,)).start()
    third = slots.admit(_pair(pairs)[0])  # waits for the release, then evicts the second
    assert third is not None and second.evicted and 0.02 <= time.monotonic() - t < 1.0
    conn, client = _pair(pairs)
    client.sendall(b"GET / HTTP/1.0\r\n\r\n")
    whole = slots.admit(conn, arrived(conn, (b"\r\n\r\n",)))  # a second pending, for it
    assert whole is not None and third.evicted
    assert slots.admit(_pair(pairs)[0]) is None  # the one slot is answered: no waiting
    assert dropped == Counter({"evicted": 3, "over_cap": 2})
    assert slots.open() == 3  # the whole one, and two evicted its owners have not closed


def test_read_request_has_one_deadline_for_the_whole_request(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    conn, client = _pair(pairs)
    stop = threading.Event()

    def trickle() -> None:
        for byte in b'{"op": "status"}':
            try:
                client.send(bytes([byte]))
            except OSError:
                return
            if stop.wait(0.05):
                return

    # (ended before the test does: a later test counting socket calls must not see its own)
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    t = time.monotonic()
    try:
        with pytest.raises(Cut) as cut:
            read_request(conn, (b"\n",), 1 << 20, 0.3)  # each byte well within 0.3 s of the last
        assert cut.value.reason == "timeout"
        assert 0.3 <= time.monotonic() - t < 0.6
    finally:
        stop.set()
        thread.join()


def test_read_request_ends_limits_and_eof(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    conn, client = _pair(pairs)
    client.sendall(b"GET / HTTP/1.0\r\n\r")
    client.sendall(b"\nextra")  # the end straddles two sends
    assert read_request(conn, (b"\r\n\r\n",), 1000, 1.0).startswith(b"GET / HTTP/1.0\r\n\r\n")
    conn, client = _pair(pairs)
    client.sendall(b"x" * 2000)
    with pytest.raises(Cut) as cut:
        read_request(conn, (b"\n",), 1000, 1.0)
    assert cut.value.reason == "too_large"
    conn, client = _pair(pairs)
    client.sendall(b"half")
    client.shutdown(socket.SHUT_WR)
    assert read_request(conn, (b"\n",), 1000, 1.0) == b"half"  # the caller decides


def test_the_units_fd_limit_gives_the_full_caps() -> None:
    """deploy/systemd/vmpin.service sets LimitNOFILE (systemd's default soft 1,024 is what
    ran out in issue 26); under it the agent gets its full caps."""
    from pathlib import Path

    unit = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "vmpin.service"
    limit = [x for x in unit.read_text().splitlines() if x.startswith("LimitNOFILE=")]
    assert len(limit) == 1, limit
    nofile = int(limit[0].split("=", 1)[1])
    assert caps(nofile) == (CONTROL_CAP, METRICS_CAP)
    assert nofile > 1024  # (the default it replaces)


class _Taken:
    """A lock that may not be taken."""

    def __enter__(self) -> None:
        raise AssertionError("lock taken")

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_slot_admitted_whole_answers_without_the_lock(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    """Only a slot still reading can be evicted: one whose request was whole at the accept
    (every honest client's) answers without a lock round trip (issue 28: on the connection
    thread, per request); a reading one still takes it, and an evicted one still says so."""
    slots = Slots("control", 1, ends=(b"\n",))
    (a, _), (b, _) = _pair(pairs), _pair(pairs)
    whole = slots.admit(a, whole=True)
    assert whole is not None and not whole.reading
    real, slots._lock = slots._lock, _Taken()  # type: ignore[assignment]
    assert slots.answering(whole)
    slots._lock = real
    slots.release(whole)
    reading = slots.admit(b)
    assert reading is not None and reading.reading
    slots._lock = _Taken()  # type: ignore[assignment]
    with pytest.raises(AssertionError, match="lock taken"):
        slots.answering(reading)
