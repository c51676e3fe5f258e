#!/usr/bin/env python3
"""Generate Python code for protos/tokenfleet/v1/*.proto into tokenfleet/v1/ (the one generator).

    python scripts/gen_protos.py          # regenerate
    python scripts/gen_protos.py --check  # exit 1 if the committed code is stale (CI)
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = Path("tokenfleet") / "v1"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--pyi_out={out}", *[str(p) for p in protos]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out) for p in (out / PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="fail if tokenfleet/v1 differs from fresh output")
    args = parser.parse_args()
    if not args.check:
        for old in (ROOT / PACKAGE).glob("*_pb2*.py*"):
            old.unlink()
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = sorted(p.relative_to(ROOT) for p in (ROOT / PACKAGE).glob("*_pb2*.py*"))
        stale = [str(p) for p in fresh if not (ROOT / p).exists() or not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False)]
        extra = [str(p) for p in committed if p not in fresh]
    if stale or extra:
        print(f"generated code is stale: {stale + extra}; run python scripts/gen_protos.py", file=sys.stderr)
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
