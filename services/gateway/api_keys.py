"""API keys: a file of keys, one per line (a mounted Kubernetes Secret); `Authorization: Bearer <key>` is
checked in constant time against every key. No file means authentication is off (`make up`)."""

from __future__ import annotations

import hmac
from pathlib import Path

from kubesgl.errors import AuthenticationError

ANONYMOUS = "anonymous"


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_file(cls, path: str | None) -> ApiKeys:
        if not path:
            return cls([])
        lines = Path(path).read_text().splitlines()
        keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"API keys file {path} holds no keys")
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> str:
        """The key the request presents (ANONYMOUS when auth is off); raises AuthenticationError otherwise."""
        if not self.enabled:
            return ANONYMOUS
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        candidate = presented.strip().encode()
        # Compare against every key, no early exit: timing reveals neither which key nor how much matched.
        matched = [hmac.compare_digest(candidate, k) for k in self._keys]
        if not any(matched):
            raise AuthenticationError("invalid API key")
        return candidate.decode()
