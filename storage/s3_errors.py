"""How object-store errors become vidx errors, by what the caller should do: gone, transient (refused
credentials included, logged without them), or permanent. Codes come from S3 and the pinned MinIO's
``cmd/api-errors.go``."""

from __future__ import annotations

import logging

import aiohttp
import botocore.exceptions

from storage.errors import PermanentError, TransientError, VidxError

log = logging.getLogger("storage.s3")

#: What the store's client raises; anything else is a bug and propagates as it is.
STORE_ERRORS: tuple[type[Exception], ...] = (
    botocore.exceptions.ClientError,
    botocore.exceptions.BotoCoreError,
    aiohttp.ClientError,
    OSError,
    TimeoutError,
)
#: No such object (version): HEAD answers carry no body, so botocore names them by status.
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchVersion"})
#: The store refused the credentials, the signature or the clock (S3 and MinIO codes; some are 400s).
#: Transient: a credential rotation or a clock fix ends them, and failing every job in flight
#: meanwhile would dead-letter work that needs no change at all.
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "AccountProblem",
        "AllAccessDisabled",
        "AuthorizationHeaderMalformed",
        "AuthorizationParametersError",
        "AuthorizationQueryParametersError",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidSecurity",
        "InvalidToken",
        "InvalidTokenId",
        "MissingSecurityHeader",
        "RequestTimeTooSkewed",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
        "UnauthorizedAccess",
    }
)
_ACCESS_STATUSES = frozenset({401, 403})
#: Overload, restarts, lock timeouts, bodies damaged in transit: the same request can succeed later
#: (``RequestTimeout`` is a 400 on AWS, ``OperationAborted`` a 409).
_TRANSIENT_CODES = frozenset(
    {
        "BadDigest",
        "IncompleteBody",
        "InternalError",
        "OperationAborted",
        "PreconditionFailed",
        "RequestLimitExceeded",
        "RequestTimeout",
        "ServerBusy",
        "ServiceUnavailable",
        "SlowDown",
        "SlowDownRead",
        "SlowDownWrite",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "XAmzContentSHA256Mismatch",
        "XMinioBucketMetadataNotInitialized",
        "XMinioIAMNotInitialized",
        "XMinioReadQuorum",
        "XMinioServerNotInitialized",
        "XMinioStorageFull",
        "XMinioWriteQuorum",
    }
)
_TRANSIENT_STATUSES = frozenset({408, 412, 429})
#: Permanent under a status of the other class: an archived object (403) won't become readable by
#: asking again, nor will a feature the server lacks (501).
_PERMANENT_CODES = frozenset({"InvalidObjectState", "NotImplemented"})
_CREDENTIAL_ERRORS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
)


class ObjectGone(TransientError):
    """Raised when an object disappeared (or changed version) while it was being read. Transient:
    the retry HEADs the object again and indexes or removes whatever is there now."""


class AccessRefused(TransientError):
    """Raised when the store refuses the credentials, the signature or the request time. Transient
    (see ``_ACCESS_CODES``); each one is logged as a warning naming the operation and the code."""


def error_code(exc: botocore.exceptions.ClientError) -> tuple[str, int | None]:
    """The S3 error code and HTTP status of ``exc``. A HEAD answer has no body, so botocore names
    its code by the status ("403"); MinIO sends the real code in a header, preferred then."""
    meta = exc.response.get("ResponseMetadata", {})
    code = str(exc.response.get("Error", {}).get("Code") or "")
    if not code or code.isdigit():
        code = str(meta.get("HTTPHeaders", {}).get("x-minio-error-code") or code)
    status = meta.get("HTTPStatusCode")
    return code, int(status) if status is not None else None


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the object (or the version asked for) does not exist."""
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code, status = error_code(exc)
    return code in _MISSING_CODES or status == 404


def convert_error(exc: Exception, what: str) -> VidxError:
    """One of ``STORE_ERRORS`` as what the caller should do about operation ``what`` (which names
    the operation and object; messages carry codes, never the store's text, which can hold keys).
    Missing objects are the caller's to check first (``is_missing``). Most specific first:

    - ``InvalidObjectState``, ``NotImplemented``: ``PermanentError``, whatever the status.
    - refused access (``_ACCESS_CODES``, 401, 403, no credentials at all): ``AccessRefused``, logged.
    - throttling, restarts (``_TRANSIENT_CODES``), 408, 412, 429, 5xx, an answer without an error
      code (a bare HEAD 400 is how AWS refuses an expired token): ``TransientError``.
    - any other answer (400 ``InvalidArgument``, 416, ...): ``PermanentError``.
    - a request the client won't build (``ParamValidationError``): ``PermanentError``.
    - connection errors, timeouts, dropped bodies, local I/O: ``TransientError``.
    """
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = error_code(exc)
        uncoded = not code or code.isdigit()
        answered = " ".join(part for part in (f"HTTP {status}" if status else "", "" if uncoded else code) if part)
        answered = answered or "an error without a code"
        if code in _PERMANENT_CODES:
            return PermanentError(f"{what}: object store answered {answered}")
        if code in _ACCESS_CODES or status in _ACCESS_STATUSES:
            log.warning("%s: object store refused access (%s); retried as transient", what, answered)
            return AccessRefused(f"{what}: object store refused access ({answered})")
        if uncoded or code in _TRANSIENT_CODES or status is None or status in _TRANSIENT_STATUSES or status >= 500:
            return TransientError(f"{what}: object store answered {answered}")
        return PermanentError(f"{what}: object store answered {answered}")
    if isinstance(exc, _CREDENTIAL_ERRORS):
        log.warning("%s: no usable object-store credentials (%s); retried as transient", what, type(exc).__name__)
        return AccessRefused(f"{what}: no usable object-store credentials ({type(exc).__name__})")
    if isinstance(exc, botocore.exceptions.ParamValidationError):
        return PermanentError(f"{what}: the request is invalid ({type(exc).__name__})")
    return TransientError(f"{what}: {type(exc).__name__}")
