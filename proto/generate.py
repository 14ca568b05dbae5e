"""Regenerate the Python modules for proto/*.proto with grpcio-tools.

    python -m voxserve.proto.generate          # rewrite the generated modules in place
    python -m voxserve.proto.generate --check  # exit 1 if they are not current

The generated modules are committed, so the server runs where grpcio-tools is
not installed (it is a development dependency only). protoc emits absolute
imports between generated modules (``import model_config_pb2``); they are made
package-relative here, which is the one change made to protoc's output.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("model_config.proto", "grpc_service.proto")
_ABSOLUTE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on PROTOS into out_dir and return the generated files."""
    from grpc_tools import protoc  # development dependency

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_DIR / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    files = sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))
    for path in files:
        text = _ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", path.read_text())
        path.write_text(text)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for path in generate(Path(tmp)):
            target = PROTO_DIR / path.name
            fresh = path.read_text()
            if not target.exists() or target.read_text() != fresh:
                stale.append(target.name)
                if not args.check:
                    target.write_text(fresh)
    if args.check and stale:
        print(f"generated code is stale: {', '.join(stale)}; run python -m voxserve.proto.generate", file=sys.stderr)
        return 1
    if not args.check:
        print(f"regenerated: {', '.join(stale) or 'nothing (already current)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
