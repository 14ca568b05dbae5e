"""Triton Inference Server as a peer: the real tritonserver from the nvidia-pytriton wheel, serving voxserve's
model through its Python backend (model.py beside this file), on free loopback ports, for one benchmark run.

    with triton_server(source) as triton:     # source: the wheel's path, a folder holding pytriton, or "auto"
        triton.url, triton.models["FP16"]       # "127.0.0.1:PORT", "voxnet_fp16"

The wheel bundles the server binary, its libraries (nvidia_pytriton.libs), the Python backend and a backend
stub per Python version; pytriton's own Python code (and its dependencies) is never imported. The stub embeds
``libpython3.X.so.1.0`` of the Python that runs this module: it runs voxserve's model with this Python's
packages. Everything else (the unpacked wheel, the model repository, the backend folder, the log) lives in a
temporary folder that is removed when the server stops.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEEL = "nvidia-pytriton==0.7.0"  # Triton Inference Server 2.51 (24.10)
MODELS = {"FP32": ("voxnet", "TYPE_FP32"), "FP16": ("voxnet_fp16", "TYPE_FP16")}
# The Python backend moves tensors between the server and each stub through shared memory; its default pool
# (1 MiB, grown 1 MiB at a time) would be re-grown for every 25 MB reference batch.
PYTHON_BACKEND_SHM_BYTES = 64 * 1024 * 1024


class TritonUnavailable(RuntimeError):
    """Triton cannot run here; the message says why (the benchmark prints it and skips Triton's rows)."""


class TritonStartError(TritonUnavailable):
    """Triton was found but did not start or become ready; the message ends with its log."""


@dataclass
class TritonPeer:
    url: str  # host:port of Triton's gRPC endpoint
    models: dict[str, str]  # wire datatype -> model name (one model per input datatype)
    instances: int
    http_url: str = ""  # host:port of its HTTP/REST endpoint
    version: str = ""
    log: Path = field(default=Path(), repr=False)


def _python_version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _extract(wheel: Path, into: Path) -> Path:
    """The parts of the wheel the server needs (binary, libraries, Python backend, the stubs), with their file
    modes; returns the folder that holds ``pytriton/`` and ``nvidia_pytriton.libs/``."""
    keep = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/python/",
            "pytriton/tritonserver/python_backend_stubs/", "nvidia_pytriton.libs/")
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.startswith(keep) and not m.is_dir()]
            if not members:
                raise TritonUnavailable(f"{wheel} holds no pytriton/tritonserver: is it the {WHEEL} wheel?")
            for m in members:
                target = Path(zf.extract(m, into))
                mode = m.external_attr >> 16
                if mode:
                    target.chmod(mode & 0o777)
    except (OSError, zipfile.BadZipFile) as exc:
        raise TritonUnavailable(f"cannot unpack {wheel}: {exc}") from exc
    return into


def _find_root(source: str | None, scratch: Path) -> Path:
    """The folder holding ``pytriton/tritonserver`` and ``nvidia_pytriton.libs``: from a wheel, a folder
    (site-packages, an unpacked wheel, or pytriton itself), or the installed package when source is None or
    'auto'."""
    if source in (None, "", "auto"):
        spec = importlib.util.find_spec("pytriton")  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise TritonUnavailable(f"no Triton: give the {WHEEL} wheel's path, or pip install {WHEEL}")
        return Path(next(iter(spec.submodule_search_locations))).parent
    path = Path(source).expanduser()
    if path.is_file():
        return _extract(path, scratch / "dist")
    for root in (path, path.parent):
        if (root / "pytriton" / "tritonserver").is_dir():
            return root
    raise TritonUnavailable(f"{source}: neither the {WHEEL} wheel nor a folder holding pytriton/tritonserver")


def _libpython_dir() -> str | None:
    """The folder of this Python's libpython3.X.so.1.0 for LD_LIBRARY_PATH ("" when the loader finds it
    already: a system folder is never put first on the path, where it would shadow the libraries that torch's
    own search path expects); None when this Python has no shared library."""
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{_python_version()}.so.1.0"
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    system = {Path(p).resolve() for p in ("/lib", "/lib64", "/usr/lib", "/usr/lib64", f"/lib/{arch}",
                                          f"/usr/lib/{arch}")}
    for folder in (sysconfig.get_config_var("LIBDIR"), os.path.join(sys.base_prefix, "lib")):
        if folder and (Path(folder) / soname).exists():
            return "" if Path(folder).resolve() in system else folder
    return "" if ctypes.util.find_library(f"python{_python_version()}") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_repository(repo: Path, datatypes: tuple[str, ...], instances: int, device: str, max_batch: int, cin: int,
                      cout: int) -> None:
    template = string.Template((HERE / "config.pbtxt").read_text())
    sys_path = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    for name, triton_type in (MODELS[dt] for dt in datatypes):
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(HERE / "model.py", repo / name / "1" / "model.py")
        (repo / name / "config.pbtxt").write_text(template.substitute(
            name=name, datatype=triton_type, instances=instances, device=device, max_batch=max_batch, cin=cin,
            cout=cout, sys_path=sys_path.replace("\\", "\\\\").replace('"', '\\"')))


def _stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # Triton unloads its models (their stubs exit) and stops
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # its stubs exit once they see their server gone
        proc.wait(10)


