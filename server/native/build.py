"""Building ``voxserve-frontend``, the native front end (``server/native/*.cc``), with the system's toolchain.

The binary is compiled with g++ from this folder's sources and the protocol's messages (``proto/grpc_service.proto``
and ``proto/model_config.proto``, generated with protoc and gRPC's C++ plugin), linked against gRPC++, protobuf and
OpenSSL's libcrypto as pkg-config finds them (Debian: ``g++ pkg-config libgrpc++-dev protobuf-compiler-grpc
libssl-dev``). A build is cached by its sources, protos, compiler, tool and library versions and flags, beside the
kernel library's builds (``~/.cache/voxserve/native``, as ``kernels/build.py`` keeps ``~/.cache/voxserve/kernels``);
a lock keeps two processes from building the same one at once, and the binary is renamed into place whole.
``VOXSERVE_NATIVE_FRONTEND`` names a prebuilt binary instead.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
# proto/ is two levels up both in the repository (server/native -> proto) and installed (voxserve/server/native ->
# voxserve/proto).
PROTO_DIR = SOURCE_DIR.parent.parent / "proto"
PROTOS = ("grpc_service.proto", "model_config.proto")
BINARY_NAME = "voxserve-frontend"
FAILED_LOG_NAME = "build-failed.txt"  # the whole output of a failed build, beside where the binary would be
CXX_FLAGS = ("-O2", "-std=c++17", "-pthread")
PKG_CONFIG_PACKAGES = ("grpc++", "protobuf", "libcrypto")
# What provides each tool and pkg-config package on Debian, for the message when one is missing.
DEBIAN_PACKAGES = {
    "g++": "g++", "pkg-config": "pkg-config", "protoc": "protobuf-compiler-grpc", "grpc_cpp_plugin":
    "protobuf-compiler-grpc", "grpc++": "libgrpc++-dev", "protobuf": "libprotobuf-dev", "libcrypto": "libssl-dev",
}  # fmt: skip
ALL_PACKAGES = "g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc libssl-dev"
ENV_BINARY = "VOXSERVE_NATIVE_FRONTEND"
ENV_CACHE = "VOXSERVE_NATIVE_CACHE"


class NativeBuildError(RuntimeError):
    """voxserve-frontend cannot be built (or the prebuilt one named is unusable); the message says why and what to
    install."""


def cache_dir() -> Path:
    """Where builds are kept: $VOXSERVE_NATIVE_CACHE, else ~/.cache/voxserve/native (XDG_CACHE_HOME honoured)."""
    root = os.environ.get(ENV_CACHE)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "voxserve" / "native"


def sources() -> list[Path]:
    """The binary's own sources: every .cc and .h of this folder."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cc", ".h"))


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _toolchain() -> dict[str, str]:
    """The tools' paths; NativeBuildError naming everything missing and the Debian packages that provide it."""
    tools = {name: shutil.which(name) for name in ("g++", "protoc", "grpc_cpp_plugin", "pkg-config")}
    missing = [name for name, path in tools.items() if path is None]
    if tools["pkg-config"] is not None:
        missing += [f"{pkg} (pkg-config)" for pkg in PKG_CONFIG_PACKAGES
                    if _run([str(tools["pkg-config"]), "--exists", pkg]).returncode != 0]
    if missing:
        provided = sorted({DEBIAN_PACKAGES[m.split(" ")[0]] for m in missing})
        raise NativeBuildError(
            f"cannot build {BINARY_NAME}: missing {', '.join(missing)} (Debian: {' '.join(provided)}); "
            f"everything it needs: sudo apt-get install {ALL_PACKAGES}")
    return {name: str(path) for name, path in tools.items()}


def _prebuilt(path: str) -> Path:
    binary = Path(path)
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise NativeBuildError(f"{ENV_BINARY}={path} is not an executable file")
    return binary


