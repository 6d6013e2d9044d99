"""Index contractions printed as one statement per pairwise step (``Routine.contract``):
random networks against ``np.einsum`` in both backends, and the properties the kernels rely
on (results in the requested layout, identical steps shared, stacked dense terms exact)."""
import numpy as np
import pytest
import sympy as sp
import torch

from symhess import expr as E
from symhess.codegen import TARGETS
from symhess.printing.code import BATCH, Routine
from symhess.printing.index import Lowering
from symhess.smallk import matmul_into

LETTERS = "abcdefghij"


def routine(backend, symbols=(), sizes=None):
    x = E.matrix("X", 2, 2)      # a placeholder variable: Routine needs one to type arrays
    return Routine(TARGETS[backend], {"X": x}, ["X"], list(symbols), lowering=Lowering(),
                   sizes=sizes)


def network(rng, rt, n_ops):
    """Random operands over labels of sizes 2–5; some labels shared, some free, maybe one
    batch label carried by every operand (a per-sequence network)."""
    n_labels = int(rng.integers(2, 7))
    labels = [rt.lw.labels.new(int(rng.integers(2, 6))) for _ in range(n_labels)]
    batched = bool(rng.integers(0, 2))
    labs = []
    for _ in range(n_ops):
        k = int(rng.integers(1, min(4, n_labels) + 1))
        labs.append([labels[int(i)] for i in rng.choice(n_labels, size=k, replace=False)])
    used = list(dict.fromkeys(a for ls in labs for a in ls))
    out = [a for a in used if rng.random() < 0.4]
    rng.shuffle(out)
    if batched:
        labs = [[BATCH] + ls for ls in labs]
        out = [BATCH] + out
    return labs, out


def size(rt, lab):
    return 3 if isinstance(lab, tuple) else int(rt.lw.labels.size[lab])


def evaluate(rt, backend, code, arrays):
    ns = {"np": np, "torch": torch, "n_batch": 3}
    ns.update({k: (torch.tensor(v) if backend == "torch" else v) for k, v in arrays.items()})
    ns["oe"] = __import__("opt_einsum")
    exec("\n".join(rt.lines + [f"__result = {code}"]), ns)
    r = ns["__result"]
    return r.numpy() if backend == "torch" else np.asarray(r)


def reference(labs, out, arrays, names):
    sym = {}
    for lab in [a for ls in labs for a in ls] + out:
        sym.setdefault(lab, LETTERS[len(sym)])
    spec = ",".join("".join(sym[a] for a in ls) for ls in labs) + "->" + "".join(sym[a] for a in out)
    return np.einsum(spec, *[arrays[n] for n in names])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("seed", range(40))
def test_random_networks_match_einsum(backend, seed):
    rng = np.random.default_rng(seed)
    rt = routine(backend)
    labs, out = network(rng, rt, int(rng.integers(1, 6)))
    names = [f"x{i}" for i in range(len(labs))]
    arrays = {n: rng.standard_normal([size(rt, a) for a in ls]) for n, ls in zip(names, labs)}
    for n in names:
        rt.is_batched[n] = False
    code = rt.contract(names, labs, out)
    got = evaluate(rt, backend, code, arrays)
    want = reference(labs, out, arrays, names)
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_identical_steps_of_two_networks_are_one_statement():
    """Σ A[i,j] B[j] C[i,m] and Σ A[i,j] B[j] D[i,m]: the first step, A B, is printed once
    (the routine's common-subexpression table)."""
    rt = routine("numpy")
    i, j, m = (rt.lw.labels.new(n) for n in (50, 40, 30))
    for n in ("A", "B", "C", "D"):
        rt.is_batched[n] = False
    first = rt.contract(["A", "B", "C"], [[i, j], [j], [i, m]], [m])
    second = rt.contract(["A", "B", "D"], [[i, j], [j], [i, m]], [m])
    products = [ln for ln in rt.lines if "A" in ln and "B" in ln]
    assert len(products) == 1, rt.lines
    assert first != second
    rng = np.random.default_rng(0)
    arrays = {"A": rng.standard_normal((50, 40)), "B": rng.standard_normal(40),
              "C": rng.standard_normal((50, 30)), "D": rng.standard_normal((50, 30))}
    for code, other in ((first, "C"), (second, "D")):
        want = np.einsum("ij,j,im->m", arrays["A"], arrays["B"], arrays[other])
        assert np.allclose(evaluate(rt, "numpy", code, arrays), want)


