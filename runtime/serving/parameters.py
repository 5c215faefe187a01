"""A served model's parameters (strings, as config.pbtxt's ``parameters`` hold them) -> typed settings.

Any parameter named like an :class:`~kilnlm.runtime.executor.ExecutorConfig` field configures the executor
(e.g. ``kv_cache_bytes``, ``max_batch_size``); ``default_max_tokens`` is the ``max_tokens`` of a request
that sends none. The engine's own parameters (``engine_dir``, ``engine_ref``, ``engine_cache_dir``) are
read by :func:`kilnlm.runtime.distribution.engine_source.resolve_served_engine`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.executor import ExecutorConfig

DEFAULT_MAX_TOKENS = 128


def parameter_value(text: str, annotation: str):
    """Convert a parameter string to a dataclass field's type, given by its annotation string (e.g.
    ``"int | None"``): "" or "none" (any case) is None; a bool is true for "1", "true", "yes", "on".

    Raises:
        ValueError: an int or float field whose text is not a number.
    """
    value = text.strip()
    if value.lower() in ("", "none"):
        return None
    if "bool" in annotation:
        return value.lower() in ("1", "true", "yes", "on")
    if "int" in annotation:
        return int(value)
    if "float" in annotation:
        return float(value)
    return value


def executor_overrides(params: Mapping[str, str]) -> dict[str, Any]:
    """The ExecutorConfig fields ``params`` sets, converted to their types (empty: the defaults).

    Raises:
        KilnError: a parameter whose value does not convert (the message names it).
    """
    overrides = {}
    for field in dataclasses.fields(ExecutorConfig):
        if field.name in params:
            try:
                overrides[field.name] = parameter_value(params[field.name], str(field.type))
            except ValueError:
                raise KilnError(f"model parameter {field.name} is {params[field.name]!r}: it must be a "
                                f"{field.type} (edit its string_value in config.pbtxt)") from None
    return overrides


def default_max_tokens(params: Mapping[str, str]) -> int:
    """The ``default_max_tokens`` parameter (DEFAULT_MAX_TOKENS when absent).

    Raises:
        KilnError: it is not an integer.
    """
    text = params.get("default_max_tokens", str(DEFAULT_MAX_TOKENS))
    try:
        return int(text)
    except ValueError:
        raise KilnError(f"model parameter default_max_tokens is {text!r}: it must be an integer >= 1 "
                        "(edit its string_value in config.pbtxt)") from None