def build(force: bool = False) -> Path:
    """The path of a built voxserve-frontend: $VOXSERVE_NATIVE_FRONTEND if set (it must exist), else the cached
    build of these sources, compiled first if there is none (``force``: compiled again)."""
    if os.environ.get(ENV_BINARY):
        return _prebuilt(os.environ[ENV_BINARY])
    tools = _toolchain()
    pkg_config = tools["pkg-config"]
    flags = {}
    for kind in ("--cflags", "--libs"):
        proc = _run([pkg_config, kind, *PKG_CONFIG_PACKAGES])
        if proc.returncode != 0:
            raise NativeBuildError(f"pkg-config {kind} {' '.join(PKG_CONFIG_PACKAGES)} failed: {proc.stderr.strip()}")
        flags[kind] = proc.stdout.split()
    versions = [_run([tools["g++"], "--version"]).stdout, _run([tools["protoc"], "--version"]).stdout,
                _run([pkg_config, "--modversion", *PKG_CONFIG_PACKAGES]).stdout]
    files = [*sources(), *(PROTO_DIR / name for name in PROTOS)]
    digest = hashlib.sha256()
    for part in [*(f"{p.name}\0{p.read_text()}" for p in files), *versions, *CXX_FLAGS, *flags["--cflags"],
                 *flags["--libs"]]:
        digest.update(part.encode() + b"\0")
    key = digest.hexdigest()[:16]
    root = cache_dir()
    target_dir = root / key
    target = target_dir / BINARY_NAME
    if target.exists() and not force:
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same binary: wait for it, then reuse it
        if target.exists() and not force:
            return target
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
            _compile(tools, flags["--cflags"], flags["--libs"], Path(tmp), target_dir)
            os.replace(Path(tmp) / BINARY_NAME, target)  # atomic: nobody runs a half-written binary
        (target_dir / FAILED_LOG_NAME).unlink(missing_ok=True)  # an earlier attempt's
    log.info("built %s in %.1f s", target, time.perf_counter() - started)
    return target


def _compile(tools: dict[str, str], cflags: list[str], libs: list[str], work: Path, target_dir: Path) -> None:
    """protoc, then each translation unit (in parallel), then the link, into ``work``/voxserve-frontend."""
    steps: list[list[str]] = [[tools["protoc"], "-I", str(PROTO_DIR), f"--cpp_out={work}", f"--grpc_out={work}",
                               f"--plugin=protoc-gen-grpc={tools['grpc_cpp_plugin']}",
                               *(str(PROTO_DIR / name) for name in PROTOS)]]
    _check(steps[0], _run(steps[0]), target_dir)
    units = [*(work / f"{Path(name).stem}{suffix}" for name in PROTOS for suffix in (".pb.cc", ".grpc.pb.cc")),
             *(p for p in sources() if p.suffix == ".cc")]
    includes = ["-I", str(work), "-I", str(SOURCE_DIR)]
    compiles = [[tools["g++"], *CXX_FLAGS, "-Wall", "-Wextra", *includes, *cflags, "-c", str(unit), "-o",
                 str(work / f"{unit.name}.o")] for unit in units]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for cmd, proc in zip(compiles, pool.map(_run, compiles), strict=True):
            _check(cmd, proc, target_dir)
    link = [tools["g++"], *CXX_FLAGS, *(c[-1] for c in compiles), "-o", str(work / BINARY_NAME), *libs]
    _check(link, _run(link), target_dir)


def _check(cmd: list[str], proc: subprocess.CompletedProcess, target_dir: Path) -> None:
    if proc.returncode == 0:
        return
    log_path = target_dir / FAILED_LOG_NAME
    log_path.write_text(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()] or proc.stderr.splitlines()[-20:]
    raise NativeBuildError(f"building {BINARY_NAME} failed ({Path(cmd[0]).name}, {len(errors)} error line(s)); the "
                           f"whole log is in {log_path}:\n" + "\n".join(errors[:20]))


def problem() -> str | None:
    """None when voxserve-frontend builds (or is built, or is named by $VOXSERVE_NATIVE_FRONTEND), else a sentence
    saying why not (as kernels.cuda.load_problem)."""
    try:
        build()
    except NativeBuildError as exc:
        return str(exc)
    return None
