"""The pure core loads no heavy framework: it must stay importable and fast everywhere."""

import json
import subprocess
import sys

HEAVY = ("torch", "ray", "vllm", "deepspeed", "mlflow", "transformers")


def test_importing_the_platform_and_cli_loads_no_heavy_framework():
    code = (
        "import sys, json\n"
        "import palimpsest.platform, palimpsest.platform.policies, palimpsest.cli, palimpsest.pipelines.trajectories\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def _platform_imports(path) -> set[str]:
    """The palimpsest.platform modules a source file imports (at run time or for type checking alike)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("palimpsest.")}


def test_the_ledger_does_not_import_the_prompt():
    """The ledger is handed what a prefix costs; the prompt, its compiler and the runtime sit above it."""
    from pathlib import Path

    import palimpsest.platform.ledger as ledger

    above = {"palimpsest.platform.prompt.chat", "palimpsest.platform.compile.compiler", "palimpsest.platform.runtime",
             "palimpsest.platform.compile.epochs", "palimpsest.platform.policies"}
    files = sorted(Path(ledger.__file__).parent.glob("*.py"))
    assert len(files) >= 5  # store, audit, experiments, snapshot and the package
    for f in files:
        bad = {m for m in _platform_imports(f) if any(m == a or m.startswith(a + ".") for a in above)}
        assert not bad, (f.name, bad)


# -- the import graph of src/palimpsest: layers, cycles, deferred imports, file sizes ----------------------------

import ast  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
#: The layers, bottom up: a module imports only from its own layer or those below it
LAYERS = ("platform", "models", "pipelines", "experiments", "serving", "training", "evaluation", "demo", "cli")
#: What a function-local import may defer: a dependency that is heavy to load or optional where it runs
DEFERRABLE = HEAVY + ("pyarrow", "fastapi")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "palimpsest").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _imports(module: str) -> list[tuple[str, str, ast.stmt, bool]]:
    """(kind, target, node, function-local) of every import of ``module`` outside ``if TYPE_CHECKING``; kind is
    ``project`` (target: a module of ours) or ``external`` (target: the top-level package)."""
    out = []

    def visit(node, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id",
                                                     getattr(child.test, "attr", "")) == "TYPE_CHECKING":
                continue
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = ([f"{child.module}.{a.name}" for a in child.names] if child.module.startswith("palimpsest")
                         else [child.module])
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            else:
                names = []
            for n in names:
                if n.startswith("palimpsest"):
                    target = _resolve(n)
                    if target and target != module:
                        out.append(("project", target, child, inner))
                else:
                    out.append(("external", n.split(".")[0], child, inner))
            visit(child, inner)

    visit(ast.parse(MODULES[module].read_text()), False)
    return out


def _packages(module: str) -> list[str]:
    parts = module.split(".")
    return [p for p in (".".join(parts[:k]) for k in range(1, len(parts))) if p in MODULES]


def _loads(module: str) -> set[str]:
    """The deferrable dependencies importing ``module`` loads: its top-level imports, followed through ours
    (each package's ``__init__`` included)."""
    seen, stack, found = {module}, [module], set()
    while stack:
        m = stack.pop()
        for kind, target, _, local in _imports(m):
            if local:
                continue
            if kind == "external":
                found |= {target} & set(DEFERRABLE)
                continue
            for t in [target, *_packages(target)]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        for t in _packages(m):
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def test_the_import_graph_has_no_cycles():
    """Module to module, function-local imports included: an import hidden in a function is still an arrow."""
    edges = {m: {t for kind, t, _, _ in _imports(m) if kind == "project"} for m in MODULES}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                cycles.append(sorted(comp))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_import_runs_back_up_the_layers():
    """platform -> models -> pipelines -> serving -> training -> demo -> cli: each imports only from its own
    layer and those below it."""
    up = sorted(f"{m} -> {t}" for m in MODULES for kind, t, _, _ in _imports(m)
                if kind == "project" and _layer(t) > _layer(m) >= 0)
    assert up == []


def test_function_local_imports_defer_only_a_heavy_dependency_and_say_so():
    """An import of ours inside a function hides an arrow from readers and tools: it is there only where the
    module it imports loads a heavy or optional dependency (torch, Ray, vLLM, ...) that the importing module
    does not load itself, and a comment on its line or above it, in its run of imports, names it."""
    bad = []
    for m in sorted(MODULES):
        lines = MODULES[m].read_text().split("\n")
        mine = _loads(m)
        for kind, target, node, local in _imports(m):
            if kind != "project" or not local:
                continue
            where = f"{m}:{node.lineno} -> {target}"
            if not _loads(target) - mine:
                bad.append(f"{where}: defers nothing heavy (import it at the top)")
            comment, k = lines[node.lineno - 1].partition("#")[2], node.lineno - 2
            while k >= 0 and lines[k].strip().startswith(("#", "from ", "import ")):  # the run of imports above
                comment += lines[k].partition("#")[2]
                k -= 1
            if not any(re.search(rf"\b{dep}\b", comment.lower()) for dep in _loads(target) - mine):
                bad.append(f"{where}: no comment names what it defers ({sorted(_loads(target) - mine)})")
    assert bad == []


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_two_modules_share_a_basename_and_no_class_is_defined_twice():
    """A name says which module or class it is: ``config.py`` or ``Embedder`` in two places makes a reader (and a
    traceback) guess. Package ``__init__`` and ``__main__`` files are the exception."""
    names: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for m, p in MODULES.items():
        if p.stem not in ("__init__", "__main__"):
            names.setdefault(p.name, []).append(m)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(m)
    assert {k: v for k, v in names.items() if len(v) > 1} == {}
    assert {k: v for k, v in classes.items() if len(v) > 1} == {}


def test_ruff_finds_nothing():
    """The project's own lint (pyproject's [tool.ruff]: line length, import order, unused and undefined names) on
    every Python file of the repository."""
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], capture_output=True, text=True,
                         cwd=SRC.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
