"""Regenerates proto/specserve_pb2.py, specserve_pb2.pyi and specserve_pb2_grpc.py from proto/specserve.proto."""

# Run `python proto/generate.py` from anywhere: protoc runs with the repository root as the
# include path (`-I .` from the root), so the generated gRPC module imports
# `from proto import specserve_pb2`.

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = "proto/specserve.proto"


def protoc_arguments(repo_root: Path) -> list[str]:
    """The command line for grpc_tools.protoc; the first entry is the program name."""
    include_dir = Path(protoc.__file__).parent / "_proto"  # well-known types shipped with grpc_tools
    return [
        "grpc_tools.protoc",
        f"-I{repo_root}",
        f"-I{include_dir}",
        f"--python_out={repo_root}",
        f"--pyi_out={repo_root}",
        f"--grpc_python_out={repo_root}",
        str(repo_root / PROTO_FILE),
    ]


def main() -> int:
    status = protoc.main(protoc_arguments(REPO_ROOT))
    if status != 0:
        print(f"protoc failed with status {status}", file=sys.stderr)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
