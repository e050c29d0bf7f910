"""The library's shape, checked: imports run one way down the layers, no module imports another that imports it back,
no function is longer than 80 lines nor takes more than 10 parameters, pyflakes finds nothing, and `import w4a4_book`
gives the public surface."""
import ast
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "w4a4_book"

# top to bottom: a module may import modules of lower layers, and of its own layer where `SIBLINGS_MAY_IMPORT`
LAYERS = [
    ("cli", "probes.__main__"),                                     # the command lines and the book's tooling
    ("bench", "bench.*", "repro", "sweep", "accuracy", "block", "flux", "probes.*", "checks", "nunchaku"),  # experiments, probes, readers
    ("layers",),                                                    # the layer
    ("ops",),                                                       # the layer's forward pass as a torch.library op
    ("gemm", "act_quant"),                                          # the launch paths: the GEMM's, the activation kernel's
    ("jit",),                                                       # building, compiling, the kernel cache
    ("registry",),                                                  # the kernels, by row
    ("heuristics",),                                                # tile, stage and wave rules; grids
    ("kernels.pg_variants",),                                       # the exact-integer kernel's variants, on their base
    ("kernels.sm90_v1", "kernels.sm90_v2", "kernels.sm90_quant", "kernels.sm90_pg", "kernels.sm100_v*"),  # kernels
    ("kernels.sm100_parts", "kernels.pg_decode"),                   # one family's parts: Blackwell's, the int4_pg decode
    ("kernels.sm90_parts",),                                        # kernel parts
    ("kernels.scheduler", "kernels.barriers", "kernels.ptx"),       # tile schedulers, barriers, inline PTX
    ("configs",),                                                   # the kernels' configs: problem apart from tuning
    ("smem", "reference", "operands", "formats", "records"),        # foundations
    ("cache",),              # what the host layer keeps between calls, and the capture guard the formats' checks ask
]
SIBLINGS_MAY_IMPORT = {1, 14}     # experiments build on each other, foundations too; kernels never import kernels
EXEMPT = {"__init__", "_modidx", "kernels", "kernels.__init__", "bench.__init__"}   # the package facade and nbdev's index


def modules():
    "Every module of the package as (dotted name below w4a4_book, path)."
    for p in sorted(PKG.rglob("*.py")):
        name = ".".join(p.relative_to(PKG).with_suffix("").parts)
        if name not in EXEMPT:
            yield name, p


def layer_of(name):
    for i, pats in enumerate(LAYERS):
        if any(fnmatch.fnmatch(name, pat) for pat in pats):
            return i
    raise AssertionError(f"module {name} is in no layer of LAYERS: place it")


def imports_of(name, path):
    "The package modules `name` imports, anywhere in its code (function-level imports too)."
    tree, out = ast.parse(path.read_text()), set()
    pkg_parts = name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg_parts[:len(pkg_parts) - node.level + 1] + ([node.module] if node.module else []))
                base = "w4a4_book." + base if base else "w4a4_book"
            else:
                base = node.module or ""
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    known = {n for n, _ in modules()}
    names = {m[len("w4a4_book."):] for m in out if m.startswith("w4a4_book.")}
    names = {f"{n}.__init__" if f"{n}.__init__" in known else n for n in names}   # a package is its `__init__`
    return names & known


def test_every_module_has_a_layer():
    for name, _ in modules():
        layer_of(name)


