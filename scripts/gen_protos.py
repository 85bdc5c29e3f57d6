"""Compile protos/ into the package (shared/v1 = pdserve.v1). `--check` fails when the generated code is stale.

python scripts/gen_protos.py          # regenerate
python scripts/gen_protos.py --check  # CI: exit 1 if shared/v1 differs from what protos/ generates
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "shared" / "v1"  # import name pdserve.v1
INIT = '"""Generated gRPC/protobuf code for pdserve.v1 (scripts/gen_protos.py). Do not edit."""\n'


def generate(dest: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest.mkdir(parents=True, exist_ok=True)
        for f in sorted((Path(tmp) / "pdserve" / "v1").iterdir()):
            shutil.copy(f, dest / f.name)
    (dest / "__init__.py").write_text(INIT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = ap.parse_args()
    if not args.check:
        if OUT_DIR.exists():
            shutil.rmtree(OUT_DIR)
        generate(OUT_DIR)
        print(f"generated {OUT_DIR.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "v1"
        generate(fresh)
        cmp = filecmp.dircmp(fresh, OUT_DIR)
        stale = cmp.left_only + cmp.right_only + cmp.diff_files
        stale = [f for f in stale if f != "__pycache__"]
        if stale:
            print(f"generated code is stale ({', '.join(sorted(stale))}): run python scripts/gen_protos.py")
            return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
