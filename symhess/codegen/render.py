"""Kernel modules: render a declaration's variants as source, commit, cache and load them.

A module holds one ``Forward`` class per variant (loss, options) of a layer
(``codegen.python`` prints its members, the Jinja template ``templates/kernels.py.j2`` the file
skeleton).  Each class carries a ``STAMP``: the hash of the symhess version, the engine's
code-generating sources and the variant's declaration (output expression, parameters in
order, inputs, loss, options); each module ends with a ``CHECKSUM`` of its own text.

Where modules come from (``variant_class``):

1. ``generated/<layer>.py`` of a source checkout, for registered layers at the committed
   options (``variants``): the golden set that reviews see and CI keeps current
   (``symhess generate --check``);
2. else the user cache (``cache_dir()``: ``$SYMHESS_CACHE_DIR``, else
   ``$XDG_CACHE_HOME/symhess``, else ``~/.cache/symhess``), one file per variant named by
   its stamp;
3. else it is rendered, written to the cache atomically, and loaded.

A module is written once for both backends: its source names the backend's operations
(``Forward``, ``net``, ``softmax_rows`` …) without importing them, and the loader executes it
in a namespace holding the chosen backend's op table (``symhess.runtime.numpy_ops`` or
``torch_ops``, their ``__all__``), so one file gives a NumPy class and a torch class.
``load_module(path, backend)`` loads a file written by ``symhess generate LAYER --out DIR``.

A module whose checksum or stamp disagree (edited by hand, or left behind by a change of
the declaration or of symhess) is not used: a warning names it and the variant is rendered
afresh, and the cache file is replaced (so a corrupt file, e.g. bytes that are not text, is
repaired by the next run).  Every write goes through ``symhess.codegen.files.write_atomic``: atomic
for readers (a temporary file in the same folder, then ``os.replace``), the umask's modes,
never through a symbolic link; processes that render the same variant at once each replace
the file with the same text, and temporaries that a killed run left behind are removed by a
later one once they are an hour old (a younger one may be another process's write).
"""
from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import os
import warnings
from functools import lru_cache
from pathlib import Path

import jinja2

from .._version import __version__
from ..errors import DeclarationError
from .files import TMP_PREFIX, remove_stale_temporaries, write_atomic  # noqa: F401
from ..calculus.hessian import derive
from ..layers.registry import LAYERS, layer as get_layer, layer_options
from ..expr.layer import Layer
from .python import Printer
from .program import Program

PACKAGE = Path(__file__).resolve().parents[1]      # the symhess package
ROOT = PACKAGE.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
GENERATED = ROOT / "generated"
BACKENDS = ("numpy", "torch")

DEFAULT_LOSSES = ("mse", "ce")
# options whose every value is committed; others are committed at their defaults
VARIED_OPTIONS = ("causal",)
# layers whose kernels are rendered on demand only, never committed (with the reason)
ON_DEMAND = {
    "addition_block": "the experiments' model: its losses are the custom ce_answer/mse_sum; "
                      "its kernels are rendered into the user cache on first use",
    "attention_stack": "a deep model (3·depth parameters): kernels rendered on demand",
    "post_ln_stack": "a deep model (5·depth parameters): kernels rendered on demand",
}
# the sources whose code decides what a module contains (part of every stamp)
ENGINE = ("expr/nodes.py", "expr/scalarfn.py", "calculus/rules.py", "calculus/kron.py",
          "calculus/adjoint.py", "calculus/hessian.py", "calculus/simplify.py",
          "calculus/losses.py", "codegen/program.py", "codegen/render.py", "codegen/index.py",
          "codegen/python.py", "codegen/templates/kernels.py.j2", "codegen/templates/part.py.j2")
# a declaration with more parameters than this, rendered on first use, is rendered in parts:
# its forward quantities and matrix-view routines (loss, gradient, Hessian–vector products)
# at once, each pair's blocks and each Jacobian when first asked for (their number grows with
# the square of the parameters: 300 blocks for the 24 pieces of a captured block's heads)
PARTS_ABOVE = 8


# ----------------------------------------------------------------------------- variants
def generated_losses(layer_name):
    """The losses committed for a layer: ``factory.losses`` if declared, else mse and ce."""
    return tuple(getattr(LAYERS.lookup(layer_name), "losses", DEFAULT_LOSSES))


def variants(layer_name):
    """(loss, options) pairs committed for a registered layer: its losses × every value of
    the boolean options in ``VARIED_OPTIONS`` (the other options at their defaults)."""
    opts = layer_options(layer_name)
    flags = sorted(k for k in VARIED_OPTIONS if isinstance(opts.get(k), bool))
    out = []
    for loss in generated_losses(layer_name):
        for values in itertools.product((False, True), repeat=len(flags)):
            o = dict(opts)
            o.update(zip(flags, values))
            out.append((loss, tuple(sorted(o.items()))))
    return out


