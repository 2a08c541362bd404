"""WireError, in vmpin.core.errors' tree (which draws it): a document in one of vmpin's wire
formats that is malformed.

The wire formats raise it (vmpin.wire.guestmap, vmpin.wire.control_commands); their readers
catch it.  Here, apart from vmpin.core.errors and the package's ``__init__``, because neither
the plain container hook nor ``vmpin update`` reads a document that raises it: they do not
create this class (~0.1 M instructions of each, a bare interpreter ~39 M).  Stdlib only (the
guest program ships it).
"""

from __future__ import annotations

from vmpin.core.errors import VmpinError


class WireError(VmpinError, ValueError):
    pass
