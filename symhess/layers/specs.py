"""Layers named on a command line: a registered name or a user's declaration in a file or module.

A spec is one of

* ``NAME``                 — a registered layer (``symhess layers`` lists them);
* ``PATH.py:ATTR``         — attribute ATTR of the Python file PATH.py (PATH may contain
  directories; the file's directory is put on ``sys.path`` while it loads, so it can import
  its neighbours);
* ``package.module:ATTR``  — attribute ATTR of an importable module (the current directory
  is searched as well, like ``python -m``).

ATTR (may be dotted) is a ``Layer`` or a factory (any callable) that returns one; a factory is
called with the options (``--set KEY=VALUE``), checked against its signature first.  ATTR may
also be a torch module, or a factory returning a module, ``(module, example_inputs)`` or
``(module, example_inputs, kwargs)``: its declaration is ``symhess.from_module``'s.  Every
failure that is the user's — a missing file or module, a missing attribute, something that is
neither a Layer nor a factory, a factory that does not return a Layer, an exception raised by
the user's own code while loading or calling it — is a one-line ``DeclarationError`` (an
``UnknownNameError`` for missing names, an ``OptionError`` for options).  An exception raised
inside symhess itself is not wrapped: it is a bug and keeps its traceback.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from pathlib import Path

from ..errors import DeclarationError, OptionError, SymhessError, UnknownNameError
from .registry import LAYERS, layer, layer_options
from ..expr.layer import Layer, check_options

PACKAGE_DIR = Path(__file__).resolve().parents[1]   # the symhess package
_FILES = {}   # resolved path -> module, so a file that registers layers loads once


def is_user_spec(spec) -> bool:
    return isinstance(spec, str) and ":" in spec


def _split(spec):
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise DeclarationError(f"layer {spec!r}: expected NAME, FILE.py:ATTR or MODULE:ATTR")
    return where, attr


def _library(filename) -> bool:
    """A frame of symhess, the standard library, an installed package or importlib."""
    if filename.startswith("<"):
        return True
    path = Path(filename).resolve()
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    return path.is_relative_to(PACKAGE_DIR) or any(path.is_relative_to(r) for r in roots)


def _user_error(exc, what):
    """``exc``, raised while running the user's code, as a one-line DeclarationError naming
    the user's file and line; None when symhess itself raised a non-symhess exception below
    the user's code (a bug in symhess: the caller re-raises it with its traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    while frames and (Path(frames[0].filename).resolve().is_relative_to(PACKAGE_DIR)
                      or frames[0].filename.startswith("<")):
        frames.pop(0)                  # the loading machinery above the user's code
    if not isinstance(exc, SymhessError) and any(
            Path(f.filename).resolve().is_relative_to(PACKAGE_DIR) for f in frames):
        return None
    user = [f for f in frames if not _library(f.filename)]
    where = f" ({Path(user[-1].filename).name}, line {user[-1].lineno})" if user else ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" ({Path(exc.filename).name}, line {exc.lineno})"
        return DeclarationError(f"{what}: SyntaxError: {exc.msg}{where}")
    if isinstance(exc, SymhessError):
        return type(exc)(f"{what}: {exc}{where}")
    return DeclarationError(f"{what}: {type(exc).__name__}: {exc}{where}")


