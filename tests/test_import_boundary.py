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

    above = {"palimpsest.platform.chat", "palimpsest.platform.compiler", "palimpsest.platform.runtime",
             "palimpsest.platform.epochs", "palimpsest.platform.policies"}
    files = sorted(Path(ledger.__file__).parent.glob("*.py"))
    assert len(files) >= 5  # store, audit, experiments, snapshot and the package
    for f in files:
        bad = {m for m in _platform_imports(f) if any(m == a or m.startswith(a + ".") for a in above)}
        assert not bad, (f.name, bad)
