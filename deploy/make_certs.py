"""One-shot step of the compose stack (and a helper for k8s Secrets): a private CA, one certificate for every
pdserve service (server and client use, SANs: the compose host names, localhost, 127.0.0.1 and the shared name
`pdserve-internal` that --tls-server-name / PDSERVE_TLS_SERVER_NAME can verify pods dialed by IP against), and a
random internal token, written to PDSERVE_CERTS_DIR (or argv[1]). Kept when they exist, so a restart keeps them.

    python deploy/make_certs.py ./certs     # then e.g. kubectl create secret generic pdserve-tls --from-file=certs
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SANS = ("router", "prefill", "decode", "prefill-gpu", "gateway", "pdserve-internal", "localhost", "127.0.0.1")


def make(directory: Path) -> None:
    from pdserve.server.auth import new_token
    from pdserve.testing.certs import CertAuthority

    if (directory / "ca.pem").exists() and (directory / "internal_token").exists():
        print(f"certificates and token already in {directory}")
        return
    ca = CertAuthority.create(directory, name="pdserve stack CA", days=365)
    ca.issue("stack", hosts=SANS, days=365)
    token = directory / "internal_token"
    token.write_text(new_token() + "\n")
    token.chmod(0o600)
    print(f"wrote ca.pem, stack.pem, stack-key.pem, internal_token to {directory}")


if __name__ == "__main__":
    make(Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PDSERVE_CERTS_DIR", "/certs")))
