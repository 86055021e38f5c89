"""Short-lived signed links: to the media the API serves (thumbnails), so that a page can load them
in ``<img>`` tags without the API key ever travelling in a URL (URLs end up in logs and histories);
and presigned S3 links to play a video or upload one straight to the bucket (``S3Links``).

A link carries ``exp`` (Unix seconds) and ``sig``: HMAC-SHA256 over the path, the query that names
the content and ``exp``. Expiry is rounded up to ``EXPIRY_STEP_S`` so one picture keeps one URL for a
while (browsers cache it) instead of a new URL per search.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import math
import mimetypes
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from pydantic import SecretStr

from storage.config import S3Settings
from storage.s3 import ObjectStore

if TYPE_CHECKING:
    from pipeline.settings import Settings

#: Expiries are multiples of this: links minted within one step are the same link.
EXPIRY_STEP_S = 60
#: Longest ``exp`` accepted (Unix seconds have 10 digits until 2286).
MAX_EXP_DIGITS = 12
#: What the derived key is for (a key derived from the API keys signs nothing else).
_KEY_CONTEXT = b"vidx media links v1"


def derive_key(explicit: SecretStr | None, keys: Iterable[SecretStr]) -> bytes:
    """The signing key: ``explicit`` when set, else one derived from the API keys (every API replica
    derives the same one, and rotating the keys retires old links). Without keys at all there is no
    auth and links are not checked; the key is then fixed and unsecret."""
    if explicit is not None:
        return hashlib.sha256(explicit.get_secret_value().encode()).digest()
    digests = sorted(hashlib.sha256(k.get_secret_value().encode()).digest() for k in keys)
    return hmac.new(_KEY_CONTEXT, b"".join(digests), hashlib.sha256).digest()


class MediaSigner:
    """Signs and checks links to ``path`` (plus the content-naming ``params``) valid ``ttl_s``."""

    def __init__(self, key: bytes, ttl_s: int) -> None:
        self._key = key
        self.ttl_s = ttl_s

    def _sig(self, path: str, params: dict[str, str], exp: int) -> str:
        message = "\n".join([path, urlencode(sorted(params.items())), str(exp)]).encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:18]).decode()

    def sign(self, path: str, params: dict[str, str], now_s: float | None = None) -> str:
        """``path?params&exp=…&sig=…``, valid at least ``ttl_s`` and at most ``ttl_s + EXPIRY_STEP_S``."""
        now_s = time.time() if now_s is None else now_s
        exp = math.ceil((now_s + self.ttl_s) / EXPIRY_STEP_S) * EXPIRY_STEP_S
        query = urlencode({**params, "exp": exp, "sig": self._sig(path, params, exp)})
        return f"{path}?{query}"

    def verify(self, path: str, query: dict[str, str], now_s: float | None = None) -> bool:
        """Whether ``query`` (all of it: content params, ``exp``, ``sig``) is a live signature of ``path``."""
        now_s = time.time() if now_s is None else now_s
        params = {k: v for k, v in query.items() if k not in ("exp", "sig")}
        exp, sig = query.get("exp", ""), query.get("sig", "")
        # isdigit alone lets other scripts' digits through ("²"), which int() refuses.
        if not (exp.isascii() and exp.isdigit() and len(exp) <= MAX_EXP_DIGITS) or not sig or int(exp) < now_s:
            return False
        # A link can't be made to outlive what the server would mint (a leaked key aside).
        if int(exp) > now_s + self.ttl_s + EXPIRY_STEP_S:
            return False
        return hmac.compare_digest(sig, self._sig(path, params, int(exp)))


def media_signer(settings: Settings) -> MediaSigner:
    """The signer every API replica builds alike from the settings (links live ``presign_ttl_s``,
    like the presigned playback links next to them)."""
    keys = [*settings.api_keys, *([settings.admin_key] if settings.admin_key else [])]
    return MediaSigner(derive_key(settings.media_key, keys), settings.s3.presign_ttl_s)


class S3Links:
    """Presigned GET and PUT links on the clients' endpoint (``public_endpoint_url``), valid
    ``presign_ttl_s``. One signing client for the owner's life: opening one costs hundreds of ms of
    CPU (botocore loads its service models), more than a whole search; signing needs no request."""

    def __init__(self, s3: S3Settings) -> None:
        self._s3 = s3
        self._store: ObjectStore | None = None
        self._lock = asyncio.Lock()

    @property
    def ttl_s(self) -> int:
        return self._s3.presign_ttl_s

    async def _signer(self) -> ObjectStore:
        if self._store is None:
            async with self._lock:
                if self._store is None:
                    self._store = await ObjectStore(self._s3, endpoint_url=self._s3.public_endpoint_url).__aenter__()
        return self._store

    async def presign_get(self, bucket: str, key: str) -> str:
        """A playback link; the store answers with a video type guessed from the key (or
        ``application/octet-stream``), never a type an uploader chose, such as ``text/html``."""
        guessed = mimetypes.guess_type(key)[0] or ""
        content_type = guessed if guessed.startswith("video/") else "application/octet-stream"
        return await (await self._signer()).presign_get(bucket, key, self._s3.presign_ttl_s, content_type)

    async def presign_put(self, bucket: str, key: str, content_type: str, size_bytes: int) -> str:
        signer = await self._signer()
        return await signer.presign_put(bucket, key, self._s3.presign_ttl_s, content_type, size_bytes)

    async def aclose(self) -> None:
        """Close the signing client (it is reopened if used again)."""
        store, self._store = self._store, None
        if store is not None:
            await store.__aexit__(None, None, None)