def test_no_opt_einsum_call_without_a_repeated_index():
    """Every step is a matmul, a broadcast product or a sum: ``oe.contract`` (60–110 µs of
    parsing per call) is printed only for a diagonal (a repeated index on one operand)."""
    rng = np.random.default_rng(7)
    rt = routine("torch")
    for _ in range(30):
        labs, out = network(rng, rt, int(rng.integers(2, 6)))
        names = [f"y{len(rt.lines)}_{i}" for i in range(len(labs))]
        for n in names:
            rt.is_batched[n] = False
        code = rt.contract(names, labs, out)
        assert "oe.contract" not in code and not any("oe.contract" in ln for ln in rt.lines)


def test_a_diagonal_still_contracts_correctly():
    rt = routine("numpy")
    i, j = rt.lw.labels.new(3), rt.lw.labels.new(4)
    rt.is_batched["A"] = rt.is_batched["B"] = False
    code = rt.contract(["A", "B"], [[i, i, j], [j]], [i])
    rng = np.random.default_rng(0)
    arrays = {"A": rng.standard_normal((3, 3, 4)), "B": rng.standard_normal(4)}
    got = evaluate(rt, "numpy", code, arrays)
    assert np.allclose(got, np.einsum("iij,j->i", arrays["A"], arrays["B"]))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_product_lands_in_the_requested_layout(backend):
    """out[a, b, c, e] = Σ_k X[a, c, k] Y[b, e, k] (a Kronecker-type block term): the
    result is exactly in the requested order for every permutation of the output."""
    import itertools
    rng = np.random.default_rng(1)
    rt = routine(backend)
    a, b, c, e, k = (rt.lw.labels.new(s) for s in (2, 3, 4, 5, 6))
    x, y = rng.standard_normal((2, 4, 6)), rng.standard_normal((3, 5, 6))
    full = np.einsum("ack,bek->abce", x, y)
    for perm in itertools.permutations(range(4)):
        out = [[a, b, c, e][p] for p in perm]
        code = rt.product("X_", [a, c, k], "Y_", [b, e, k], out)
        got = evaluate(rt, backend, code, {"X_": x, "Y_": y})
        assert np.allclose(got, full.transpose(perm)), perm


