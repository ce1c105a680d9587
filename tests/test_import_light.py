"""``import sim`` (and every sim module) must never pull in torch or deepspeed."""

import subprocess
import sys

from conftest import ROOT


def test_sim_never_imports_torch_or_deepspeed():
    modules = sorted(
        "sim." + ".".join(p.relative_to(ROOT / "sim").with_suffix("").parts)
        for p in (ROOT / "sim").rglob("*.py")
        if p.name not in ("__main__.py",)
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m.replace('.__init__', ''))\n"
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]\n"
        "print(bad); sys.exit(3 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
