"""What every ``symhess`` subcommand shares: the argument parser with one-line errors, the
integer and ``--set KEY=VALUE`` option types, the layer a command names, progress on a
terminal only.  Exit statuses: 2 bad input (``EXIT_BAD_INPUT``), 3 a bug (``EXIT_BUG``)."""
from __future__ import annotations

import argparse
import math
import sys

from ..errors import OptionError, SymhessError
from ..layers.specs import resolve_layer, spec_options


BUG = "this is a bug in symhess; please report it with the command and the traceback"
EXIT_BAD_INPUT, EXIT_BUG = 2, 3
TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class CLIError(SymhessError, ValueError):
    """A user error found by the command line itself: printed as one line, exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default in its help unless it is None or False (nothing to say) or
    the help already says what the default means ("… (default: …)")."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (``symhess: error: …``, exit status 2) and every
    option's default shown in ``--help`` (every argument has a help text that says what it
    means)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"symhess: error: {message} (see '{self.prog} --help')\n")


def positive_int(text):
    """argparse type: an integer >= 1 (the error names the option)."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text):
    """argparse type: an integer >= 0 (seeds)."""
    return _int_at_least(text, 0, "a non-negative integer")


def positive_float(text):
    """argparse type: a finite number > 0 (σ, tolerances)."""
    return _finite_float(text, lambda x: x > 0, "a finite number > 0")


def nonnegative_float(text):
    """argparse type: a finite number >= 0 (0 often meaning a default)."""
    return _finite_float(text, lambda x: x >= 0, "a finite number >= 0")


def _finite_float(text, ok, what):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _int_at_least(text, low, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _parse_value(text):
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _parse_option(key, text, default):
    """A --set value: an option whose default is True/False takes true/false (yes/no, on/off,
    1/0) only; anything else is read as a number, None or a string."""
    if isinstance(default, bool):
        low = text.lower()
        if low in TRUE:
            return True
        if low in FALSE:
            return False
        raise OptionError(f"option {key} expects true or false, got {text!r}")
    return _parse_value(text)


def options_from_args(args) -> dict:
    """Layer options from --causal and --set KEY=VALUE, parsed by each option's default and
    validated against the layer (an error names the option and the valid ones)."""
    defaults = spec_options(args.layer)
    options = {}
    for item in args.set or []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise CLIError(f"--set expects KEY=VALUE with a non-empty KEY, got {item!r}; "
                           f"options of {args.layer}: {', '.join(defaults) or 'none'}")
        options[key] = _parse_option(key, value.strip(), defaults.get(key))
    if getattr(args, "causal", False):
        options["causal"] = True
    resolve_layer(args.layer, options)  # validate names and options early
    return options


def layer_from_args(args):
    return resolve_layer(args.layer, options_from_args(args))


def _progress() -> bool:
    """Progress bars only on a terminal."""
    return sys.stderr.isatty()
