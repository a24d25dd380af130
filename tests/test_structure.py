"""The package's structure: no import cycles among its modules (imports inside functions
counted), every import pointing down the layer table of docs/design.md, and the
refactoring guard that the model computes what the reference revision computed, bit for
bit."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "attnres"


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in the file, lazily too), plus
    the ``__init__`` of every package on the way (importing ``a.b.c`` runs ``a.b`` first)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module or ""
                found = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for target in found:
                parts = target.split(".")
                targets.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules_or_subpackages():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and "attnres.nn.residual.registry" in graph
    assert cycles(graph) == []
    top = {}
    for module, targets in graph.items():
        sub = ".".join(module.split(".")[:2])
        top.setdefault(sub, set()).update(".".join(t.split(".")[:2]) for t in targets if not t.startswith(sub + ".") and t != sub)
    assert cycles({k: {t for t in v if t in top} for k, v in top.items()}) == []


def test_the_cycle_check_finds_a_lazy_cycle(tmp_path):
    """The check above can fail: a cycle through an import inside a function is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


#: The package's layers, bottom first (docs/design.md, "Layers of the code"). A module may
#: import its own package and the packages of lower rows; packages in one row are peers and
#: import none of each other (so training, inference and upcycling stay independent). The
#: root package (``attnres/__init__.py``) re-exports the model API. ``serve`` is listed for
#: when it exists.
LAYERS: list[tuple[str, ...]] = [
    ("validation", "user_warning"),  # the config checks and their error format, imported by migrations too;
    # warn_user, which names the user's line
    ("migrations", "progress", "name_clash", "extras", "output_paths", "lazy_exports", "termination",
     "hub", "shell_words", "machine"),
    ("ops",),
    ("nn",),
    ("models",),
    ("attnres",),
    ("checkpoint", "data"),
    ("analysis", "distributed"),
    ("train", "inference"),
    ("hf",),  # the transformers wing: the HF model, families, upcycling
    ("upcycle", "experiments"),  # upcycle: the documented path of hf.upcycle, re-exported
    ("serve",),
    ("cli",),
    ("__main__",),
]


def layer_of(module: str) -> str:
    """The layer unit of a module: its top-level package under the root (``attnres.train.loop``
    -> ``train``), the root itself for ``attnres``."""
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else parts[0]
    return unit


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Every import (lazy ones included) from a module to one of a peer's or a higher
    layer's, as ``"a -> b"``; a package missing from ``layers`` is reported too."""
    rank = {unit: i for i, row in enumerate(layers) for unit in row}
    bad = []
    for module in sorted(graph):
        a = layer_of(module)
        if a not in rank:
            bad.append(f"{module}: its package {a!r} is in no layer")
            continue
        wrong: dict[str, str] = {}  # per package imported against the table, its shortest name imported
        for target in sorted(graph[module], key=len):
            b = layer_of(target)
            if a != b and rank.get(b, len(layers)) >= rank[a]:
                wrong.setdefault(b, target)
        bad += [f"{module} -> {target}" for target in sorted(wrong.values())]
    return bad


def test_imports_point_down_the_layer_table():
    """No module imports a module of a peer or higher layer (docs/design.md's table), not
    even lazily inside a function: ``inference`` does not import ``train``, ``train`` does
    not import ``upcycle``, ``nn`` does not import ``models``, ..."""
    graph = import_graph(PACKAGE)
    assert {"train", "inference", "checkpoint", "models", "nn", "ops", "cli"} <= {layer_of(m) for m in graph}
    assert layer_violations(graph, LAYERS) == []


