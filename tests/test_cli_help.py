"""`symhess … --help`: every option of every subcommand says what it means, each default is
stated once, and the help refers only to files and commands that exist."""
import argparse
import re
from pathlib import Path

import pytest

from symhess.cli.experiments import build_parser as experiment_parser
from symhess.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _parsers():
    """(command words, parser) for the program and every subcommand, experiments included."""
    out = []

    def walk(parser, words):
        out.append((words, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if words == ["symhess"] and name == "experiment":
                        walk(experiment_parser(), words + [name])   # its own parser (main dispatches)
                    else:
                        walk(sub, words + [name])

    walk(build_parser(), ["symhess"])
    return out


PARSERS = _parsers()
IDS = [" ".join(w) for w, _ in PARSERS]


def test_every_subcommand_is_walked():
    names = set(IDS)
    for cmd in ("layers", "derive", "verify", "report", "generate", "run", "spectrum"):
        assert f"symhess {cmd}" in names
    for exp in ("scaling", "histogram", "bounds"):
        assert f"symhess experiment {exp}" in names


@pytest.mark.parametrize("words,parser", PARSERS, ids=IDS)
def test_every_option_has_help_text(words, parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help, f"{' '.join(words)} {choice.dest}: no help"
            continue
        label = "/".join(action.option_strings) or action.dest
        assert action.help and action.help is not argparse.SUPPRESS, f"{' '.join(words)} {label}: no help"
        assert not action.help.lstrip().startswith("(default"), \
            f"{' '.join(words)} {label}: the help is only its default"


@pytest.mark.parametrize("words,parser", PARSERS, ids=IDS)
def test_each_default_is_stated_once(words, parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help:
            shown = formatter._expand_help(action)     # the text --help prints for it
            assert shown.lower().count("default") <= 1, f"{' '.join(words)} {action.option_strings}: {shown!r}"


@pytest.mark.parametrize("words,parser", PARSERS, ids=IDS)
def test_help_refers_only_to_what_exists(words, parser):
    text = parser.format_help()
    assert "§" not in text, f"{' '.join(words)} refers to a numbered section: {text}"
    for doc in re.findall(r"[\w/.-]+\.md", text):
        assert (ROOT / doc).is_file() or (ROOT / "docs" / doc).is_file(), f"{doc} does not exist"
    commands = {w[1] for w, _ in PARSERS if len(w) > 1}
    for cmd in re.findall(r"`symhess (\w+)", text):
        assert cmd in commands, f"{' '.join(words)} refers to `symhess {cmd}`, which does not exist"
    for mod in re.findall(r"python -m ([\w.]+)", text):
        assert mod == "symhess", f"{' '.join(words)} names `python -m {mod}`, which does not run"


def test_experiment_help_is_the_experiment_parser(capsys):
    assert main(["experiment", "--help"]) == 0
    out = capsys.readouterr().out
    assert "scaling" in out and "histogram" in out and "bounds" in out and "§" not in out
