"""The CLI shell: quiet by default (no third-party warnings, log lines or progress bars),
`-v` lets them through, `--version` names the versions, `--help` stays light."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A tiny torch model through coremltools' converter: its version warnings (at import), its
# frontend log lines and its per-pass MIL progress bars all speak, the same as a real conversion.
CONVERT = """
import sys
from pipeline.cli import _command_word, quiet_third_party
if not _command_word(sys.argv[1:])[1]:
    quiet_third_party()
import torch, coremltools as ct
traced = torch.jit.trace(torch.nn.Linear(4, 3).eval(), torch.zeros(1, 4))
ct.convert(traced, inputs=[ct.TensorType(name="x", shape=(1, 4))], convert_to="mlprogram")
"""


def _python(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_help_prints_no_third_party_line_and_imports_nothing_heavy():
    proc = _python("-m", "pipeline.cli", "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "generate" in proc.stdout and "--version" in proc.stdout
    probe = _python("-c", "import sys; from pipeline.cli import build_parser; build_parser(); "
                          "print(sorted(m for m in ('torch', 'coremltools', 'mlx', 'sklearn') if m in sys.modules))")
    assert probe.stdout.strip() == "[]"


def test_version_names_the_installed_versions():
    proc = _python("-m", "pipeline.cli", "--version")
    assert proc.returncode == 0
    versions = {name: metadata.version(name) for name in ("cmfdeploy", "coremltools", "torch", "mlx")}
    assert proc.stdout == (f"cmfdeploy {versions.pop('cmfdeploy')} ("
                           + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")\n")


def test_conversion_is_quiet_by_default_and_verbose_with_v():
    quiet = _python("-c", CONVERT, "coreml")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    loud = _python("-c", CONVERT, "-v", "coreml")
    assert loud.returncode == 0, loud.stderr
    # coremltools 9.0's own words: the per-pass bars and the frontend's op bar.
    assert "Running MIL" in loud.stderr and "Converting PyTorch Frontend" in loud.stderr


def test_the_projects_own_bar_stays_on_in_quiet_mode():
    proc = _python("-c", "from pipeline.cli import quiet_third_party; quiet_third_party()\n"
                         "from tqdm import tqdm\n"
                         "for _ in tqdm(range(3), desc='stage', disable=False): pass\n"
                         "for _ in tqdm(range(3), desc='library'): pass")
    assert "stage" in proc.stderr and "library" not in proc.stderr
