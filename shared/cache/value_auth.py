"""Keyed protection of the prompt cache's store: values authenticated with a MAC, key names that hide the prompt.

Every prefill (and colocated) instance of a deployment shares one cache secret (`--cache-secret-file`,
$PDSERVE_CACHE_SECRET_FILE or $PDSERVE_CACHE_SECRET), distinct from the internal token. From each secret two keys
are derived (HMAC-SHA256 with fixed labels), so the same secret never serves two purposes:

    name  = key prefix || hex HMAC-SHA256(name key, chain hash)                 the store key of a page
    tag   = BLAKE3-keyed(MAC key, "pdserve-cache-value-2" || chain hash || value)  32 bytes, after the value

The tag is BLAKE3 in its keyed mode (a MAC; the `blake3` package, which releases the GIL): it runs at several
times HMAC-SHA256's speed on one core, and every fetched byte of a prompt-cache hit goes through it.

The chain hash (keys.py) pins the tokens of the prefix, the model, the KV layout and the tenant's scope, so a
reader of the store without the secret learns neither which prompt nor which tenant a key belongs to (it cannot
compute a guessed prompt's name), and a writer without the secret cannot make a value that verifies (it can only
delete or damage one: a miss). Rotation: a keyring lists the current secret first (it signs and names every new
value) and previous ones after it (their values are still read during the overlap, and rewritten under the
current one); removing a secret from the list ends its values' validity.

Secret text: one secret a line (or comma separated), each 32-4096 printable ASCII characters without spaces, `#`
or `,`; lines starting with `#` are comments. `new_secret()` makes one.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3

log = logging.getLogger("pdserve.cache")

TAG_BYTES = 32  # BLAKE3's default output
ENV_SECRET, ENV_SECRET_FILE = "PDSERVE_CACHE_SECRET", "PDSERVE_CACHE_SECRET_FILE"
_SECRET = re.compile(r"[\x21\x22\x24-\x2b\x2d-\x7e]{32,4096}")  # printable ASCII but space, `#` and `,`
_VALUE_LABEL = b"pdserve-cache-value-2"


def new_secret() -> str:
    """A random cache secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class CacheKey:
    """The keys derived from one secret; `id` names it in logs (a digest: it says nothing about the secret)."""

    mac_key: bytes
    name_key: bytes
    id: str

    @classmethod
    def from_secret(cls, secret: str | bytes) -> CacheKey:
        s = secret.encode() if isinstance(secret, str) else secret
        derive = lambda label: hmac.digest(s, b"pdserve prompt cache " + label, "sha256")  # noqa: E731
        return cls(derive(b"value MAC"), derive(b"key name"), derive(b"key id")[:4].hex())

    def name(self, prefix: str, chain: bytes) -> bytes:
        """The store key of the page with chain hash `chain`."""
        return prefix.encode() + hmac.new(self.name_key, chain, "sha256").hexdigest().encode()

    def tag(self, chain: bytes, value) -> bytes:
        """MAC of `value` (any buffer) stored under `chain`; one thread (the callers run several at once), the GIL
        released while it hashes."""
        h = blake3.blake3(_VALUE_LABEL, key=self.mac_key, max_threads=1)
        h.update(chain)
        h.update(value)
        return h.digest()

    def verify(self, chain: bytes, stored) -> memoryview | None:
        """The value of a stored `value || tag` if its tag verifies under this key, else None."""
        view = memoryview(stored)
        if view.nbytes < TAG_BYTES:
            return None
        value = view[: view.nbytes - TAG_BYTES]
        return value if hmac.compare_digest(self.tag(chain, value), view[view.nbytes - TAG_BYTES :]) else None


@dataclass(frozen=True)
class CacheKeyring:
    """The keys a cache accepts, current first (it names and signs new values); `origin` says where they came
    from, for logs."""

    keys: tuple[CacheKey, ...]
    origin: str = "given"

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a keyring needs at least one key")

    @property
    def current(self) -> CacheKey:
        return self.keys[0]

    @classmethod
    def of(cls, *secrets_: str | bytes, origin: str = "given") -> CacheKeyring:
        return cls(tuple(CacheKey.from_secret(s) for s in secrets_), origin)

    @classmethod
    def generate(cls, origin: str = "generated") -> CacheKeyring:
        """A keyring of one random secret: private to its holder (nothing else can read what it writes)."""
        return cls.of(new_secret(), origin=origin)

    @classmethod
    def parse(cls, text: str, where: str) -> CacheKeyring:
        """Secrets from text: one a line (or comma separated), current first; lines starting with `#` are comments."""
        found = []
        lines = [line.strip() for line in text.splitlines()]
        for n, entry in enumerate((e.strip() for ln in lines if not ln.startswith("#") for e in ln.split(",")), 1):
            if not entry:
                continue
            if not _SECRET.fullmatch(entry):
                raise SystemExit(
                    f"{where}: entry {n}: a cache secret is 32-4096 printable ASCII characters without space, # or ,"
                )
            found.append(entry)
        if not found:
            raise SystemExit(f"{where}: no cache secret in it")
        if len(set(found)) != len(found):
            raise SystemExit(f"{where}: a cache secret is listed twice")
        return cls.of(*found, origin=where)

    @classmethod
    def from_file(cls, path: str | Path) -> CacheKeyring:
        p = Path(path)
        try:
            mode = p.stat().st_mode
            text = p.read_text()
        except OSError as e:
            raise SystemExit(f"cannot read cache secret file {p}: {e}") from None
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            log.warning("cache secret file %s is readable or writable by every user: make it 0400", p)
        return cls.parse(text, f"cache secret file {p}")

    def seal(self, chain: bytes, value) -> list:
        """The parts of the stored form of `value` under the current key: `value || tag` (the caller joins them,
        `pdserve.kv.bytes_out.concat`, outside the GIL)."""
        return [value, self.current.tag(chain, value)]

    def names(self, prefix: str, chain: bytes) -> list[bytes]:
        """The store key of `chain` under every accepted key, current first."""
        return [k.name(prefix, chain) for k in self.keys]


def keyring_from(path: str, environ: Mapping[str, str]) -> CacheKeyring | None:
    """The configured keyring: `path`, else $PDSERVE_CACHE_SECRET_FILE, else $PDSERVE_CACHE_SECRET, else None."""
    path = path or environ.get(ENV_SECRET_FILE, "")
    if path:
        return CacheKeyring.from_file(path)
    value = environ.get(ENV_SECRET, "")
    return CacheKeyring.parse(value, f"${ENV_SECRET}") if value else None


def write_secret_file(path: str | Path, secret: str | None = None) -> Path:
    """Write a (new random) cache secret to `path`, mode 0400 (an existing file is replaced); what `pdserve up`
    hands every prefill instance of the stack it starts."""
    p = Path(path)
    p.unlink(missing_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((secret or new_secret()) + "\n")
    p.chmod(0o400)
    return p