def test_imports_run_down_the_layers():
    bad = []
    for name, path in modules():
        for dep in imports_of(name, path):
            a, b = layer_of(name), layer_of(dep)
            if b < a or (a == b and a not in SIBLINGS_MAY_IMPORT and dep != name):
                bad.append(f"{name} (layer {a}) imports {dep} (layer {b})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {name: imports_of(name, path) - {name} for name, path in modules()}
    state = {}
    def visit(n, stack):
        if state.get(n) == "done": return
        assert state.get(n) != "open", "import cycle: " + " -> ".join(stack + [n])
        state[n] = "open"
        for d in graph.get(n, ()):
            visit(d, stack + [n])
        state[n] = "done"
    for n in graph:
        visit(n, [])


MAX_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, "\n".join(long)


NBDEV_ALL_HEADER = "# %% auto #0"   # nbdev writes the module's `__all__` on the line below this one
NBDEV_ALL_PREFIX = "__all__ = "


def test_package_lines_at_most_120():
    """No line of `w4a4_book/**/*.py` is over 120 characters, but what nbdev writes itself: its index `_modidx.py`,
    and the first line of a module's `__all__` (under `# %% auto #0`), which nbdev wraps at 120 characters before it
    puts `__all__ = ` in front, so up to 130. Only the notebook of a module's `default_exp` may export into it: a cell
    of another notebook makes nbdev rewrite `__all__` as one line, which this test refuses."""
    long = []
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "_modidx.py":
            continue
        lines = p.read_text().splitlines()
        for i, line in enumerate(lines):
            nbdev_all = i > 0 and lines[i - 1] == NBDEV_ALL_HEADER and line.startswith(NBDEV_ALL_PREFIX + "[")
            if len(line) > 120 + (len(NBDEV_ALL_PREFIX) if nbdev_all else 0):
                long.append(f"{p.relative_to(PKG)}:{i + 1}: {len(line)} characters")
    assert not long, f"{len(long)} lines over 120 characters:\n" + "\n".join(long)


MAX_PARAMETERS = 10
# Interfaces that must stay flat, as `module.function`. torch.library makes the op `w4a4::linear` from a schema of
# one argument per tensor or option, and calls its implementation and its fake (`_`) with them one by one;
# `_check_linear` checks those arguments as the op receives them.
FLAT_INTERFACES = {"ops.w4a4_linear", "ops._", "ops._check_linear"}


def parameters(node) -> list:
    "The names of a function's parameters, `self` or `cls` first left out."
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def functions():
    "Every function and method of the package as (`module.function`, its `ast` node)."
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{name}.{node.name}", node


def test_no_function_takes_over_10_parameters():
    """No function or method of the package takes more than `MAX_PARAMETERS` parameters (`self` and `cls` not counted):
    what travels together is bundled and passed whole (a kernel's per-CTA objects in one `NamedTuple`). Only
    `FLAT_INTERFACES` are exempt."""
    wide = [f"{f} (line {node.lineno}): {len(parameters(node))} parameters" for f, node in functions()
            if len(parameters(node)) > MAX_PARAMETERS and f not in FLAT_INTERFACES]
    assert not wide, f"{len(wide)} functions take more than {MAX_PARAMETERS} parameters:\n" + "\n".join(wide)


def test_the_flat_interfaces_are_flat():
    "Each exempt interface exists and is over the limit: an entry no function needs any more goes."
    widths = {f: len(parameters(node)) for f, node in functions()}
    assert {f: widths.get(f, 0) > MAX_PARAMETERS for f in FLAT_INTERFACES} == dict.fromkeys(FLAT_INTERFACES, True)


CONTEXT = r"\b(see|the \w+|as) (above|below)\b|\bthis chapter\b|\bthe last section\b|\bthe text\b"   # what help() cannot show


def test_public_docstrings_stand_alone():
    "Every public function and class has a docstring, and none points at text only its notebook shows."
    bad = []
    for name, path in modules():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                words = [m.group(0) for m in re.finditer(CONTEXT, doc)]
                if not doc.strip() or words:
                    bad.append(f"{name}.{node.name}: {'no docstring' if not doc.strip() else 'says ' + ', '.join(words)}")
    assert not bad, "\n".join(bad)


def test_pyflakes_is_clean():
    pytest.importorskip("pyflakes")
    res = subprocess.run([sys.executable, "-m", "pyflakes", str(PKG)], capture_output=True, text=True)
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_public_surface():
    import w4a4_book
    assert w4a4_book.__doc__ and "w4a4_book" in w4a4_book.__doc__
    for name in ("quantize", "dequantize", "w4a4_gemm_ref", "gemm_w4a4", "W4A4Linear", "solve", "explain"):
        assert name in w4a4_book.__all__ and callable(getattr(w4a4_book, name)), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        w4a4_book.nope


def test_import_is_light():
    "`import w4a4_book` imports neither CuTe DSL nor torch: the facade loads a name's module on first use."
    code = "import sys, w4a4_book; print('cutlass' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"], out
