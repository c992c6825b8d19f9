"""Structured records: every data row under a response format parses and validates before it is
committed. The engine's grammar makes a closed value valid by construction; this is the check a
user can trust without trusting the grammar library, and the place a row cut before its value
closed becomes an error row instead of a data row.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from schemas.engine import ResponseFormat

if TYPE_CHECKING:
    from generation.types import Completion

INCOMPLETE = "incomplete_structured_output"
INVALID = "invalid_structured_output"
_RAISE = {
    "length": "generation.sampling.max_new_tokens",
    "cache_full": "engine.bucket_grid.cache_lengths",
}


def structured_problem(response_format: ResponseFormat, completion: Completion) -> str | None:
    """Why this completion is not a record under `response_format` (an error row's reason), or
    None when it is one."""
    if not completion.structured_complete:
        cut = completion.finish_reason
        return (f"{INCOMPLETE}: cut by {cut} after {len(completion.token_ids)} tokens before the "
                f"value closed; raise {_RAISE.get(cut, 'generation.sampling.max_new_tokens')}")
    problem = _mismatch(response_format, completion.text)
    return None if problem is None else f"{INVALID}: {problem}"


def _mismatch(response_format: ResponseFormat, text: str) -> str | None:
    kind = response_format.type
    if kind == "regex":
        matched = re.fullmatch(response_format.pattern, text) is not None
        return None if matched else "the text does not match response_format.pattern"
    if kind == "choice":
        return None if text in response_format.choices else "the text is none of the choices"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not JSON: {error}"
    if kind == "json_object":
        return None if isinstance(value, dict) else "the JSON value is not an object"
    import jsonschema

    validator = jsonschema.Draft202012Validator(response_format.json_schema.schema_)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "(root)"
    return f"at {where}: {error.message}"
