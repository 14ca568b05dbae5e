"""The container engine the image tests use (podman, else docker, as `make image` picks), whether it can run
containers here, the image built once per session with `make image`, and the README's docker commands."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import REPO

BUILD_TIMEOUT_S = 3600


def engine() -> str:
    """podman or docker (CONTAINER_ENGINE overrides), or a skip with the reason none can run containers here."""
    name, problem = _engine()
    if problem:
        pytest.skip(problem)
    return name


@functools.cache
def _engine() -> tuple[str, str | None]:
    name = os.environ.get("CONTAINER_ENGINE") or next((n for n in ("podman", "docker") if shutil.which(n)), "")
    if not name:
        return "", "neither podman nor docker is installed (.ci/run installs podman when run as root)"
    try:
        info = subprocess.run([name, "info"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return name, f"{name} cannot run here: {exc}"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return name, f"{name} cannot run containers here: {last}"
    return name, None


def run(args: list[str], timeout_s: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def readme_docker_commands(block: int = 0) -> list[str]:
    """The commands of one of README.md's bash blocks under "## Docker and Kubernetes" (0: the container, 1:
    compose), comments removed: the image tests run exactly these, with free ports and their own names."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Docker and Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) > block, "README.md: too few bash blocks under '## Docker and Kubernetes'"
    commands = []
    for line in blocks[block].splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command:
            commands.append(command)
    return commands


REGISTRY_BASES = ("nvidia/cuda:13.0.1-devel-ubuntu24.04", "python:3.12-slim")


def _bases(engine: str) -> str:
    """IMAGE_BASES for `make image`: as set, else "local" under podman when the Dockerfile's real bases are not in
    its storage (a host without a registry, like CI's: `make.sh` makes the stand-ins), else "registry"."""
    if os.environ.get("IMAGE_BASES"):
        return os.environ["IMAGE_BASES"]
    if engine.endswith("podman") and not all(
            subprocess.run([engine, "image", "exists", b], capture_output=True).returncode == 0
            for b in REGISTRY_BASES):
        return "local"
    return "registry"


@functools.cache
def _build() -> tuple[float, str]:
    """`make image` (the README's command; IMAGE_BASES as _bases says), once per session."""
    engine = _engine()[0]
    t0 = time.monotonic()
    proc = subprocess.run(["make", "--no-print-directory", "image", f"CONTAINER_ENGINE={engine}"], cwd=REPO,
                          env={**os.environ, "IMAGE_BASES": _bases(engine)}, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"make image exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return time.monotonic() - t0, proc.stdout + proc.stderr


def built_image() -> str:
    """The image `make image` tags (IMAGE, "voxserve" by default), built once per session."""
    engine()
    seconds, _ = _build()
    print(f"make image took {seconds:.0f} s")
    return os.environ.get("IMAGE", "voxserve")


def local_bases() -> bool:
    return _bases(engine()) == "local"


def voxserve_cli() -> str:
    beside = Path(sys.executable).parent / "voxserve"
    return str(beside) if beside.exists() else "voxserve"