def test_the_core_model_imports_no_transformers():
    """``models/`` is torch-only: no module there imports ``transformers`` (not even lazily);
    it finds the transformers families through ``models/hf_registry.py``, which the wing fills."""
    found = []
    for path in sorted((PACKAGE / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert found == []


def test_the_direction_check_finds_an_upward_or_sideways_import(tmp_path):
    """The check above can fail: a lazy import of a higher layer, and one of a peer."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "mid", "peer", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import b\n")
    (pkg / "mid" / "c.py").write_text("from ..peer import d\nfrom ..low import a\n")
    (pkg / "peer" / "d.py").write_text("")
    (pkg / "high" / "b.py").write_text("from ..mid import c\n")
    layers = [("pkg",), ("low",), ("mid", "peer"), ("high",)]
    assert layer_violations(import_graph(pkg), layers) == ["pkg.low.a -> pkg.high", "pkg.mid.c -> pkg.peer"]


@pytest.mark.slow
def test_bit_identical_to_the_reference_revision():
    """``benchmarks/bit_identity.py``: logits, depth weights, every gradient, cached decoding
    and 20-step loss curves of every variant, bit for bit against afb1f9e (needs git); the
    two-phase AttnRes variants, whose depth attention runs through the custom operators, within
    the float32 rule."""
    revision = "afb1f9e"
    if subprocess.run(["git", "cat-file", "-e", revision], cwd=ROOT, capture_output=True).returncode:
        pytest.skip(f"revision {revision} is not in this clone")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bit_identity.py"), "--against", revision],
                            cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all bit-identical" in result.stdout or "bit-identical except" in result.stdout


#: Functions longer than the limit that predate the check, with their length when it was
#: added: each may only shrink (split them when touching them).
LONG_FUNCTIONS: dict[str, int] = {}
MAX_FUNCTION_LINES = 80


def long_functions(package: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``"path/inside/package.py::name" -> lines`` for every function (methods and nested
    functions included) longer than ``limit`` lines, from ``def`` to its last line."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{path.relative_to(package).as_posix()}::{node.name}"] = lines
    return found


def test_no_function_is_longer_than_80_lines():
    found = long_functions(PACKAGE)
    new = {name: n for name, n in found.items() if name not in LONG_FUNCTIONS}
    grown = {name: n for name, n in found.items() if name in LONG_FUNCTIONS and n > LONG_FUNCTIONS[name]}
    assert not new and not grown, f"functions over {MAX_FUNCTION_LINES} lines: {new or grown}"


def test_the_function_length_check_finds_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path) == {"m.py::f": 81}


#: Imports by name, which the import graph above cannot see, and why each is allowed: the
#: lazy public names of the root and of ``attnres.distributed`` (lazy_exports.py: modules below
#: each), the one plugin load of the transformers wing by the core's registry (documented in
#: models/hf_registry.py), ``--import-module`` (a user's module, not the package's), the module
#: a saved directory names as registering its residual of the user's own (nn/residual/imports.py:
#: the user's, under trust_remote_code only), and the serving plugin's vLLM module of each
#: upcycled family (serve/upcycled.py: vLLM's, not ours; imported only for the family served,
#: as vLLM releases drop some).
NAMED_IMPORTS = {"lazy_exports.py", "models/hf_registry.py", "cli/common.py", "nn/residual/imports.py",
                 "serve/upcycled.py"}


def test_imports_by_name_are_only_the_declared_ones():
    """A string-named import (``importlib.import_module``, ``__import__``) would hide an
    upward dependency from the layer check: only the declared sites may use one."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("import_module", "__import__"):
                    found.add(path.relative_to(PACKAGE).as_posix())
    assert found == NAMED_IMPORTS


def invalid_escapes(root: Path) -> list[str]:
    """The Python files under ``root`` whose source Python warns about (an invalid escape
    sequence such as ``"\\)"`` in a string that is not raw: a SyntaxWarning now, an error in a
    later Python), each with the warning."""
    import warnings

    found = []
    for path in sorted(root.rglob("*.py")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compile(path.read_text(), str(path), "exec")
        found += [f"{path.relative_to(root).as_posix()}:{w.lineno}: {w.message}" for w in caught]
    return found


def test_no_source_file_has_an_invalid_escape_sequence():
    found = [name for part in ("src", "tests", "benchmarks", "studies") if (ROOT / part).is_dir()
             for name in invalid_escapes(ROOT / part)]
    assert not found, "\n".join(found)


def test_the_escape_check_finds_an_invalid_escape(tmp_path):
    (tmp_path / "m.py").write_text('x = "a\\)"\ny = r"a\\)"\n')
    assert [line.split(":")[:2] for line in invalid_escapes(tmp_path)] == [["m.py", "1"]]
