"""`make serve` and `make test` say what they are doing while the first run installs (minutes of pip)."""

from __future__ import annotations

import shutil
import subprocess
import textwrap

import pytest

from ..conftest import REPO

if shutil.which("make") is None:
    pytest.skip("make is not installed", allow_module_level=True)


def test_first_install_shows_its_steps_and_pips_progress(tmp_path):
    """The install recipe with a stand-in Python whose venv's pip only prints how it was called: every step is
    announced before it runs, and pip is not silenced (-q hides its download progress for minutes)."""
    fake_python = tmp_path / "python"
    fake_python.write_text(textwrap.dedent("""\
        #!/bin/sh
        # python -m venv DIR: a venv whose pip prints its arguments
        mkdir -p "$3/bin"
        printf '#!/bin/sh\\necho "pip called: $*"\\n' > "$3/bin/pip"
        chmod +x "$3/bin/pip"
        """))
    fake_python.chmod(0o755)
    venv = tmp_path / "venv"
    proc = subprocess.run(["make", f"PYTHON={fake_python}", f"VENV={venv}", f"{venv}/bin/.installed"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pips = [i for i, line in enumerate(lines) if line.startswith("pip called: install")]
    steps = [i for i, line in enumerate(lines) if line.startswith("==> [")]
    assert len(pips) == 2 and len(steps) == 3, proc.stdout
    assert steps[1] < pips[0] < steps[2] < pips[1], proc.stdout  # each pip run announced before it starts
    assert "PyTorch" in lines[steps[1]], proc.stdout
    assert all(" -q" not in lines[i] for i in pips), proc.stdout
    assert (venv / "bin" / ".installed").exists()
