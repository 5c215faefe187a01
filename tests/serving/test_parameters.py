"""kilnlm.runtime.serving.parameters: config.pbtxt's string parameters -> ExecutorConfig fields and
default_max_tokens."""

from __future__ import annotations

import pytest

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.executor import ExecutorConfig
from kilnlm.runtime.serving.parameters import default_max_tokens, executor_overrides, parameter_value
from kilnlm.runtime.serving.triton_backend import model_parameters


@pytest.mark.parametrize("text, annotation, value", [
    ("42", "int", 42), (" 7 ", "int | None", 7), ("none", "int | None", None), ("", "int | None", None),
    ("0.5", "float", 0.5), ("true", "bool", True), ("On", "bool", True), ("0", "bool", False),
    ("fcfs", "str", "fcfs"),
])
def test_parameter_value(text, annotation, value):
    assert parameter_value(text, annotation) == value


def test_only_executor_config_fields_configure_the_executor():
    config = {"parameters": {"engine_dir": {"string_value": "engine"},
                             "default_max_tokens": {"string_value": "64"},
                             "kv_cache_bytes": {"string_value": "1048576"}}}
    params = model_parameters(config)
    assert params == {"engine_dir": "engine", "default_max_tokens": "64", "kv_cache_bytes": "1048576"}
    overrides = executor_overrides(params)
    assert overrides == {"kv_cache_bytes": 1048576}
    ExecutorConfig(**overrides)  # every override is a field
    assert default_max_tokens(params) == 64
    assert default_max_tokens({}) == 128
    assert model_parameters({}) == {}


def test_unconvertible_parameters_say_what_to_edit():
    with pytest.raises(KilnError, match="kv_cache_bytes is 'lots'.*config.pbtxt"):
        executor_overrides({"kv_cache_bytes": "lots"})
    with pytest.raises(KilnError, match="default_max_tokens is 'many'"):
        default_max_tokens({"default_max_tokens": "many"})
