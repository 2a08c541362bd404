"""``vmpin serve`` as the tests run it: a subprocess started exactly as an operator would
(``vmpin --state-dir D serve --interval I --metrics-port P``), asked over its control socket
whether it is up and how many passes it has made, and killed by its pid if a test leaves it up.

The ``agents`` fixture (registered for the whole suite by tests/conftest.py) starts any number
of them in one test and kills what is left at its end; a module overrides it to change the
defaults for its tests (tests/service/test_agent_views.py: DEBUG logs, an hour's interval).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import vmpin_cmd
from tests.support.qemu_util import wait_until
from vmpin.linux.paths import HostPaths
from vmpin.service import control


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AgentProc:
    """``vmpin serve`` as a subprocess; killed by its pid (SIGKILL) if a test leaves it up."""

    def __init__(
        self,
        paths: HostPaths,
        env: dict[str, str],
        log: Path,
        interval: float = 0.5,
        nofile: tuple[int, int] | None = None,
        port: int | None = None,
    ) -> None:
        """``nofile``: the (soft, hard) RLIMIT_NOFILE it starts under (a unit's LimitNOFILE);
        ``port``: its metrics port (default: one free now)."""
        self.paths = paths
        self.port = free_port() if port is None else port
        self.log = log
        cmd = [
            *vmpin_cmd(),
            "--state-dir",
            paths.state_dir,
            "serve",
            "--interval",
            str(interval),
            "--metrics-port",
            str(self.port),
        ]
        self._err = open(log, "ab")  # noqa: SIM115 (closed in stop())
        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        # no preexec_fn unless a limit is asked for: without one the child is spawned with
        # vfork, and a test that holds a gRPC client (containerd's) runs none of gRPC's fork
        # handlers in it (once, under load, they left the agent dead before its exec:
        # "epoll_wait error: Bad file descriptor" and nothing else in its log)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=self._err,
            preexec_fn=limit if nofile is not None else None,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 20.0) -> None:
        ok = wait_until(
            lambda: self.proc.poll() is not None or self.status() is not None, timeout, 0.05
        )
        if not ok or self.proc.poll() is not None:
            raise AssertionError(f"agent did not come up:\n{self.log.read_text()}")

    def status(self, sandbox: str | None = None) -> dict[str, Any] | None:
        msg: dict[str, object] = {"op": "status"}
        if sandbox:
            msg["sandbox"] = sandbox
        return control.request(self.paths, msg, timeout=2.0)

    def wait_pass(self, passes: int, timeout: float = 20.0) -> dict[str, Any]:
        """Until ``passes`` full passes have finished and nothing is queued or running."""
        last: dict[str, Any] = {}

        def done() -> bool:
            nonlocal last
            last = self.status() or {}
            return (
                bool(last)
                and int(last["passes"]) >= passes
                and not last["pass_running"]
                and last["queue"] == 0
                and last["running"] == 0
            )

        assert wait_until(done, timeout, 0.05), last
        return last

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # what is it doing? (the agent dumps every thread's stack on SIGUSR1)
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.kill()
            tail = self.log.read_text(errors="replace")[-6000:]
            raise AssertionError(f"the agent did not stop in {timeout} s; log:\n{tail}") from None
        finally:
            self.kill()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._err.close()


@pytest.fixture
def agents(paths: HostPaths, env: dict[str, str], tmp_path: Path) -> Iterator[
    Callable[..., AgentProc]
]:  # fmt: skip
    """``agents(interval=0.5, env=None, ready=True, wait_pass=0)`` starts an agent on this
    test's paths (``env``: instead of the test's ``env``), waits until it answers unless
    ``ready`` is false, and until it has made ``wait_pass`` passes; each is killed at the end."""
    started: list[AgentProc] = []
    test_env = env

    def start(
        interval: float = 0.5,
        *,
        env: dict[str, str] | None = None,
        ready: bool = True,
        wait_pass: int = 0,
    ) -> AgentProc:
        log = tmp_path / f"agent{len(started)}.log"
        a = AgentProc(paths, test_env if env is None else env, log, interval)
        started.append(a)
        if ready or wait_pass:
            a.wait_ready()
        if wait_pass:
            a.wait_pass(wait_pass)
        return a

    try:
        yield start
    finally:
        for a in started:
            a.kill()
