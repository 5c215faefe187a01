"""kilnlm.runtime.serving.parameters: config.pbtxt's string parameters -> ExecutorConfig fields and
default_max_tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.executor import ExecutorConfig
from kilnlm.runtime.serving.parameters import default_max_tokens, executor_options, executor_overrides, parameter_value
from kilnlm.runtime.serving.triton_backend import model_parameters


@pytest.mark.parametrize("text, annotation, value", [
    ("42", "int", 42), (" 7 ", "int | None", 7), ("none", "int | None", None), ("", "int | None", None),
    ("0.5", "float", 0.5), ("true", "bool", True), ("On", "bool", True), ("0", "bool", False),
    ("FALSE", "bool", False), ("off", "bool", False), ("fcfs", "str", "fcfs"),
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


def test_a_relative_draft_engine_is_the_model_directory_s(tmp_path):
    relative = '{"method": "draft", "num_speculative_tokens": 3, "model": "draft/engine"}'
    assert json.loads(executor_overrides({"speculative_config": relative}, tmp_path)["speculative_config"]) == \
        {"method": "draft", "num_speculative_tokens": 3, "model": str(tmp_path / "draft" / "engine")}  # as engine_dir
    absolute = '{"method": "draft", "num_speculative_tokens": 3, "model": "/srv/draft"}'
    assert executor_overrides({"speculative_config": absolute}, tmp_path) == {"speculative_config": absolute}
    assert executor_overrides({"speculative_config": relative}) == {"speculative_config": relative}  # no model_dir
    ngram = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert executor_overrides({"speculative_config": ngram}, tmp_path) == {"speculative_config": ngram}
    with pytest.raises(KilnError, match="speculative_config method is 'medusa'"):
        executor_overrides({"speculative_config": '{"method": "medusa", "num_speculative_tokens": 2}'}, tmp_path)


def test_unconvertible_parameters_say_what_to_edit():
    with pytest.raises(KilnError, match="kv_cache_bytes is 'lots'.*config.pbtxt"):
        executor_overrides({"kv_cache_bytes": "lots"})
    with pytest.raises(KilnError, match="default_max_tokens is 'many'"):
        default_max_tokens({"default_max_tokens": "many"})


def test_every_scheduler_setting_converts_from_config_pbtxt():
    params = {"batch_scheduler_policy": "guaranteed_no_evict", "max_queue_size": "16",
              "enable_chunked_context": "false", "enable_kv_cache_reuse": "true",
              "max_tokens_in_paged_kv_cache": "4096", "max_batch_size": "none"}
    overrides = executor_overrides(params)
    assert overrides == {"batch_scheduler_policy": "guaranteed_no_evict", "max_queue_size": 16,
                         "enable_chunked_context": False, "enable_kv_cache_reuse": True,
                         "max_tokens_in_paged_kv_cache": 4096, "max_batch_size": None}
    ExecutorConfig(**overrides)


@pytest.mark.parametrize("name, text, match", [
    ("batch_scheduler_policy", "fcfs", "batch_scheduler_policy is 'fcfs': it must be one of max_utilization, "
                                       "guaranteed_no_evict"),
    ("enable_chunked_context", "maybe", "enable_chunked_context is 'maybe': it must be a boolean \\(true / false\\)"),
    ("enable_chunked_context", "", "enable_chunked_context is '': it must be a boolean \\(true / false\\)"),
    ("max_queue_size", "1e3", "max_queue_size is '1e3': it must be an integer or none"),
])
def test_bad_scheduler_settings_say_what_to_edit(name, text, match):
    with pytest.raises(KilnError, match=f"model parameter {match}.*edit its string_value in config.pbtxt"):
        executor_overrides({name: text})


def test_executor_options_describe_every_field_once():
    options = {o.name: o for o in executor_options()}
    assert list(options) == [f.name for f in dataclasses.fields(ExecutorConfig)]
    assert all(o.help for o in options.values()), "every ExecutorConfig field needs metadata={'help': ...}"
    policy = options["batch_scheduler_policy"]
    assert (policy.value_type, policy.optional, policy.default) == (str, False, "max_utilization")
    assert policy.choices == ("max_utilization", "guaranteed_no_evict")
    queue = options["max_queue_size"]
    assert (queue.value_type, queue.optional, queue.default, queue.flag) == (int, True, None, "--max-queue-size")
    chunked = options["enable_chunked_context"]
    assert (chunked.value_type, chunked.optional, chunked.default) == (bool, False, True)
    assert chunked.parse("no") is False and queue.parse("8") == 8 and queue.parse("none") is None
    # Every default is the ExecutorConfig's own.
    assert ExecutorConfig(**{name: o.default for name, o in options.items()}) == ExecutorConfig()