def _die_with_parent() -> None:
    """(In the child, before exec.) SIGTERM when the process that started it dies, however it dies: a benchmark
    killed part way must not leave a server behind."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def triton_server(source: str | None = "auto", *, datatypes: tuple[str, ...] = ("FP32", "FP16"), instances: int = 2,
                  device: str = "auto", max_batch: int = 128, ready_timeout_s: float = 600.0, cin: int = 3,
                  cout: int = 16) -> Iterator[TritonPeer]:
    """tritonserver with a voxnet model per input datatype (``instances`` stubs each, dynamic batching up to
    ``max_batch`` samples) on a free loopback port, ready; stopped on exit. Raises TritonUnavailable with the
    reason when it cannot be found, unpacked, started or made ready."""
    from voxserve.client import Client  # (tritonclient is never imported: it clashes with our protocol modules)

    libpython = _libpython_dir()
    if libpython is None:
        raise TritonUnavailable(f"the Python backend's stub embeds libpython{_python_version()}.so.1.0, and "
                                f"{sys.executable} has none (a Python built without --enable-shared)")
    with tempfile.TemporaryDirectory(prefix="voxnet-triton-") as tmp:
        scratch = Path(tmp)
        root = _find_root(source, scratch)
        server_dir, libs = root / "pytriton" / "tritonserver", root / "nvidia_pytriton.libs"
        binary = server_dir / "bin" / "tritonserver"
        stub = server_dir / "python_backend_stubs" / _python_version() / "triton_python_backend_stub"
        if not binary.is_file():
            raise TritonUnavailable(f"{binary} is missing")
        if not stub.is_file():
            have = sorted(p.name for p in (server_dir / "python_backend_stubs").glob("*"))
            raise TritonUnavailable(f"no Python backend stub for Python {_python_version()} (there are stubs for "
                                    f"{', '.join(have) or 'none'})")
        # The backend folder Triton loads from: the Python backend with the stub for this Python beside it.
        backend = scratch / "backends" / "python"
        backend.mkdir(parents=True)
        for f in (server_dir / "backends" / "python").iterdir():
            if f.is_file():
                shutil.copy(f, backend / f.name)
        shutil.copy(stub, backend / "triton_python_backend_stub")
        repo = scratch / "models"
        _write_repository(repo, datatypes, instances, device, max_batch, cin, cout)
        port, http_port = _free_port(), _free_port()
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libpython, str(libs), env.get("LD_LIBRARY_PATH"))
                                                 if p)
        # The stub's embedded Python finds its prefix, and so this interpreter's site-packages (numpy, which it
        # imports first), through the first python3 on PATH; model.py appends the rest of sys.path.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        cmd = [str(binary), f"--model-repository={repo}", f"--backend-directory={scratch / 'backends'}",
               "--grpc-address=127.0.0.1", f"--grpc-port={port}", "--http-address=127.0.0.1",
               f"--http-port={http_port}", "--allow-metrics=false",
               "--disable-auto-complete-config", "--exit-timeout-secs=10", "--log-verbose=0",
               f"--backend-config=python,shm-default-byte-size={PYTHON_BACKEND_SHM_BYTES}",
               f"--backend-config=python,shm-growth-byte-size={PYTHON_BACKEND_SHM_BYTES}"]
        log_path = scratch / "tritonserver.log"
        with open(log_path, "w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=scratch,
                                    preexec_fn=_die_with_parent)
            url = f"127.0.0.1:{port}"
            try:
                peer = TritonPeer(url, {dt: MODELS[dt][0] for dt in datatypes}, instances,
                                  http_url=f"127.0.0.1:{http_port}", log=log_path)
                deadline = time.monotonic() + ready_timeout_s
                with Client(url, timeout_s=2) as c:
                    while True:
                        with contextlib.suppress(Exception):  # not listening yet
                            if c.is_ready():
                                peer.version = c.server_metadata().version
                                break
                        if proc.poll() is not None or time.monotonic() > deadline:
                            log.seek(0)
                            why = "exited" if proc.poll() is not None else f"not ready after {ready_timeout_s:.0f} s"
                            raise TritonStartError(f"tritonserver {why}; its log ends:\n{log.read()[-3000:]}")
                        time.sleep(0.5)
                yield peer
            finally:
                _stop(proc)


def pack(wheel: Path, out: Path, python: str) -> None:
    """A zip of only what the server needs for one Python version (the wheel less pytriton's Python code,
    the other stubs and the Python 3.13 library that only the 3.13 stub uses), LZMA-compressed: 27 MB instead
    of 55, so that it travels beside other wheels. ``triton_server`` takes it as it takes the wheel."""
    keep = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/python/",
            f"pytriton/tritonserver/python_backend_stubs/{python}/", "nvidia_pytriton.libs/")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            if info.filename.startswith(keep) and not info.is_dir() and (
                    python == "3.13" or "/libpython3-" not in info.filename):
                dst.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Pack the server parts of the nvidia-pytriton wheel for one "
                                     "Python version (to carry it where space is short).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="write a zip of what tritonserver needs for --python")
    p.add_argument("wheel", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--python", default=_python_version(), help="the stub's Python version [default: this one's]")
    args = parser.parse_args()
    pack(args.wheel, args.out, args.python)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
