"""vmpin.state.sqlite: _sqlite3 loaded without functools, and still the real SQLite.

Each case runs in a fresh interpreter (``-S``: nothing loaded but the interpreter's own
start), since what is tested is what a process imports first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Uses a connection the way the store does (a statement run many times: the statement cache
# the stand-in lru_cache builds), then imports the real functools.
PROBE = """
import sys
{before}
from vmpin.state.sqlite import sqlite3
loaded = sorted(m for m in ("functools", "collections", "types", "operator") if m in sys.modules)
db = sqlite3.connect(":memory:")
db.execute("CREATE TABLE t (a INTEGER)")
for i in range(400):
    db.execute("INSERT INTO t VALUES (?)", (i % 7,))
    db.execute("SELECT count(*) FROM t WHERE a = ?", (i % 5,)).fetchone()
rows = db.execute("SELECT a, count(*) FROM t GROUP BY a ORDER BY a").fetchall()
try:
    db.execute("SELECT nope FROM t")
    err = None
except sqlite3.Error as e:  # the same class the store and apply catch
    err = type(e).__name__
import functools, json  # (json imports re, enum and functools: after the check)
print(json.dumps({{"loaded": loaded, "rows": rows, "err": err,
                  "real": hasattr(functools, "reduce") and hasattr(functools, "partial"),
                  "same": sqlite3 is sys.modules["_sqlite3"]}}))
"""


def probe(before: str = "") -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROBE.format(before=before)],
        capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out: dict[str, object] = json.loads(proc.stdout)
    return out


EXPECTED_ROWS = [[a, len([i for i in range(400) if i % 7 == a])] for a in range(7)]


def test_loads_without_functools_and_works() -> None:
    out = probe()
    assert out["loaded"] == []  # neither functools nor what it imports
    assert out["rows"] == EXPECTED_ROWS
    assert out["err"] == "OperationalError"
    assert out["real"] is True  # the stand-in is gone: a later import gets functools itself
    assert out["same"] is True


def test_functools_already_loaded_is_left_alone() -> None:
    out = probe("import functools; real = functools")
    assert "functools" in out["loaded"]  # type: ignore[operator]
    assert out["rows"] == EXPECTED_ROWS and out["real"] is True


def test_without_the_c_wrapper_imports_the_ordinary_way() -> None:
    """A Python whose _functools lacks the wrapper: _sqlite3 is imported as usual."""
    out = probe("import _functools; del _functools._lru_cache_wrapper")
    assert out["rows"] == EXPECTED_ROWS and out["err"] == "OperationalError"
    assert out["real"] is True
