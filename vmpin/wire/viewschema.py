"""The pydantic models of the ``--json`` views, derived from their one declaration in
:mod:`vmpin.wire.views`: ``vmpin schema``'s JSON Schemas, and the check of every ``--json``
output under ``VMPIN_CHECK_VIEWS`` (vmpin.service.commands.emit).

Apart from :mod:`vmpin.wire.views` because pydantic costs a read command four bare
interpreters and may not come near the hooks, which load the views' module; only ``vmpin
schema`` and that check import this one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field, RootModel, create_model

from vmpin.wire import views

#: the views other views hold (a key's schema type in views.NESTED names them)
NESTED_VIEWS = ("sandbox_container", "thread", "policy", "topology_cpu", "claim", "violation")

_models: dict[str, Any] = {}


def model(view: Callable[..., dict[str, Any]]) -> Any:
    """The pydantic model of ``view``, named as the view in CamelCase and ``View``
    (``sandbox_container``: ``SandboxContainerView``): its keys but views.EXTRA's, in order,
    typed as its parameters (or views.NESTED), described by views.NOTES; extra keys allowed."""
    name = view.__name__
    if name in _models:
        return _models[name]
    names: dict[str, Any] = {
        "Any": Any, "Literal": Literal, "Optional": Optional, "CpuList": Optional[str],
    }  # fmt: skip
    fields: dict[str, Any] = {}
    for key, p in inspect.signature(view).parameters.items():
        if key in views.EXTRA.get(name, ()):
            continue
        nested = views.NESTED.get((name, key))
        if nested is not None:
            names.update((n, model(getattr(views, n))) for n in NESTED_VIEWS if f"[{n}]" in nested)
        kind = eval(nested or p.annotation, names)  # (the views' own annotations)
        default = ... if p.default is inspect.Parameter.empty else p.default
        default = None if default is views.ABSENT else default  # (absent: read as null)
        note = views.NOTES.get(name, {}).get(key)
        fields[key] = (kind, default if note is None else Field(default, description=note))
    made = create_model(
        "".join(w.capitalize() for w in name.split("_")) + "View",
        __config__=ConfigDict(extra="allow", defer_build=True),
        __doc__=view.__doc__,
        **fields,
    )
    _models[name] = made
    return made


def _command_model(command: str) -> Any:
    view, many = views.VIEWS[command]
    return RootModel[list[model(view)]] if many else model(view)  # type: ignore[misc]


def check(command: str, data: Any) -> None:
    """Validate ``data`` against the view of ``command`` (raises pydantic's ValidationError)."""
    _command_model(command).model_validate(data)


def schema(command: str) -> dict[str, Any]:
    out: dict[str, Any] = _command_model(command).model_json_schema()
    out["title"] = f"vmpin {command} --json"
    return out