def test_symbolic_sizes_print_as_names():
    """Reshapes use the bound dimension names, so one routine serves every size."""
    d, m = sp.symbols("d m", positive=True, integer=True)
    rt = routine("numpy", [d, m], {"d": 4, "m": 3})
    i, j, k = rt.lw.labels.new(d), rt.lw.labels.new(m), rt.lw.labels.new(d)
    rt.is_batched["A"] = rt.is_batched["B"] = False
    code = rt.contract(["A", "B"], [[i, j, k], [j]], [k, i])
    assert "4" not in code and "3" not in code
    for dd, mm in ((4, 3), (2, 5)):
        ns = {"np": np, "d": dd, "m": mm, "A": np.arange(dd * mm * dd * 1.0).reshape(dd, mm, dd),
              "B": np.linspace(1, 2, mm)}
        exec("\n".join(rt.lines), ns)
        got = eval(code, ns)
        assert np.allclose(got, np.einsum("ijk,j->ki", ns["A"], ns["B"]))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_sum_of_networks_multiplies_a_shared_factor_once(backend):
    """Σ_t A[i,s] T_t[s,u] F[u,m] (three networks sharing A and F, as the R operands of a
    Hessian row slab do): ``_sum_nets`` prints A (Σ_t T_t) F, two products instead of two
    per network, and the sum is exact."""
    rng = np.random.default_rng(3)
    rt = routine(backend)
    i, s, u, m = (rt.lw.labels.new(n) for n in (7, 5, 6, 9))
    names = ["A", "T0", "T1", "T2", "F"]
    for n in names:
        rt.is_batched[n] = False
    arrays = {"A": rng.standard_normal((7, 5)), "F": rng.standard_normal((6, 9))}
    arrays.update({f"T{t}": rng.standard_normal((5, 6)) for t in range(3)})
    nets = [(["A", f"T{t}", "F"], [[i, s], [s, u], [u, m]], [i, m]) for t in range(3)]
    total = rt._sum_nets(nets, 1)
    kept = rt.pruned(total)
    assert sum(ln.count("@") for ln in kept) == 2, kept     # A (Σ_t T_t) F: two products
    rt.lines = kept
    got = evaluate(rt, backend, total, arrays)
    want = sum(arrays["A"] @ arrays[f"T{t}"] @ arrays["F"] for t in range(3))
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_pruned_drops_dead_statements_with_their_comments_and_dels():
    rt = routine("numpy")
    rt.lines = ["a = X + 1", "# b: a compact tensor", "b = a * 2", "c = a - 1",
                "H = np.empty((2, 2))", "t = H[0:1]", "t[...] = c", "# unused", "d = b + c",
                "del b", "e = c"]
    assert rt.pruned("H") == ["a = X + 1", "c = a - 1", "H = np.empty((2, 2))", "t = H[0:1]",
                              "t[...] = c"]
    # a name read by the result keeps its chain
    assert "b = a * 2" in rt.pruned("(H, b)")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_broadcast_product_is_computed_in_the_requested_layout(backend):
    """out[a, b, c, e] = X[a, c] Y[b, c, e] (nothing summed): both operands are aligned to the
    output order, so the product needs no permuted copy after it, for every order; a dense
    write can then multiply straight into its target (the operands are remembered)."""
    import itertools
    rng = np.random.default_rng(2)
    rt = routine(backend)
    a, b, c, e = (rt.lw.labels.new(s) for s in (2, 3, 4, 5))
    x, y = rng.standard_normal((2, 4)), rng.standard_normal((3, 4, 5))
    full = np.einsum("ac,bce->abce", x, y)
    for perm in itertools.permutations(range(4)):
        out = [[a, b, c, e][p] for p in perm]
        code = rt.product("X_", [a, c], "Y_", [b, c, e], out)
        assert code in rt.bcast and code.endswith(")"), code
        got = evaluate(rt, backend, code, {"X_": x, "Y_": y})
        assert np.allclose(got, full.transpose(perm)), perm
        target = np.zeros(got.shape) if backend == "numpy" else torch.zeros(got.shape,
                                                                            dtype=torch.float64)
        ns = {"np": np, "torch": torch, "X_": x if backend == "numpy" else torch.tensor(x),
              "Y_": y if backend == "numpy" else torch.tensor(y), "out_": target}
        exec(rt.fmt("mul_into", *rt.bcast[code][:2], "out_") + "\n" +
             rt.fmt("addmul_into", *rt.bcast[code][:2], "out_"), ns)
        assert np.allclose(np.asarray(ns["out_"]), 2 * full.transpose(perm)), perm


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_matrix_product_is_written_straight_into_a_strided_block(backend):
    """A product (P, M, K) @ (P, K, N) already in the block's order is written by BLAS
    (NumPy) or ``symhess.smallk.matmul_into`` (torch) into the block (a column slice of a
    wider array: strided rows) instead of via a temporary; torch also accumulates in place. A layout whose groups cannot merge in
    place (M across the rows and the columns) is left to the copying write."""
    rng = np.random.default_rng(3)
    x3, y3 = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 6, 5))
    x2, y2 = rng.standard_normal((4, 6)), rng.standard_normal((6, 5))
    cases = [  # (operand labels, out labels, (n_lead, n_rows, n_atoms), block shape, einsum)
        ("pmk,pkn->pmn", (0, 2, 3), (12, 5), x3, y3),     # P, M rows; N columns: bmm
        ("pmk,pkn->pmn", (0, 1, 3), (3, 20), x3, y3),     # P rows; M, N columns: bmm
        ("mk,kn->mn", (0, 1, 2), (4, 5), x2, y2),         # M rows; N columns: mm
    ]
    for spec, split, shape, x, y in cases:
        rt = routine(backend)
        lab = {ch: rt.lw.labels.new(n) for ch, n in {"p": 3, "m": 4, "k": 6, "n": 5}.items()}
        ins, out = spec.split("->")
        code = rt.product("X_", [lab[ch] for ch in ins.split(",")[0]],
                          "Y_", [lab[ch] for ch in ins.split(",")[1]], [lab[ch] for ch in out])
        assert code in rt.gemms, code
        want = np.einsum(spec, x, y)
        wide = np.full((shape[0], shape[1] + 7), np.nan)
        ns = {"np": np, "torch": torch, "_matmul_into": matmul_into}
        if backend == "torch":
            wide = torch.tensor(wide)
            ns.update(X_=torch.tensor(x), Y_=torch.tensor(y))
        else:
            ns.update(X_=x, Y_=y)
        ns["blk_"] = wide[:, 7:]
        view = rt.emit(rt.fmt("view", "blk_", rt.shape(list(want.shape))), False)
        assert rt._gemm_into(view, code, True, {split})
        added = rt._gemm_into(view, code, False, {split})
        assert added == (backend == "torch")          # NumPy has no in-place accumulating GEMM
        exec("\n".join(rt.lines), ns)
        got = np.asarray(ns["blk_"]).reshape(want.shape)
        assert np.allclose(got, (2 if added else 1) * want)
        assert np.isnan(np.asarray(wide)[:, :7]).all()      # nothing outside the block
        assert any("np.matmul(" in ln and "out=" in ln if backend == "numpy" else
                   ln.startswith("_matmul_into(") for ln in rt.lines)
    rt = routine(backend)
    p, m, k, n = (rt.lw.labels.new(s) for s in (3, 4, 6, 5))
    code = rt.product("X_", [p, m, k], "Y_", [p, k, n], [p, m, n])
    assert not rt._gemm_into("blk_", code, True, {(0, 3, 3)})   # no column axis for N
    assert not rt._gemm_into("blk_", code, True, {(0, 2, 3), (0, 1, 3)})  # two layouts


