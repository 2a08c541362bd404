"""How long a hook or ``vmpin update`` waits on other processes: the budget (issue 26).

A hook delays a container start, and Kata's shipped hook timeout is 10 s (a hook killed at a
create stage fails the start).  So every wait on another process -- the agent's answer, the
node's plan lock (vmpin.state.locks), SQLite's write lock (busy_timeout) -- ends by one
deadline, :data:`BUDGET` seconds after the hook began; past it the hook does without: its
own pass, without the lock if need be, pinning from what it can read (docs/hooks.md).  The
agent's answer gets the first :data:`AGENT_WAIT` of it: a pass takes milliseconds (about a
second when the agent starts up over 2,000 sandboxes), so an agent that has not answered by
then is stopped (SIGSTOP, a stuck disk) or swamped, and the hook's own pass is the faster
way.  The waits for the locks share what is left: their holders hold them for milliseconds.

Before, a stopped agent made every Kata hook (and every plain hook while VMs run) take 6 s,
``vmpin update`` 11 s, and a hook 36 s when the agent was stopped inside a transaction (5 s
for the agent's answer, 1 s to connect, 30 s of busy_timeout), past Kata's timeout.

Lean: the hook imports it.
"""

from __future__ import annotations

#: seconds a hook or ``vmpin update`` waits on other processes in all
BUDGET = 2.0
#: of which the agent's answer gets at most this much
AGENT_WAIT = 1.0
