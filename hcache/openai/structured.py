"""A request's structured output, in whichever form it comes: vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar`` or ``json_object``), its older ``guided_json``, ``guided_regex``,
``guided_choice`` and ``guided_grammar``, or OpenAI's ``response_format`` (``json_schema`` or
``json_object``). It becomes one grammar for the model server (:mod:`hcache.mii.constraints`), checked here
so that a bad one is refused with a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any, Optional

from ..errors import InvalidRequestError
from ..mii.constraints import check_structured, structured_option
from .api_error import APIError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' keys this server honours
_ASKS_NOTHING = (None, False, "", [], {})  # what structured_outputs' other keys may hold


def structured_output(request) -> Optional[str]:
    """The model server's ``structured_output`` option for ``request``, or None where it asks for none."""
    forms = [(f"guided_{k}", k, getattr(request, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")]
    for key, value in (request.structured_outputs or {}).items():
        if key not in _KINDS and value not in _ASKS_NOTHING:
            raise APIError(400, f"structured_outputs.{key} is not supported", param="structured_outputs")
        forms.append(("structured_outputs", key, value))
    forms.extend(_response_format(request.response_format))
    forms = [f for f in forms if f[2] not in _ASKS_NOTHING and f[1] in _KINDS]
    if not forms:
        return None
    if len(forms) > 1:
        raise APIError(400, f"one structured output at a time, not {len(forms)}", param=forms[1][0])
    param, kind, value = forms[0]
    try:
        grammar = _grammar(kind, value)
        check_structured(*grammar)
    except InvalidRequestError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return structured_option(*grammar)


def _response_format(form: Optional[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    kind = (form or {}).get("type", "text")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema" and isinstance((form.get("json_schema") or {}).get("schema"), dict):
        return [("response_format", "json", form["json_schema"]["schema"])]
    raise APIError(
        400,
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name": ..., "schema": {...}}}',
        param="response_format",
    )


def _grammar(kind: str, value: Any) -> tuple[str, str]:
    """The model server's (kind, text) for one form: a JSON object is the schema of any object, and a choice
    a grammar of its strings (as vLLM's xgrammar backend makes them)."""
    if kind == "json_object":
        return "json", '{"type": "object"}'
    if kind == "json":
        return "json", value if isinstance(value, str) else json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError("a choice is a list of non-empty strings")
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
    if not isinstance(value, str):
        raise InvalidRequestError(f"a {kind} is a string")
    return kind, value