def committed_layers():
    return sorted(n for n in LAYERS if n not in ON_DEMAND)


def class_name(loss, options):
    flags = "".join(f"_{k}{int(v)}" for k, v in options if isinstance(v, bool))
    return f"{loss}{flags}"


# ----------------------------------------------------------------------------- stamps
@lru_cache(maxsize=None)
def engine_fingerprint() -> str:
    h = hashlib.sha256()
    for rel in ENGINE:
        h.update(rel.encode())
        h.update((PACKAGE / rel).read_bytes())
    return h.hexdigest()[:16]


def stamp(layer: Layer, loss: str) -> str:
    """The hash a variant's class is stamped with (version, engine, declaration)."""
    h = hashlib.sha256()
    parts = [__version__, engine_fingerprint(), loss, layer.output.key,
             repr([(p.name, str(p.rows), str(p.cols)) for p in layer.params]),
             repr([(v.name, str(v.rows), str(v.cols), v.role) for v in layer.inputs]),
             repr(sorted((k, v.key) for k, v in layer.intermediates.items())),
             repr([c.input.key for c in layer.batch_checks])]
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _with_checksum(body: str) -> str:
    return body + f'CHECKSUM = "{checksum(body)}"\n'


def _checksum_ok(text: str) -> bool:
    body, sep, tail = text.rpartition('CHECKSUM = "')
    return bool(sep) and tail.strip() == f'{checksum(body)}"'


# ----------------------------------------------------------------------------- rendering
@lru_cache(maxsize=None)
def _template(name="kernels.py.j2"):
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False, trim_blocks=True)
    return env.get_template(name)


def render_variant(layer: Layer, loss: str, options=(), parts=False):
    """The template's data for one variant's class (``parts``: its forward quantities and
    routines only; blocks and Jacobians come from ``render_part`` on first use)."""
    d = _derivation(layer, loss)
    prog = Program.build(d, jacobians=not parts, pairs=[] if parts else None)
    printer = Printer(prog)
    members = printer.members()
    out = {"cls": class_name(loss, options), "loss": loss, "options": dict(options),
           "key": repr((loss, tuple(options))), "params": repr(tuple(layer.param_names)),
           "stamp": stamp(layer, loss), "members": members,
           "runs": [f"{run!r}: {n}," for run, n in printer.shared_runs().items()]}
    if parts:
        out["leaf_keys"] = [f"{k!r}: {v!r}," for k, v in printer.leaf_keys().items()]
    return out


_DERIVATIONS = {}


def _derivation(layer, loss):
    """One derivation per declaration and loss in a process: the parts of a variant rendered
    on first use share its gradients and output differentials."""
    key = (stamp(layer, loss), loss)
    if key not in _DERIVATIONS:
        _DERIVATIONS.clear()                       # keep one: derivations hold large DAGs
        _DERIVATIONS[key] = derive(layer, loss)
    return _DERIVATIONS[key]


def part_name(what):
    return "__".join(what)


def render_part(layer: Layer, loss: str, what, leaf_keys, base_stamp, variant):
    """The source of one part of a variant rendered in parts: ("block", p, q) — both parts of
    H(p, q) —, ("jacobian", p), or ("blocks",) — every block at once (one lowering, whose
    shared sub-expressions and compact tensors serve all blocks)."""
    d = _derivation(layer, loss)
    if what[0] == "blocks":
        prog = Program.build(d, jacobians=False, routines=False)
    elif what[0] == "block":
        prog = Program.build(d, jacobians=False, pairs=[(what[1], what[2])], routines=False)
    else:
        prog = Program.build(d, jacobians=[what[1]], pairs=[], routines=False)
    printer = Printer(prog, known=leaf_keys, suffix="__" + part_name(what))
    members = printer.members()
    desc = {"blocks": "every block (outer and functional)",
            "block": f"the blocks H({', '.join(what[1:])}) (outer and functional)",
            "jacobian": f"the Jacobian ∂F/∂{what[-1]}"}[what[0]]
    body = _template("part.py.j2").render(version=__version__, layer=layer.name,
                                          variant=variant, what=desc, base_stamp=base_stamp,
                                          stamp=_part_stamp(base_stamp, what), members=members)
    return _with_checksum(body)


def _part_stamp(base, what):
    return hashlib.sha256((base + "\0" + part_name(what)).encode()).hexdigest()[:24]


def render_module(name: str, entries, description: str = "") -> str:
    """A module's source from rendered variants (``render_variant`` results)."""
    body = _template().render(version=__version__, layer=name,
                              description=description or f"The layer {name}.",
                              variants=entries)
    return _with_checksum(body)


