"""The install's shape: the layering rule (the runtime never imports the builder or transformers) and the
CLI's help."""

import argparse
import subprocess
import sys

import pytest

from kilnlm.cli.main import SUBCOMMANDS, make_parser

LAYERING_PROBE = """
import sys
import kilnlm.runtime.executor, kilnlm.runtime.engine, kilnlm.runtime.tokenizer, kilnlm.plugins
import kilnlm.cli.generate_cmd
import kilnlm.runtime.distribution.cache, kilnlm.runtime.distribution.object_store, kilnlm.cli.cache_cmd
import kilnlm.runtime.distribution.deploy, kilnlm.runtime.serving.dispatcher, kilnlm.runtime.serving.launcher
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "modelopt", "gguf")
             or m.startswith("kilnlm.builder"))
print(",".join(bad))
"""


def test_runtime_imports_neither_builder_nor_transformers():
    out = subprocess.run([sys.executable, "-c", LAYERING_PROBE], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_plugins_import_neither_builder_nor_runtime():
    probe = "import sys, kilnlm.plugins; print(','.join(m for m in sys.modules if m.startswith(('kilnlm.builder', 'kilnlm.runtime'))))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""


def _subparsers():
    parser = make_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_help_explains_every_option(name):
    for action in _subparsers()[name]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"kilnlm {name}: {action.option_strings or action.dest} has no help"
        takes_value = action.option_strings and action.nargs != 0
        if takes_value and action.default is not None and not action.required:
            assert "default" in action.help.lower(), f"kilnlm {name} {action.option_strings[0]}: help must state its default"


@pytest.mark.parametrize("argv", [[], *[[name] for name in SUBCOMMANDS]])
def test_help_runs(argv):
    out = subprocess.run([sys.executable, "-m", "kilnlm.cli", *argv, "--help"], check=True, capture_output=True, text=True)
    assert out.stdout.startswith("usage: kilnlm")
