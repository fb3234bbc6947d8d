"""The MLX runtime loads without torch (~230 MB of RSS and seconds of start-up it never uses)."""

import subprocess
import sys

CHECK = ("import sys, mlx_runtime.backend, pipeline.cli.mlx_commands, mlx_runtime.models, mlx_runtime.generate; "
         "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")


def test_mlx_runtime_imports_without_torch():
    # A fresh interpreter: this test process has torch loaded by other tests already.
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
