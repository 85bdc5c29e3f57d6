"""`make stubs`: regenerate every language's generated code from protos/ -- Python (scripts/gen_protos.py), Go and
TypeScript (`buf generate` with protos/buf.gen.yaml into clients/go/gen and clients/ts/src/gen) and the API
reference (scripts/gen_api_doc.py). `--check` (CI) fails when any checked-in output differs from what protos/
generates. Needs the SDK toolchain (`make sdk-setup`): buf and protoc-gen-es from clients/ts/node_modules,
protoc-gen-go / protoc-gen-go-grpc from Debian.

python scripts/gen_stubs.py [--check]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_BIN = ROOT / "clients" / "ts" / "node_modules" / ".bin"
GENERATED = ("clients/go/gen", "clients/ts/src/gen")  # buf.gen.yaml's outputs, relative to the repository


def buf_generate(out_base: Path) -> None:
    """`buf generate` in protos/ with its outputs under `out_base` (the repository root: in place)."""
    if not (NODE_BIN / "buf").exists():
        raise SystemExit(f"{NODE_BIN / 'buf'} missing: run `make sdk-setup`")
    env = {**os.environ, "PATH": f"{NODE_BIN}{os.pathsep}{os.environ['PATH']}"}
    # buf.gen.yaml's outs are ../clients/...: with -o DIR they land in DIR/../clients, so give DIR/protos
    cmd = [str(NODE_BIN / "buf"), "generate", "--template", "buf.gen.yaml", "-o", str(out_base / "protos")]
    subprocess.run(cmd, cwd=ROOT / "protos", env=env, check=True)


def differing(a: Path, b: Path) -> list[str]:
    """Files that differ between trees a and b (missing on either side included), relative paths."""
    if not a.exists() or not b.exists():
        return [str(b if not b.exists() else a)]
    cmp = filecmp.dircmp(a, b)
    out = [str(Path(a.name) / f) for f in cmp.left_only + cmp.right_only + cmp.diff_files]
    for sub in cmp.common_dirs:
        out += differing(a / sub, b / sub)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if any generated output is stale")
    args = ap.parse_args()
    py = [sys.executable]
    flag = ["--check"] if args.check else []
    failed = subprocess.run([*py, str(ROOT / "scripts" / "gen_protos.py"), *flag]).returncode != 0
    failed |= subprocess.run([*py, str(ROOT / "scripts" / "gen_api_doc.py"), *flag]).returncode != 0
    if not args.check:
        for d in GENERATED:
            shutil.rmtree(ROOT / d, ignore_errors=True)
        buf_generate(ROOT)
        print(f"generated {', '.join(GENERATED)}")
        return int(failed)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "protos").mkdir()
        buf_generate(Path(tmp))
        stale = [f for d in GENERATED for f in differing(Path(tmp) / d, ROOT / d)]
    if stale:
        print(f"generated client code is stale ({', '.join(stale)}): run make stubs")
        return 1
    print("generated Go and TypeScript code is up to date")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