def render_layer(name: str):
    """{relative path: source} of a registered layer's committed module (both backends)."""
    entries = [render_variant(get_layer(name, **dict(opts)), loss, opts)
               for loss, opts in variants(name)]
    desc = " ".join((get_layer(name).description or "").split())
    return {f"{name}.py": render_module(name, entries, desc)}


def render_all(progress=None):
    """{relative path: source} for every committed layer."""
    out = {}
    names = committed_layers()
    for name in (progress(names) if progress else names):
        out.update(render_layer(name))
    return out


# ----------------------------------------------------------------------------- files
def generate(out_dir=GENERATED, check=False, progress=None) -> list:
    """Write (or with ``check`` only compare) every committed module; returns the stale
    paths (missing, different, or no longer generated).  Each file is replaced atomically."""
    out_dir = Path(out_dir)
    files = render_all(progress)
    stale = _differing(out_dir, files)
    if out_dir.exists():
        for path in sorted(out_dir.rglob("*.py")):
            if str(path.relative_to(out_dir)) not in files:
                stale.append(str(path))
    if check:
        return stale
    remove_stale_temporaries(out_dir)
    for rel, src in files.items():
        if str(out_dir / rel) in stale:
            write_atomic(out_dir / rel, src)
    for path in stale:
        p = Path(path)
        if p.exists() and str(p.relative_to(out_dir)) not in files:
            p.unlink()
            if p.parent != out_dir and not any(p.parent.iterdir()):
                p.parent.rmdir()
    return stale


def check_layer(name, out_dir=GENERATED) -> list:
    """The stale paths among one layer's committed modules (empty for an on-demand layer)."""
    if name in ON_DEMAND:
        return []
    return _differing(Path(out_dir), render_layer(name))


def _differing(out_dir, files):
    return [str(out_dir / rel) for rel, src in files.items()
            if not (out_dir / rel).is_file() or (out_dir / rel).read_bytes() != src.encode()]


def main_check_layer(name, out_dir=GENERATED) -> int:
    """CLI entry for ``symhess run``: prints the layer's stale modules; exit code 1 if any."""
    if name in ON_DEMAND:
        print(f"{name}: kernels are not committed ({ON_DEMAND[name]})")
        return 0
    stale = check_layer(name, out_dir)
    for path in stale:
        print(f"stale: {path}")
    if stale:
        print(f"{len(stale)} generated file(s) of {name} differ from a fresh generation; "
              "run `symhess generate`")
        return 1
    print(f"generated/{name}.py is up to date")
    return 0


def main_generate(check: bool, out_dir=GENERATED, progress=None) -> int:
    """CLI entry: generate (or check); prints the stale files; exit code 1 if check finds any."""
    stale = generate(out_dir, check=check, progress=progress)
    for path in stale:
        print(f"{'stale' if check else 'written' if Path(path).exists() else 'removed'}: {path}")
    if check and stale:
        print(f"{len(stale)} generated file(s) differ from a fresh generation; run `symhess generate`")
        return 1
    if not stale:
        print("generated/ is up to date")
    return 0


def diff(a: str, b: str) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True)))


