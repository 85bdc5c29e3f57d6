"""One-shot step of the compose stack (and a helper for k8s Secrets): a private CA, one certificate for every
pdserve service and Redis (server and client use, SANs: the compose host names, `redis`, localhost, 127.0.0.1 and
the shared name `pdserve-internal` that --tls-server-name / PDSERVE_TLS_SERVER_NAME can verify pods dialed by IP
against), a random internal token, the prompt cache's secret (values MACed, key names hashed: docs/security.md),
and Redis' ACL users with random passwords, written to PDSERVE_CERTS_DIR (or argv[1]). Kept when they exist, so a
restart keeps them.

    ca.pem stack.pem stack-key.pem   the CA and the one certificate (Redis serves TLS with it too)
    internal_token                   the internal token every internal RPC carries
    cache_secret                     the prompt-cache secret every prefill instance shares
    redis_password                   the password of Redis user `prefill` (keys pdserve:kv:*: the prompt cache)
    redis_router_password            the password of Redis user `router` (keys pdserve:router:*: its estimator)
    redis_users.acl                  Redis' --aclfile: those two users (passwords as SHA-256), `default` off

    python deploy/make_certs.py ./certs     # then the kubectl create secret commands of docs/security.md
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

SANS = ("router", "prefill", "decode", "prefill-gpu", "gateway", "redis", "pdserve-internal", "localhost", "127.0.0.1")
# what each Redis user may do: its own keys, the commands its client sends, nothing else (no KEYS, FLUSHALL, ...)
REDIS_USERS = {
    "prefill": ("redis_password", "~pdserve:kv:* -@all +get +getex +set +pexpire +ping +select +config|get"),
    "router": ("redis_router_password", "~pdserve:router:* -@all +get +set +ping +select"),
}


def _secret_file(path: Path, text: str) -> None:
    path.write_text(text + "\n")
    path.chmod(0o400)


def redis_acl(directory: Path) -> str:
    """The ACL file of the users in REDIS_USERS, with the passwords written in `directory`."""
    lines = ["user default off"]
    for user, (password_file, rules) in REDIS_USERS.items():
        digest = hashlib.sha256((directory / password_file).read_text().strip().encode()).hexdigest()
        lines.append(f"user {user} on #{digest} resetchannels {rules}")
    return "\n".join(lines)


def make(directory: Path) -> None:
    from pdserve.cache.value_auth import new_secret
    from pdserve.server.auth import new_token
    from pdserve.testing.certs import CertAuthority

    made = []
    if not ((directory / "ca.pem").exists() and (directory / "internal_token").exists()):
        ca = CertAuthority.create(directory, name="pdserve stack CA", days=365)
        ca.issue("stack", hosts=SANS, days=365)
        token = directory / "internal_token"
        token.write_text(new_token() + "\n")
        token.chmod(0o600)
        made += ["ca.pem", "stack.pem", "stack-key.pem", "internal_token"]
    for name in ("cache_secret", *(f for f, _ in REDIS_USERS.values())):
        if not (directory / name).exists():
            _secret_file(directory / name, new_secret())
            made.append(name)
    if made or not (directory / "redis_users.acl").exists():
        (directory / "redis_users.acl").unlink(missing_ok=True)
        _secret_file(directory / "redis_users.acl", redis_acl(directory))
        made.append("redis_users.acl")
    print(f"wrote {', '.join(made)} to {directory}" if made else f"certificates and secrets already in {directory}")


if __name__ == "__main__":
    make(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PDSERVE_CERTS_DIR", "/certs")))
