"""Fuzz ModelInfer: coverage-guided byte fuzzing of request decoding (atheris/libFuzzer) and mutation fuzzing of a
live server over gRPC. The property: every input gets OK or a specific refusal (voxserve.testing.fuzz.ALLOWED_CODES),
promptly; the server never crashes, hangs or answers UNKNOWN/INTERNAL, and still answers correctly afterwards.

    python bench/fuzz_infer.py --inputs 100000            # both engines, the nightly run
    python bench/fuzz_infer.py --engine grpc --inputs 2000  # a quick look

Exits 1 on any violation, printing the offending inputs (hex) and saving them under --crash-dir.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _atheris_child(runs: int, seed: int, crash_dir: str) -> None:
    """Runs inside a child process: libFuzzer exits the process when done."""
    import atheris

    # Heavy dependencies first, uninstrumented; then the decoding path, instrumented for coverage.
    import grpc  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import voxserve.server.core.runner  # noqa: F401

    with atheris.instrument_imports(include=["voxserve"]):
        from voxserve.server.protocol import (
            codec,
            shm,
        )
        from voxserve.testing import fuzz

    spec = codec.ModelSpec("voxnet", "1", cin=3, cout=16, k=3, max_request_samples=64, max_request_voxels=1 << 16)
    registry = shm.SharedMemoryRegistry(4, 1 << 20)

    def one_input(data: bytes) -> None:
        code = fuzz.decode_status(data, spec, registry)
        if code not in fuzz.ALLOWED_CODES:
            raise AssertionError(f"status {code.name} is not an allowed answer")

    corpus = Path(tempfile.mkdtemp(prefix="voxserve-corpus-"))
    for i, request in enumerate(fuzz.seed_requests()):
        (corpus / f"seed{i}").write_bytes(request.SerializeToString())
    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed}", "-max_len=65536", "-rss_limit_mb=4096",
                   f"-artifact_prefix={crash_dir.rstrip('/')}/", str(corpus)], one_input)
    atheris.Fuzz()


def run_atheris(inputs: int, seed: int, crash_dir: Path) -> dict:
    crash_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--engine", "atheris-child", "--inputs", str(inputs),
                           "--seed", str(seed), "--crash-dir", str(crash_dir)], cwd=REPO, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - t0
    done = re.search(r"Done (\d+) runs", proc.stderr)
    cov = re.findall(r"cov: (\d+) ft: (\d+)", proc.stderr)
    result = {"engine": "atheris", "inputs": int(done.group(1)) if done else 0, "seconds": seconds,
              "ok": proc.returncode == 0 and done is not None,
              "coverage": f"{cov[-1][0]} edges, {cov[-1][1]} features" if cov else "-"}
    if not result["ok"]:
        print(proc.stderr[-5000:], file=sys.stderr)
    return result


def run_grpc(inputs: int, seed: int, workers: int, crash_dir: Path) -> dict:
    """Start a CPU server in a child process, fuzz it, then check it still answers correctly."""
    import numpy as np
    import torch

    from voxserve.client import Client
    from voxserve.kernels import reference_float64, reference_weights
    from voxserve.testing.fuzz import fuzz_server
    from voxserve.testing.load import ServerProcess

    with ServerProcess(["--device", "cpu"]) as server:
        t0 = time.perf_counter()

        def progress(report) -> None:
            print(f"\r  grpc: {report.inputs}/{inputs} inputs, server RSS {server.rss_mb():.0f} MB", end="",
                  file=sys.stderr, flush=True)

        report = fuzz_server(server.url, inputs, seed=seed, workers=workers, progress=progress)
        seconds = time.perf_counter() - t0
        print(file=sys.stderr)
        x = np.random.default_rng().standard_normal((2, 3, 6, 7, 8), dtype=np.float32)
        with Client(server.url, timeout_s=30) as c:
            y = c.infer(x)
        w, b = reference_weights()
        ref = reference_float64(torch.from_numpy(x), w, b).numpy()
        correct_after = float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) <= 1e-5
        alive = server.alive()
        peak = server.peak_rss_mb()
    crash_dir.mkdir(parents=True, exist_ok=True)
    for i, (code, details, data) in enumerate(report.failures):
        (crash_dir / f"grpc-{code}-{i}.bin").write_bytes(data)
        print(f"VIOLATION {code}: {details}\n  input: {data[:200].hex()}", file=sys.stderr)
    return {"engine": "grpc", "inputs": report.inputs, "seconds": seconds, "codes": report.codes,
            "slowest_s": report.slowest_s, "peak_rss_mb": peak, "correct_after": correct_after, "alive": alive,
            "ok": not report.failures and correct_after and alive}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["all", "atheris", "grpc", "atheris-child"], default="all")
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs per engine [default: %(default)s]")
    parser.add_argument("--seed", type=int, default=None, help="random seed [default: fresh]")
    parser.add_argument("--workers", type=int, default=4, help="concurrent gRPC fuzzing clients")
    parser.add_argument("--crash-dir", default=str(Path(tempfile.gettempdir()) / "voxserve-fuzz"))
    parser.add_argument("--no-report", action="store_true", help="print only (the CI smoke run)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    if args.engine == "atheris-child":
        _atheris_child(args.inputs, seed, args.crash_dir)
        return 0
    results = []
    if args.engine in ("all", "atheris"):
        results.append(run_atheris(args.inputs, seed, Path(args.crash_dir)))
    if args.engine in ("all", "grpc"):
        results.append(run_grpc(args.inputs, seed, args.workers, Path(args.crash_dir)))
    for r in results:
        extra = (f", coverage {r['coverage']}" if r["engine"] == "atheris" else
                 f", codes {r['codes']}, slowest {r['slowest_s'] * 1e3:.0f} ms, server peak RSS "
                 f"{r['peak_rss_mb']:.0f} MB, correct afterwards: {r['correct_after']}")
        print(f"{r['engine']}: {r['inputs']} inputs in {r['seconds']:.0f} s (seed {seed}), "
              f"{'no violations' if r['ok'] else 'VIOLATIONS'}{extra}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
