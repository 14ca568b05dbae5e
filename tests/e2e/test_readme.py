"""The README's examples run as written (against a test server instead of localhost:8001)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..conftest import REPO

README = (REPO / "README.md").read_text()


def _python_block(containing: str) -> str:
    """The README's one ```python block that contains ``containing``."""
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```$", README, re.DOTALL | re.MULTILINE) if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} README python blocks contain {containing!r}"
    return blocks[0]


def test_shared_memory_example(server, tmp_path):
    """The system shared-memory example, run as a program of its own: the probabilities it reads from the
    output segment are the model's (rows summing to 1, the same as over the socket), and it leaves no region
    registered and no segment behind."""
    snippet = _python_block("SharedMemoryBuffer")
    assert '"localhost:8001"' in snippet
    out = tmp_path / "probs.npy"
    segments = {name: f"{name}_{os.getpid()}" for name in ("vox_in", "vox_out")}  # apart from any other run's
    program = snippet.replace('"localhost:8001"', repr(server.url))
    for name, unique in segments.items():
        program = program.replace(repr(name).replace("'", '"'), repr(unique))
    assert all(unique in program for unique in segments.values()), program
    program += f"\nnp.save({str(out)!r}, probs)\nnp.save({str(tmp_path / 'x.npy')!r}, x)\n"
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probs, x = np.load(out), np.load(tmp_path / "x.npy")
    assert probs.shape == (8, 16) and np.allclose(probs.sum(axis=1), 1, atol=1e-5)
    from voxserve.client import Client

    with Client(server.url) as c:
        assert np.allclose(c.infer(x), probs, rtol=1e-5, atol=1e-7)
        assert c.system_shared_memory_status() == {}
    assert not any(Path("/dev/shm", unique).exists() for unique in segments.values())


def test_rest_tritonclient_example(server, tmp_path):
    """The tritonclient.http example runs as written against the REST port: the binary input and output give the
    (2, 16) probabilities."""
    snippet = _python_block("tritonclient.http")
    assert '"localhost:8000"' in snippet
    program = snippet.replace('"localhost:8000"', repr(f"127.0.0.1:{server.server.http_port}"))
    program += (f"\nimport numpy\nnumpy.save({str(tmp_path / 'y.npy')!r}, y)\n"
                f"numpy.save({str(tmp_path / 'x.npy')!r}, x)\n")
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    y, x = np.load(tmp_path / "y.npy"), np.load(tmp_path / "x.npy")
    from voxserve.client import Client

    with Client(server.url) as c:
        np.testing.assert_array_equal(y, c.infer(x))


def test_rest_curl_example(server, tmp_path):
    """The curl lines run as written against the REST port: ready, the metadata, an inference whose 16
    probabilities sum to 1 and match gRPC's answer for the same input."""
    blocks = [b for b in re.findall(r"^```bash\n(.*?)^```$", README, re.DOTALL | re.MULTILINE)
              if "localhost:8000/v2/health/ready" in b]
    assert len(blocks) == 1
    script = blocks[0].replace("localhost:8000", f"127.0.0.1:{server.server.http_port}")
    assert "localhost" not in script
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ready, rest = proc.stdout.split("\n", 1)
    assert ready == "200"
    metadata, end = json.JSONDecoder().raw_decode(rest)  # curl prints the two bodies one after the other
    answer = json.loads(rest[end:])
    assert metadata["inputs"][0]["name"] == "input"
    probs = np.asarray(answer["outputs"][0]["data"], np.float32)
    assert probs.shape == (16,) and abs(probs.sum() - 1) < 1e-5
    from voxserve.client import Client

    with Client(server.url) as c:
        np.testing.assert_array_equal(c.infer(np.full((1, 3, 3, 3, 3), 0.5, np.float32))[0], probs)


def test_readme_says_what_the_skipped_tests_need():
    """Every program a test skips without (shutil.which) and the shared reference are named where the README
    says why a fresh clone skips tests."""
    start = README.index("On a fresh clone `make test` skips some tests")
    paragraph = README[start:README.index("\n\n", start)]
    sources = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    programs = set(re.findall(r'shutil\.which\("([\w-]+)"\)', sources)) - {"make"}  # make: the command itself
    assert {"prometheus", "promtool", "nvcc"} <= programs
    for program in programs:
        assert f"`{program}`" in paragraph, program
    assert "`../shared/reference/model.py`" in paragraph and "GPU" in paragraph


def test_readme_states_the_token_minimum():
    from voxserve.server.protocol import security

    assert f"each at least {security._MIN_TOKEN_CHARS} characters of printable ASCII" in " ".join(README.split())
