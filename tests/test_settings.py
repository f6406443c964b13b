"""The settings model is the one source of each setting's flag, environment variable,
default, validation and help: `serve`'s parser and the DDTREE_* variables are checked
against it, bad values are one-line errors, --log-level reaches the project's own
loggers, and the README's table of settings is the model's."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from proxy.ab.settings import ABSettings
from proxy.cli import build_parser, flag_of, help_of, settings_from_args
from proxy.cli import main as cli_main
from proxy.decoding import TreeSettings
from proxy.server.app import PROJECT_LOGGERS
from proxy.server.settings import ServerSettings, env_var
from proxy.settings import RuntimeSettings, Setting, settings_of

README = Path(__file__).resolve().parents[1] / "README.md"
SETTINGS = settings_of(ServerSettings)
# Valid values of a format of their own; any other setting takes `_other_value`'s.
FORMATTED = {
    "target_url": "http://vllm:8000",
    "ab_split": "0.5",
    "ab_guardrail": "True",
    "shadow": "0.25",
    "shadow_drafters": "ngram",
    "shadow_budgets": "2,32",
    "shadow_busy": "0.5",
}
# The nested models whose fields are flat settings, by the field that holds each.
NESTED = {"tree": TreeSettings, "ab": ABSettings}


def _serve_parser() -> argparse.ArgumentParser:
    (commands,) = [
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    return commands.choices["serve"]


SERVE_FLAGS = {
    flag: action for action in _serve_parser()._actions for flag in action.option_strings
}


def _serve(*argv: str) -> ServerSettings:
    return settings_from_args(ServerSettings, build_parser().parse_args(["serve", *argv]))


def _value(settings: RuntimeSettings, setting: Setting) -> Any:
    holder = settings if setting.parent is None else getattr(settings, setting.parent)
    return getattr(holder, setting.name)


def _other_value(setting: Setting) -> str:
    """A valid value other than the default, as a flag or a variable writes it."""
    if setting.name in FORMATTED:
        return FORMATTED[setting.name]
    kinds = (setting.field.annotation, *get_args(setting.field.annotation))
    for kind in kinds:
        if get_origin(kind) is Literal:
            return next(value for value in reversed(get_args(kind)) if value != setting.default)
    if int in kinds:
        return str((setting.default or 1) + 1)
    if float in kinds:
        return str(setting.default * 2)
    return "other"


def test_every_field_is_a_setting():
    nested = {name: set(model.model_fields) for name, model in NESTED.items()}
    top = set(ServerSettings.model_fields) - set(NESTED)
    assert {s.name for s in SETTINGS} == top.union(*nested.values())
    for parent, fields in nested.items():
        assert {s.name for s in SETTINGS if s.parent == parent} == fields


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.name)
def test_every_setting_has_a_flag_whose_help_is_its_description(setting):
    action = SERVE_FLAGS[flag_of(setting)]
    assert action.dest == setting.name and action.default is None
    assert setting.field.description and setting.field.description in action.help
    assert f"[{env_var(setting.name)}]" in action.help
    if setting.default is not None:
        assert f"(default: {setting.default})" in action.help


def test_the_flags_keep_their_spellings():
    assert {
        "--target-url", "--api-key", "--upstream-api-key", "--budget", "--chain", "--no-draft",
        "--depth", "--budget-policy", "--strategy", "--port", "--host", "--log-level",
        "--retry-backoff", "--max-retry-backoff", "--generation-config", "--device", "--dtype",
        "--torch-threads",
    } <= SERVE_FLAGS.keys()  # fmt: skip


def _assert_defaults(settings: RuntimeSettings, settings_list: list[Setting]) -> None:
    for setting in settings_list:
        assert _value(settings, setting) == setting.default, setting.name


def test_no_flag_and_no_variable_is_the_models_defaults():
    settings = _serve()
    _assert_defaults(settings, SETTINGS)
    assert settings.port == 8080  # the proxy's port; 8000 is vLLM's


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda setting: setting.name)
def test_every_setting_from_its_flag_and_from_its_variable(setting, monkeypatch):
    value = _other_value(setting)
    assert str(_value(_serve(flag_of(setting), value), setting)) == value
    monkeypatch.setenv(env_var(setting.name), value)
    assert str(_value(_serve(), setting)) == value


def test_a_flag_wins_over_its_variable(monkeypatch):
    for name, value in {
        "port": "7000",
        "budget": "8",
        "kind": "chain",
        "retry_backoff": "0.5",
    }.items():
        monkeypatch.setenv(env_var(name), value)
    settings = _serve("--port", "9001", "--budget", "32")
    assert settings.port == 9001 and settings.retry_backoff == 0.5
    assert settings.tree == TreeSettings(kind="chain", budget=32)  # one tree, from both
    assert _serve("--kind", "ddtree").tree.kind == "ddtree"
    assert _serve("--no-draft").tree.kind == "none"


def test_an_empty_variable_counts_as_unset(monkeypatch):
    for setting in SETTINGS:
        monkeypatch.setenv(env_var(setting.name), "")
    _assert_defaults(_serve(), SETTINGS)


def test_one_tree_kind_flag_at_most(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chain", "--no-draft"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_generate_takes_the_models_defaults_and_no_variables(monkeypatch):
    monkeypatch.setenv(env_var("budget"), "4")
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    settings = settings_from_args(RuntimeSettings, args)
    _assert_defaults(settings, settings_of(RuntimeSettings))
    args = build_parser().parse_args(["generate", "--prompt", "x", "--chain", "--depth", "3"])
    assert settings_from_args(RuntimeSettings, args).tree == TreeSettings(kind="chain", depth=3)


@pytest.mark.parametrize(
    "argv, variables, message",
    [
        (["serve", "--port", "70000"], {}, "port: Input should be less than or equal to 65535"),
        (["serve", "--max-retries", "x"], {}, "max_retries: Input should be a valid integer"),
        (["serve"], {"DDTREE_BUDGET": "0"}, "tree.budget: Input should be greater than or equal to 1"),
        (["serve"], {"DDTREE_TARGET_URL": "vllm:8000"}, "target_url: Value error, must start with"),
        (["serve"], {"DDTREE_LOG_LEVEL": "loud"}, "log_level: Input should be 'critical'"),
        (["generate", "--prompt", "x", "--torch-threads", "0"], {},
         "torch_threads: Input should be greater than or equal to 1"),
        (["serve", "--ab-split", "1.5"], {}, "ab.ab_split: Input should be less than or equal to 1"),
        (["serve", "--shadow-budgets", "8,x"], {}, "ab.shadow_budgets: Value error, budgets must be integers"),
        (["serve"], {"DDTREE_SHADOW_DRAFTERS": "ngram,eagle"}, "ab.shadow_drafters: Value error, unknown drafter 'eagle'"),
        (["serve", "--shadow-drafters", "dflash:x"], {}, "ab.shadow_drafters: Value error, dflash needs"),
    ],
)  # fmt: skip
def test_a_bad_value_is_a_one_line_error(argv, variables, message, monkeypatch, capsys):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert cli_main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"ddtree-proxy: error: {message}"), stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.fixture
def project_loggers():
    yield
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)


@pytest.mark.parametrize(
    "flags, variables, debug",
    [
        (["--log-level", "debug"], {}, True),
        ([], {"DDTREE_LOG_LEVEL": "debug"}, True),
        ([], {}, False),  # info, the default
    ],
)
def test_log_level_sets_the_projects_loggers(
    flags, variables, debug, tmp_path, monkeypatch, caplog, project_loggers
):
    """`serve` sets the level before it builds the service, which fails here at once (a
    --tokenizer folder without tokenizer.json); then the project's loggers, by module
    name (proxy.*) or not (ddtree_proxy.*), pass on debug records or drop them."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    argv = ["serve", "--target-url", "http://127.0.0.1:9", "--tokenizer", str(tmp_path), *flags]
    assert cli_main(argv) == 2
    for name in ("proxy.runtime", "ddtree_proxy.server"):
        logging.getLogger(name).debug("debug from %s", name)
        logging.getLogger(name).info("info from %s", name)
    got = [record.getMessage() for record in caplog.records if " from " in record.getMessage()]
    want = [f"{level} from {name}" for name in ("proxy.runtime", "ddtree_proxy.server")
            for level in (("debug", "info") if debug else ("info",))]  # fmt: skip
    assert got == want


def _settings_table() -> str:
    rows = ["| flag | variable | setting |", "|---|---|---|"]
    rows += [f"| `{flag_of(s)}` | `{env_var(s.name)}` | {help_of(s)} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"


def test_readme_lists_every_setting():
    match = re.search(
        r"<!-- serve-settings:start -->\n(.*?)<!-- serve-settings:end -->",
        README.read_text(),
        re.S,
    )
    assert match, "README.md lost its serve-settings markers"
    assert match.group(1) == _settings_table(), "README's table is stale; it should read:\n" + (
        _settings_table()
    )