def _exit_error(exc, what):
    """A declaration that calls sys.exit while symhess loads or calls it: a DeclarationError
    (symhess would otherwise end silently with the declaration's status)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _library(f.filename)]
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    return DeclarationError(f"{what}: it called sys.exit({exc.code!r}){where}; a declaration "
                            f"must define layers, not end the program")


def _registered(spec):
    """The registered factory ``spec`` names; a miss that looks like a file or module path
    says how to name a declaration in it (FILE.py:ATTR, MODULE:ATTR)."""
    if spec not in LAYERS and (spec.endswith(".py") or os.sep in spec or Path(spec).exists()):
        raise UnknownNameError(f"unknown layer {spec!r}: a declaration in a file or module is "
                               f"named with its attribute, {spec}:ATTR (FILE.py:ATTR or "
                               f"MODULE:ATTR); registered layers: {', '.join(sorted(LAYERS))}")
    return LAYERS.lookup(spec)


def _load_file(path_text):
    path = Path(path_text).expanduser()
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise DeclarationError(f"cannot load layer file {path_text}: it {why}")
    key = path.resolve()
    if key in _FILES:
        return _FILES[key]
    name = "symhess_user_" + hashlib.blake2b(str(key).encode(), digest_size=6).hexdigest()
    spec = importlib.util.spec_from_file_location(name, key)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(key.parent))
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        del sys.modules[name]
        raise _exit_error(exc, f"loading {path_text} failed") from None
    except Exception as exc:
        del sys.modules[name]
        err = _user_error(exc, f"loading {path_text} failed")
        if err is None:
            raise
        raise err from exc
    finally:
        sys.path.remove(str(key.parent))
    _FILES[key] = module
    return module


def _import_module(name):
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise UnknownNameError(f"no module named {name!r} (a layer given as MODULE:ATTR must "
                                   f"be importable; a file needs the .py ending)") from None
        err = _user_error(exc, f"importing {name} failed")
        if err is None:
            raise
        raise err from exc
    except SystemExit as exc:
        raise _exit_error(exc, f"importing {name} failed") from None
    except Exception as exc:
        err = _user_error(exc, f"importing {name} failed")
        if err is None:
            raise
        raise err from exc
    finally:
        sys.path.remove(os.getcwd())


def _candidates(module):
    """Layers and functions defined in ``module`` (for the message of a missing attribute)."""
    out = []
    for k, v in vars(module).items():
        if k.startswith("_"):
            continue
        if isinstance(v, Layer) or (inspect.isfunction(v) and v.__module__ == module.__name__):
            out.append(k)
    return out


def target(spec):
    """(the Layer or factory ``spec`` names, a label for messages)."""
    if not is_user_spec(spec):
        return _registered(spec), repr(spec)
    where, attr = _split(spec)
    module = _load_file(where) if where.endswith(".py") or os.sep in where else _import_module(where)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = _candidates(module)
            raise UnknownNameError(f"{where} has no attribute {attr!r}; layers and functions "
                                   f"there: {', '.join(found) or 'none'}")
        obj = getattr(obj, part)
    if not (isinstance(obj, Layer) or callable(obj)):
        raise DeclarationError(f"{spec} is not a symhess Layer or a factory returning one "
                               f"(it is {type(obj).__name__} {obj!r:.40})")
    return obj, spec


def spec_options(spec) -> dict:
    """{option: default} of the layer or factory ``spec`` names ({} for a Layer)."""
    obj, _ = target(spec)
    if not is_user_spec(spec):
        return layer_options(spec)
    if isinstance(obj, Layer) or _torch_module(obj):
        return {}
    return _signature_options(obj, spec)


def _signature_options(fn, label):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    return {k: (p.default if p.default is not inspect.Parameter.empty else None)
            for k, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _torch_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _module_call(out):
    """(module, example_inputs, kwargs) when a factory returned a module (alone or with its
    example call), else None."""
    if _torch_module(out):
        return out, None, None
    if isinstance(out, tuple) and 2 <= len(out) <= 3 and _torch_module(out[0]):
        return out[0], out[1], (out[2] if len(out) == 3 else None)
    return None


def _captured(call, label):
    from .modules import from_module
    module, args, kwargs = call
    try:
        return from_module(module, args, kwargs).layer
    except SymhessError as exc:
        raise type(exc)(f"{label}: {exc}") from None


def resolve_layer(spec, options=None) -> Layer:
    """The layer a command line names, with ``options`` ({name: value}, e.g. from --set):

    * a registered name: ``"attention"`` (``layer(name, **options)``);
    * a user's declaration: ``"mymodels.py:gated"`` (a file) or ``"mypkg.mymodels:gated"`` (an
      importable module; the current directory is searched too), where the attribute is a
      ``Layer``, a factory returning one (called with ``options``), a torch module or a
      factory returning ``(module, example_inputs[, kwargs])`` (``symhess.from_module``).

    A missing file, module or attribute, an attribute that is neither, or options a factory
    does not take are one-line ``DeclarationError`` s."""
    options = options or {}
    if not isinstance(spec, str) or not spec:
        raise DeclarationError(f"a layer is named by a non-empty string, got {spec!r}")
    if not is_user_spec(spec):
        _registered(spec)
        return layer(spec, **options)
    obj, label = target(spec)
    if _torch_module(obj):
        if options:
            raise OptionError(f"{label} is a torch module, which takes no options; declare a "
                              f"factory to take options")
        return _captured((obj, None, None), label)
    if isinstance(obj, Layer):
        if options:
            raise OptionError(f"{label} is a Layer, which takes no options (got "
                              f"{', '.join(options)}); declare a factory to take options")
        return obj
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):   # no signature (some builtins): let the call decide
        sig = None
    if sig is not None:
        valid = _signature_options(obj, label)
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            valid = {**dict.fromkeys(options), **valid}     # **kwargs takes any name
        check_options(label, valid, options)
        try:
            sig.bind(**options)
        except TypeError as exc:
            raise OptionError(f"{label}: {exc} (pass it with --set KEY=VALUE)") from None
    try:
        out = obj(**options)
    except SystemExit as exc:
        raise _exit_error(exc, f"{label} failed") from None
    except Exception as exc:
        err = _user_error(exc, f"{label} failed")
        if err is None:
            raise
        raise err from exc
    call = _module_call(out)
    if call is not None:
        return _captured(call, label)
    if not isinstance(out, Layer):
        raise DeclarationError(f"{label} returned {type(out).__name__} {out!r:.40}, not a "
                               f"symhess Layer, a torch module or (module, example_inputs"
                               f"[, kwargs])")
    return out