# ----------------------------------------------------------------------------- loading
def cache_dir() -> Path:
    """The user cache of rendered modules."""
    env = os.environ.get("SYMHESS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "symhess"


def backend_names(backend: str) -> dict:
    """The names a kernel module uses, from the backend's op table (its ``__all__``)."""
    if backend not in BACKENDS:
        raise DeclarationError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "torch":
        from ..runtime import torch_ops as ops
    else:
        from ..runtime import numpy_ops as ops
    return {n: getattr(ops, n) for n in ops.__all__}


@lru_cache(maxsize=64)
def _compiled(text, filename):
    return compile(text, filename, "exec")     # once for both backends


def _exec(text, filename, name, backend):
    ns = {**backend_names(backend), "__name__": name, "__file__": filename}
    exec(_compiled(text, filename), ns)   # exec'd, not imported: no __pycache__ written
    return ns


def _from_file(path: Path, key, want, backend):
    """The class for ``key`` in a module file, if the file is intact and stamped ``want``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"{path} cannot be read ({exc.strerror}); the kernels are rendered "
                      "afresh", stacklevel=4)
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or not _checksum_ok(text):
        why = "is not UTF-8 text" if text is None else "does not match its CHECKSUM"
        warnings.warn(f"{path} was modified after it was generated (it {why}); it is not "
                      "used and the kernels are rendered afresh", stacklevel=4)
        return None
    ns = _exec(text, str(path), f"symhess_kernels_{path.stem}", backend)
    cls = ns.get("VARIANTS", {}).get(key)
    if cls is None:
        return None
    if cls.STAMP != want:
        warnings.warn(f"{path} was generated from another declaration or symhess version "
                      f"(stamp {cls.STAMP}, expected {want}); it is not used and the kernels "
                      "are rendered afresh (run `symhess generate`)", stacklevel=4)
        return None
    return cls


def module_class(path, layer: Layer, backend: str, loss: str):
    """The class of ``layer``'s variant for ``loss`` in a given module file (``symhess generate
    LAYER --out DIR``), bound to ``backend`` and found by its stamp (the declaration, loss and
    symhess version); a ``DeclarationError`` when the file is missing, was modified, or holds
    no such variant (nothing is rendered instead)."""
    path = Path(path)
    if not path.is_file():
        raise DeclarationError(f"kernel module {path} does not exist (write it with "
                               f"`symhess generate LAYER --out DIR`)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or not _checksum_ok(text):
        why = "is not UTF-8 text" if text is None else "its CHECKSUM does not match"
        raise DeclarationError(f"kernel module {path} was modified after it was generated ({why}); "
                               "generate it again")
    want = stamp(layer, loss)
    found = _exec(text, str(path), f"symhess_kernels_{path.stem}", backend).get("VARIANTS", {})
    for (lo, _), cls in found.items():
        if lo == loss and cls.STAMP == want:
            return cls
    have = ", ".join(f"loss={k[0]} options={dict(k[1])}" for k in found) or "none"
    raise DeclarationError(f"kernel module {path} holds no variant of this declaration of "
                           f"{layer.name!r} for loss={loss} and symhess {__version__} (it "
                           f"holds: {have}); generate it again")


_LOADED = {}


def variant_class(layer: Layer, backend: str, loss: str, options=(), registered=None):
    """The generated class of one variant: committed, cached or freshly rendered."""
    if backend not in BACKENDS:
        raise DeclarationError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    want = stamp(layer, loss)
    mem_key = (backend, want, loss, tuple(options))
    if mem_key in _LOADED:
        return _LOADED[mem_key]
    key = (loss, tuple(options))
    cls = None
    if registered is not None and registered not in ON_DEMAND:
        cls = _from_file(GENERATED / f"{registered}.py", key, want, backend)
    path = cache_dir() / __version__ / f"{_ident(layer.name)}-{loss}-{want}.py"
    if cls is None:
        cls = _from_file(path, key, want, backend)
    if cls is None:
        entry = render_variant(layer, loss, options, parts=len(layer.params) > PARTS_ABOVE)
        text = render_module(layer.name, [entry], " ".join((layer.description or "").split()))
        try:
            remove_stale_temporaries(path.parent)
            write_atomic(path, text)
        except OSError as exc:          # an unwritable cache costs a re-render next time
            warnings.warn(f"could not cache the kernels in {path}: {exc.strerror}", stacklevel=3)
        cls = _exec(text, str(path), f"symhess_kernels_{path.stem}", backend)["VARIANTS"][key]
    if getattr(cls, "LEAF_KEYS", None) is not None:
        folder = path.parent / path.stem
        cls.LAZY = staticmethod(lambda what: _part_class(layer, backend, loss, cls, folder, what))
    _LOADED[mem_key] = cls
    return cls


def _part_class(layer, backend, loss, cls, folder, what):
    """The mixin class of one part of a variant rendered in parts: loaded from the cache
    folder of the variant, or rendered and written there."""
    mem_key = (backend, cls.STAMP, what)
    if mem_key in _LOADED:
        return _LOADED[mem_key]
    want = _part_stamp(cls.STAMP, what)
    path = folder / f"{part_name(what)}.py"
    ns = None
    if path.exists():
        text = path.read_text(encoding="utf-8")
        if _checksum_ok(text):
            ns = _exec(text, str(path), f"symhess_part_{path.stem}", backend)
            if getattr(ns.get("Part"), "STAMP_PART", None) != want:
                ns = None
        else:
            warnings.warn(f"{path} was modified after it was generated (its CHECKSUM does not "
                          "match); it is not used and the part is rendered afresh", stacklevel=4)
    if ns is None:
        text = render_part(layer, loss, what, cls.LEAF_KEYS, cls.STAMP, cls.__name__)
        try:
            write_atomic(path, text)
        except OSError as exc:
            warnings.warn(f"could not cache the kernels in {path}: {exc.strerror}", stacklevel=4)
        ns = _exec(text, str(path), f"symhess_part_{path.stem}", backend)
    part = ns["Part"]
    _LOADED[mem_key] = part
    return part


def _ident(name):
    return "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in name) or "layer"


def describe(options) -> str:
    return json.dumps(dict(options), default=str)
