"""deploy/local-bases: the stand-ins' Containerfiles are hadolint-clean, and the build flags make.sh gives the
project's Dockerfile: the local bases, a torch spec per variant (so the torch layer's cache key differs), and the
host's CA bundle and pip settings as read-only volumes only, the CUDA variant's without the local CPU wheels."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ..conftest import REPO
from .test_deploy import _tool

BASES = REPO / "deploy" / "local-bases"


def _flags(variant: str) -> list[str]:
    proc = subprocess.run([str(BASES / "make.sh"), "--flags", variant], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _build_args(flags: list[str]) -> dict[str, str]:
    return dict(flags[i + 1].split("=", 1) for i, f in enumerate(flags) if f == "--build-arg")


def test_the_stand_ins_are_hadolint_clean():
    files = sorted(str(p) for p in BASES.glob("*.Containerfile"))
    assert len(files) == 3
    proc = subprocess.run([_tool("hadolint"), *files], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_build_flags_name_the_local_bases_a_torch_per_variant_and_mount_read_only(variant):
    flags = _flags(variant)
    args = _build_args(flags)
    assert args["PYTHON_BASE"].startswith("localhost/voxserve-base/python:")
    assert args["CUDA_BASE"].startswith("localhost/voxserve-base/cuda:")
    default = re.search(r'^ARG TORCH_SPEC="?([^"\n]+)"?$', (REPO / "Dockerfile").read_text(), re.M).group(1)
    assert args["TORCH_SPEC"] == (f"{default}+cpu" if variant == "cpu" else default)
    assert "--pull=never" in flags
    volumes = [flags[i + 1] for i, f in enumerate(flags) if f == "-v"]
    assert volumes and all(v.endswith(":ro") for v in volumes), volumes
    pip_conf = next(v.split(":")[0] for v in volumes if v.split(":")[1] == "/etc/pip.conf")
    text = Path(pip_conf).read_text()
    if variant == "cuda":
        assert "find-links" not in text  # PyPI's CUDA torch, not a local CPU wheel of the same version


def test_the_dockerfile_bakes_no_host_settings_in():
    text = (REPO / "Dockerfile").read_text()
    assert not re.search(r"^(COPY|ADD)\b.*(pip\.conf|ca-certificates|\.crt)", text, re.M | re.I)
    assert re.search(r'^RUN pip install --no-cache-dir "\$\{TORCH_SPEC\}"$', text, re.M)