def test_a_compact_sum_reuses_an_earlier_one_it_contains_up_to_a_scalar():
    """S₂ = k·S₁ + rest is printed from S₁ when S₁'s terms all appear in S₂ with one common
    ratio k; a different ratio on one term, or a term missing, keeps the sum as it is."""
    d = sp.Symbol("d")
    rt = routine("numpy")
    rt.sums["S1"] = [(sp.Integer(1), "a"), (2 / d, "b")]
    assert rt._reused_sum([(3 / d, "a"), (6 / d**2, "b"), (1, "c")]) == [(3 / d, "S1"), (1, "c")]
    assert rt._reused_sum([(1, "b"), (2 / d, "a")]) == [(1, "b"), (2 / d, "a")]
    assert rt._reused_sum([(1, "a"), (1, "c")]) == [(1, "a"), (1, "c")]
    rt.sums["S2"] = [(sp.Integer(1), "a"), (2 / d, "b"), (sp.Integer(1), "c")]
    assert rt._reused_sum([(2, "a"), (4 / d, "b"), (2, "c")]) == [(2, "S2")]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_block_term_is_split_so_that_its_gemm_writes_the_block(backend):
    """Σ_l c[l,f] X[l,k'] E[l,k,q] into a block [k, f, k', q] (rows (k, f)): opt_einsum's
    cheapest order multiplies c ∘ X first and leaves a product that must be permuted into the
    block; split as c (broadcast over k) times X ∘ E, one batched GEMM writes it in place."""
    rng = np.random.default_rng(5)
    rt = routine(backend)
    sz = {"l": 3, "f": 16, "k": 4, "k2": 4, "q": 8}
    lab = {n: rt.lw.labels.new(s) for n, s in sz.items()}
    arrays = {"C_": rng.standard_normal((3, 16)), "X_": rng.standard_normal((3, 4)),
              "E_": rng.standard_normal((3, 4, 8))}
    labs = [[lab["l"], lab["f"]], [lab["l"], lab["k2"]], [lab["l"], lab["k"], lab["q"]]]
    out = [lab["k"], lab["f"], lab["k2"], lab["q"]]
    code = rt.split_contract(["C_", "X_", "E_"], labs, out, layout=(0, 2))
    assert code.split is not None and code in rt.gemms
    want = np.einsum("lf,lj,lkq->kfjq", arrays["C_"], arrays["X_"], arrays["E_"])
    wide = np.full((64, 32 + 5), np.nan)
    ns = {"np": np, "torch": torch, "_matmul_into": matmul_into}
    conv = torch.tensor if backend == "torch" else (lambda a: a)
    ns.update({k: conv(v) for k, v in arrays.items()})
    wide = conv(wide)
    ns["blk_"] = wide[:, 5:]
    view = rt.emit(rt.fmt("view", "blk_", rt.shape([4, 16, 4, 8])), False)
    assert rt._gemm_into(view, code, True, {(0, 2, 4)})
    exec("\n".join(rt.lines), ns)
    got = np.asarray(ns["blk_"]).reshape(want.shape)
    assert np.allclose(got, want, rtol=1e-13, atol=1e-13)
    assert np.isnan(np.asarray(wide)[:, :5]).all()
    assert not any(".permute(" in ln and "[...]" in ln for ln in rt.lines)
