"""docs/api.md from the public proto's comments (pdserve/v1/generate.proto): every RPC, message, field (number,
type, comment with its default) and enum, after the hand-written contract (metadata keys, status codes, retry,
versioning) kept in this script. Reads a descriptor set with source info from grpc_tools' protoc (no new toolchain).

python scripts/gen_api_doc.py          # rewrite docs/api.md
python scripts/gen_api_doc.py --check  # CI: exit 1 if docs/api.md differs
"""

# ruff: noqa: E501  (the header's markdown table rows cannot wrap)
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = "pdserve/v1/generate.proto"
OUT = ROOT / "docs" / "api.md"
F = descriptor_pb2.FieldDescriptorProto
TYPES = {v: k[len("TYPE_") :].lower() for k, v in F.Type.items()}

HEADER = f"""# pdserve API reference (pdserve.v1)

Generated from `protos/{PUBLIC}` by `scripts/gen_api_doc.py` (`make stubs`; CI fails when this file is stale). Do not
edit by hand: change the proto comments or the script's header.

The router serves `pdserve.v1.Generation` (below) and the standard `grpc.health.v1.Health` on its public port.
Clients: Python `pdserve.Client` (shared/client.py), Go `clients/go`, TypeScript `clients/ts` (README, "Clients").

## Call contract

| Metadata key (request) | Meaning |
|---|---|
| `authorization` | `Bearer <token>`: the tenant, when the router runs with `--auth-tokens-file`; missing: UNAUTHENTICATED, unknown: PERMISSION_DENIED |
| `x-priority` | `high`, `normal` or `low`; the request's `priority` field wins when set; another value: INVALID_ARGUMENT |
| `traceparent`, `tracestate` | W3C trace context: the router's spans (and decode's, prefill's) continue this trace; an invalid one is dropped |
| `grpc-timeout` | the call's deadline (each SDK's timeout); past it: DEADLINE_EXCEEDED |

| Metadata key (trailer) | Meaning |
|---|---|
| `grpc-retry-pushback-ms` | on RESOURCE_EXHAUSTED from the router's admission: retry after this many ms (negative: do not retry) |
| `retry-after-ms` | the same delay under the older key (SDKs read `grpc-retry-pushback-ms` first) |

| Status | When |
|---|---|
| INVALID_ARGUMENT | a bad request: none or several of prompt / token_ids / messages, a sampling value out of range, an unknown role, token ids outside the vocabulary, a prompt longer than the context; the message says which |
| UNAUTHENTICATED | no bearer token (the router runs with `--auth-tokens-file`) |
| PERMISSION_DENIED | an unknown bearer token |
| RESOURCE_EXHAUSTED | with a pushback trailer: the router is at capacity, retry after it (the SDKs do, bounded; streams only before their first chunk); without one: a message over the port's size limit, not retryable |
| DEADLINE_EXCEEDED | the call's deadline passed |
| CANCELLED | the caller cancelled; generation stops and the request's KV pages are freed |
| UNAVAILABLE | no healthy prefill / decode instance (the router retries internally first) |

A field not marked `optional` defaults to its type's zero value (0, false, empty) when unset; `optional` fields
state their default in the table.

Cancelling a stream (closing it, a context / AbortSignal) stops the generation and frees its KV pages.

## Versioning

`pdserve.v1` is the public API's major version. Within v1 only backward-compatible changes are made: new fields,
messages, enum values and RPCs; comments; new metadata keys. A field is never renumbered, retyped or removed
(a retired field is `reserved`), a name on the wire (package, service, method) never changes, and a documented
default never changes meaning. `buf breaking` (FILE rules) checks every change against the released image
`protos/released/pdserve-v1.json`; a release refreshes that image (`make release-api-image`). A change that cannot be
made compatibly starts `pdserve.v2` in `protos/pdserve/v2/`, served next to v1 for at least one release. The
internal protos (`internal.proto`, `kv.proto`, `router_admin.proto`: router, prefill, decode and the registry) are
not part of this API and change freely with the services.
"""


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", "--include_source_info", f"-o{out}", PUBLIC]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def comments(fd: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    """Leading + trailing comment of each element by its source path, whitespace joined."""
    out = {}
    for loc in fd.source_code_info.location:
        text = " ".join(c.strip() for c in (loc.leading_comments, loc.trailing_comments) if c.strip())
        if text:
            out[tuple(loc.path)] = " ".join(text.split())
    return out


def field_type(f: descriptor_pb2.FieldDescriptorProto, msg: descriptor_pb2.DescriptorProto) -> str:
    t = f.type_name.rsplit(".", 1)[-1] if f.type_name else TYPES[f.type]
    entry = next((n for n in msg.nested_type if n.name == t and n.options.map_entry), None)
    if entry is not None:  # map<K, V> is a repeated nested *Entry message on the wire
        key, value = entry.field
        return f"map<{field_type(key, entry)}, {field_type(value, entry)}>"
    if f.label == F.LABEL_REPEATED:
        return f"repeated {t}"
    return f"optional {t}" if f.proto3_optional else t


def section(name: str, comment: str | None, columns: list[str]) -> list[str]:
    """A message's or enum's heading, its comment when the proto has one, and its table's header rows."""
    lines = [f"### {name}", ""]
    if comment is not None:
        lines += [comment, ""]
    return lines + ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def render(fd: descriptor_pb2.FileDescriptorProto) -> str:
    doc = comments(fd)
    lines = [HEADER]
    for si, svc in enumerate(fd.service):
        lines += [f"## service {fd.package}.{svc.name}", "", doc.get((6, si), ""), ""]
        lines += ["| RPC | Request | Response | |", "|---|---|---|---|"]
        for mi, m in enumerate(svc.method):
            out = ("stream " if m.server_streaming else "") + m.output_type.rsplit(".", 1)[-1]
            lines.append(f"| {m.name} | {m.input_type.rsplit('.', 1)[-1]} | {out} | {doc.get((6, si, 2, mi), '')} |")
        lines.append("")
    lines += ["## Messages", ""]
    for mi, msg in enumerate(fd.message_type):
        lines += section(msg.name, doc.get((4, mi)), ["Field", "#", "Type", "Description"])
        for fi, f in enumerate(msg.field):
            in_oneof = f.HasField("oneof_index") and not f.proto3_optional
            oneof = f" (oneof `{msg.oneof_decl[f.oneof_index].name}`)" if in_oneof else ""
            text = doc.get((4, mi, 2, fi), "").replace("|", "\\|")
            lines.append(f"| `{f.name}` | {f.number} | `{field_type(f, msg)}`{oneof} | {text} |")
        lines.append("")
    lines += ["## Enums", ""]
    for ei, enum in enumerate(fd.enum_type):
        lines += section(enum.name, doc.get((5, ei)), ["Value", "#", "Description"])
        lines += [f"| `{v.name}` | {v.number} | {doc.get((5, ei, 2, vi), '')} |" for vi, v in enumerate(enum.value)]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if docs/api.md is stale")
    args = ap.parse_args()
    fd = next(f for f in descriptor_set().file if f.name == PUBLIC)
    text = render(fd)
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_api_doc.py (or make stubs)")
            return 1
        print(f"{OUT.relative_to(ROOT)} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
