"""Regenerate the Python modules for proto/*.proto with grpcio-tools.

    python -m voxserve.proto.generate          # rewrite the generated modules in place
    python -m voxserve.proto.generate --check  # exit 1 if they are not current

The generated modules are committed, so the server runs where grpcio-tools is
not installed (it is a development dependency only). Two changes are made to
protoc's output: its absolute imports between generated modules
(``import model_config_pb2``) are made package-relative, and the files are added
to voxserve's own descriptor pool (``pool.POOL``) instead of protobuf's default
one, where tritonclient's files of the same names go (``pool.py`` says why).
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
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = "_pool.POOL.AddSerializedFile("
_POOL_IMPORT = "from . import pool as _pool\n"


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
        if path.name.endswith("_pb2.py"):
            text = _own_pool(text, path.name)
        path.write_text(text)
    return files


def _own_pool(text: str, name: str) -> str:
    """protoc's module with its file added to pool.POOL instead of the default pool."""
    marker = "# @@protoc_insertion_point(imports)\n"
    if text.count(_DEFAULT_POOL) != 1 or text.count(marker) != 1:
        raise RuntimeError(f"{name}: protoc's output has changed; cannot point it at voxserve's descriptor pool")
    return text.replace(_DEFAULT_POOL, _OWN_POOL).replace(marker, marker + _POOL_IMPORT)


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
