"""The README's two commands exist and .ci/run runs exactly the README's test command."""

import re

from conftest import ROOT


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    assert len(blocks) >= 2
    test_cmd = blocks[1]
    assert "pytest" in test_cmd
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines


def test_main_job_command_runs_the_128gpu_scenario():
    main_cmd = _bash_blocks((ROOT / "README.md").read_text())[0]
    assert "scenarios/128gpu.yaml" in main_cmd
    assert main_cmd.startswith("python3 -m venv")
