"""How deriving grows with depth: time and peak memory for stacked layers.

    python benchmarks/bench_depth.py                    # attention_stack 1–3, post_ln_stack 1–2
    python benchmarks/bench_depth.py post_ln_stack:2    # one configuration

For each configuration a fresh process derives and display-simplifies every block
(outer and functional part of every ordered parameter pair) for both losses, MSE and
cross-entropy, and reports the derivation's time and its own peak resident memory
(``resource.getrusage`` maxrss, which includes the interpreter and the imports); the parent
adds the child's wall time (process start and imports included).  The child also reports the number of
distinct expression nodes in all blocks together (the DAGs' size).  Deriving needs no
numerics, so nothing here is compared with autograd; the numbers are checked by
``symhess verify`` and tests/test_stack.py.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

DEFAULT = ["attention_stack:1", "attention_stack:2", "attention_stack:3",
           "post_ln_stack:1", "post_ln_stack:2"]
PARTS = ("outer", "functional")
LOSSES = ("mse", "ce")


def child(spec):
    """Derive every block of one configuration; print a JSON line of what was measured."""
    import symhess as sh
    from symhess.expr import nodes as E

    name, depth = spec.split(":")
    t0 = time.perf_counter()
    lay = sh.layer(name, depth=int(depth))
    roots = []
    for loss in LOSSES:
        d = sh.derive(lay, loss)
        roots += [d.block(p, q, part).expr for p in lay.param_names for q in lay.param_names
                  for part in PARTS]
    elapsed = time.perf_counter() - t0
    nodes = set()
    for r in roots:
        nodes.update(E.walk(r))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss    # Linux: kilobytes
    print(json.dumps({"spec": spec, "params": len(lay.params), "blocks": len(roots),
                      "seconds": elapsed, "nodes": len(nodes), "peak_gb": peak_kb / 2 ** 20}))


def run(spec):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True,
                         text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row.update(wall=time.perf_counter() - t0)
    return row


def main(argv):
    if argv[:1] == ["--child"]:
        child(argv[1])
        return
    specs = argv or DEFAULT
    print(f"{'layer':<18}{'depth':>6}{'params':>8}{'blocks':>8}{'derive (s)':>12}"
          f"{'process (s)':>13}{'peak RSS (GB)':>15}{'DAG nodes':>11}")
    for spec in specs:
        row = run(spec)
        name, depth = spec.split(":")
        peak = f"{row['peak_gb']:.2f}"
        print(f"{name:<18}{depth:>6}{row['params']:>8}{row['blocks']:>8}{row['seconds']:>12.1f}"
              f"{row['wall']:>13.1f}{peak:>15}{row['nodes']:>11}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
