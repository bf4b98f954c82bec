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
