"""A served model's settings, as strings (config.pbtxt's ``parameters``, command-line flags) -> typed values.

Any parameter named like an :class:`~kilnlm.runtime.executor.ExecutorConfig` field configures the executor
(e.g. ``kv_cache_bytes``, ``batch_scheduler_policy``, ``max_queue_size``: TensorRT-LLM's names);
``default_max_tokens`` is the ``max_tokens`` of a request that sends none. The engine's own parameters
(``engine_dir``, ``engine_ref``, ``engine_cache_dir``; ``trusted_keys``) are read by
:func:`kilnlm.runtime.distribution.engine_source.resolve_served_engine` (``served_trusted_keys``).

:func:`executor_options` lists ExecutorConfig's fields (name, type, default, choices, one-line help): the
one description both fronts build from -- the Triton model converts config.pbtxt's strings with it
(:func:`executor_overrides`), ``kilnlm serve`` generates its flags from it (``--kv-cache-bytes``,
``--enable-chunked-context`` / ``--no-enable-chunked-context``, ...), so a new field appears in both
without further code.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, Mapping

from kilnlm.runtime.distribution.engine_source import version_speculative_config
from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.executor import ExecutorConfig
from kilnlm.runtime.speculative import resolve_draft_model

DEFAULT_MAX_TOKENS = 128
TRUE_TEXTS = ("1", "true", "yes", "on")
FALSE_TEXTS = ("0", "false", "no", "off")
NONE_TEXTS = ("", "none")
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean (true / false)", str: "a string"}


def parameter_value(text: str, annotation: str):
    """Convert a parameter string to a dataclass field's type, given by its annotation string (e.g.
    ``"int | None"``): "" or "none" (any case) is None; a bool is "1" / "true" / "yes" / "on" or "0" /
    "false" / "no" / "off" (any case).

    Raises:
        ValueError: an int or float field whose text is not a number, a bool field whose text is none of
            those words.
    """
    value = text.strip()
    if value.lower() in NONE_TEXTS:
        return None
    if "bool" in annotation:
        if value.lower() in TRUE_TEXTS:
            return True
        if value.lower() in FALSE_TEXTS:
            return False
        raise ValueError(f"{value!r} is not a boolean")
    if "int" in annotation:
        return int(value)
    if "float" in annotation:
        return float(value)
    return value


@dataclasses.dataclass(frozen=True)
class ExecutorOption:
    """One :class:`ExecutorConfig` field as a setting a user types.

    ``value_type``: ``int``, ``float``, ``bool`` or ``str``; ``optional``: None is allowed (it means "the
    default behaviour" -- the engine's limit, an unbounded queue, ...); ``choices``: the allowed values of a
    string setting (empty: any); ``flag``: its command-line spelling.
    """

    name: str
    value_type: type
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, text: str):
        """``text`` converted to this option's type (see :func:`parameter_value`).

        Raises:
            KilnError: it does not convert, is None where None is not allowed, or is not one of the choices
                (the message names the option, its type and the choices).
        """
        what = f"{_TYPE_WORDS.get(self.value_type, self.value_type.__name__)}{' or none' if self.optional else ''}"
        try:
            value = parameter_value(text, self.value_type.__name__)
        except ValueError:
            raise KilnError(f"{self.name} is {text!r}: it must be {what}") from None
        if value is None and not self.optional:
            raise KilnError(f"{self.name} is {text!r}: it must be {what}")
        if self.choices and value not in self.choices:
            raise KilnError(f"{self.name} is {text!r}: it must be one of {', '.join(self.choices)}")
        return value


def executor_options() -> list[ExecutorOption]:
    """Every :class:`ExecutorConfig` field, in declaration order, with its type, default and help (the
    field's ``metadata``)."""
    hints = typing.get_type_hints(ExecutorConfig)
    options = []
    for field in dataclasses.fields(ExecutorConfig):
        hint = hints[field.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
        optional = type(None) in args
        value_type = next((a for a in args if a is not type(None)), hint)
        options.append(ExecutorOption(field.name, value_type, optional, field.default,
                                      field.metadata.get("help", ""), tuple(field.metadata.get("choices", ()))))
    return options


def executor_overrides(params: Mapping[str, str], model_dir: str | os.PathLike | None = None,
                       version: str | int | None = None) -> dict[str, Any]:
    """The ExecutorConfig fields ``params`` sets, converted to their types (empty: the defaults). With
    ``model_dir`` (the Triton model's directory), a ``speculative_config`` draft engine named by a relative
    path is the one under it, as a relative ``engine_dir`` is
    (:func:`kilnlm.runtime.speculative.resolve_draft_model`); with ``version`` too, the version directory's
    own ``speculative_config.json``, when `kilnlm deploy` wrote one, takes the parameter's place
    (:func:`kilnlm.runtime.distribution.engine_source.version_speculative_config`).

    Raises:
        KilnError: a parameter whose value does not convert (the message names it and says to edit
            config.pbtxt), or an invalid ``speculative_config.json`` (an EngineError naming the file).
    """
    overrides = {}
    for option in executor_options():
        if option.name in params:
            try:
                overrides[option.name] = option.parse(params[option.name])
            except KilnError as exc:
                raise KilnError(f"model parameter {exc} (edit its string_value in config.pbtxt)") from None
    deployed = None if model_dir is None or version is None else version_speculative_config(model_dir, version)
    if deployed is not None:
        overrides["speculative_config"] = deployed
    elif model_dir is not None and overrides.get("speculative_config"):
        overrides["speculative_config"] = resolve_draft_model(overrides["speculative_config"], model_dir)
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
