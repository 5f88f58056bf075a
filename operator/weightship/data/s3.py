"""The S3 origin adapter: client factory, ranged GETs, multipart upload, publish.

This is the only place that retries S3 calls. botocore's own retries are switched off
so attempts are counted and backed off in one place: jittered exponential backoff on
throttling, 5xx and connection errors; never on 4xx such as 403 or 404.

Chunk GETs, the hot path, skip botocore's response machinery: boto3 signs a presigned
URL (SigV4, cached per object for a few minutes), and a plain keep-alive ``http.client``
connection per thread reads the ranged body with ``readinto`` straight into the chunk's
place (its slot in the node's mapped partial file, or a buffer), then hashes it.
Everything else goes through the boto3 client.
Presigned URLs carry a signature: they are never logged or put in an error message.
Every exception leaving an S3Origin call has had its text passed through
``weightship.errortext`` (this client's credentials and any signed field removed, length
capped) and its chained causes dropped, so a caller may show it as is.
"""

from __future__ import annotations

import http.client
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from weightship.data.httpconn import ThreadConnections, read_into
from weightship.errortext import error_text, redact
from weightship.weightformat.bounds import MAX_MANIFEST_BYTES
from weightship.weightformat.build import (
    DEFAULT_CHUNK_SIZE,
    LocalFolder,
    ProgressFn,
    build_manifest_with_pieces,
)
from weightship.weightformat.manifest import Manifest, ManifestError
from weightship.weightformat.paths import MANIFEST_NAME, is_metadata_path, validate_relative_path

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

T = TypeVar("T")

# Bytes per read when the caller verifies pieces as they land, unless it asks for less:
# the largest piece a manifest gets by default, so a piece is verified as soon as it is
# in. 256 KiB reads cost ~5 % of a stage's wall time on 2 cores (docs/benchmarks.md, P1);
# a node with peers waiting for its pieces reads one piece at a time (fetcher.py).
LANDED_STEP = 1024 * 1024
PRESIGN_EXPIRES_S = 900
PRESIGN_REUSE_S = 300  # signing costs ~0.5 ms: one URL per object serves many chunks
MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PARTS = 10_000
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ends with "/"

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {uri!r}")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return cls(bucket, prefix)

    def key(self, path: str) -> str:
        return self.prefix + validate_relative_path(path)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    max_connections: int = 32
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0

    @classmethod
    def from_secret(
        cls, endpoint_url: str | None, region: str | None, data: Mapping[str, str]
    ) -> S3Settings:
        """Settings from a credentialsSecretRef Secret's data (AWS_* keys; empty = ambient).

        Values are trimmed: a Secret made with ``--from-file`` keeps the file's trailing
        newline, which botocore refuses as a header value, quoting it in the error."""

        def value(key: str) -> str | None:
            text = (data.get(key) or "").strip()
            return text or None

        return cls(
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=value("AWS_ACCESS_KEY_ID"),
            secret_access_key=value("AWS_SECRET_ACCESS_KEY"),
            session_token=value("AWS_SESSION_TOKEN"),
        )

    @property
    def secrets(self) -> tuple[str | None, ...]:
        """The values no error text may show."""
        return (self.access_key_id, self.secret_access_key, self.session_token)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 10.0


# The credentials each client was made with, so that its origin's errors can be scrubbed
# of them (the client itself keeps them only inside botocore's private signer).
_client_secrets: weakref.WeakKeyDictionary[object, tuple[str | None, ...]] = (
    weakref.WeakKeyDictionary()
)


def make_client(settings: S3Settings) -> S3Client:
    """An S3 client with botocore retries off (tenacity retries here) and path-style
    addressing for custom endpoints (versitygw, MinIO, moto)."""
    try:
        client = _make_client(settings)
    except Exception as exc:
        raise scrubbed(exc, settings.secrets) from None
    _client_secrets[client] = settings.secrets
    return client


def scrubbed(exc: BaseException, secrets: tuple[str | None, ...] = ()) -> BaseException:
    """``exc`` itself (its type is kept, so retry and callers' checks still hold), with its
    text redacted and bounded and the chained causes that could quote a credential gone."""
    exc.args = (error_text(exc, secrets),)
    kwargs = getattr(exc, "kwargs", None)  # botocore keeps what it formatted the text from
    if isinstance(kwargs, dict):
        for key, value in kwargs.items():
            if isinstance(value, BaseException):
                kwargs[key] = error_text(value, secrets)
            elif isinstance(value, str):
                kwargs[key] = redact(value, secrets)
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        if "Message" in error:
            error["Message"] = error_text(Exception(error["Message"]), secrets)
    exc.__cause__ = None
    exc.__context__ = None
    exc.__suppress_context__ = True
    return exc


def _make_client(settings: S3Settings) -> S3Client:
    session = boto3.session.Session(
        aws_access_key_id=settings.access_key_id,
        aws_secret_access_key=settings.secret_access_key,
        aws_session_token=settings.session_token,
        region_name=settings.region,
    )
    config = Config(
        signature_version="s3v4",  # presigned chunk GETs too (some servers refuse SigV2)
        retries={"total_max_attempts": 1, "mode": "standard"},
        max_pool_connections=settings.max_connections,
        connect_timeout=settings.connect_timeout_s,
        read_timeout=settings.read_timeout_s,
        s3={"addressing_style": "path" if settings.endpoint_url else "auto"},
    )
    return session.client("s3", endpoint_url=settings.endpoint_url, config=config)


class OriginConnectionError(ConnectionError):
    """A chunk GET failed on the wire: refused, reset, timed out, or cut short."""


class ObjectTooLargeError(ValueError):
    """An object is larger than its reader may hold."""


def is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = exc.response.get("Error", {}).get("Code", "")
        return code in _RETRYABLE_CODES or status == 429 or status >= 500
    retryable = (HTTPClientError, BotoConnectionError, IncompleteReadError, OriginConnectionError)
    return isinstance(exc, retryable)


_ERROR_FIELD = re.compile(rb"<(Code|Message)>([^<]{0,512})</\1>")


def error_from_response(resp: http.client.HTTPResponse, operation: str) -> ClientError:
    """The ClientError botocore would raise for an S3 error answer (its XML Code and
    Message), so that retries and callers treat both GET paths alike."""
    fields = {
        k.decode(): v.decode("utf-8", "replace") for k, v in _ERROR_FIELD.findall(resp.read(65536))
    }
    return ClientError(
        {
            "Error": {
                "Code": fields.get("Code", str(resp.status)),
                "Message": fields.get("Message", ""),
            },
            "ResponseMetadata": {
                "HTTPStatusCode": resp.status,
                "RequestId": resp.getheader("x-amz-request-id", ""),
                "HostId": resp.getheader("x-amz-id-2", ""),
                "HTTPHeaders": {k.lower(): v for k, v in resp.getheaders()},
                "RetryAttempts": 0,
            },
        },
        operation,
    )


class S3Origin:
    """Weights under one S3 prefix. Paths are relative to the prefix."""

    def __init__(
        self, client: S3Client, location: S3Location, retry: RetryPolicy | None = None
    ) -> None:
        self.client = client
        self.location = location
        self.retry = retry or RetryPolicy()
        # botocore's Config has read_timeout at runtime; its stub does not declare it.
        self._http = ThreadConnections(float(getattr(client.meta.config, "read_timeout", 60)))
        self._last_read = threading.local()  # this thread's last read: (first byte s, rest s)
        self._urls: dict[str, tuple[float, str]] = {}  # key -> (signed at, presigned URL)
        self._urls_lock = threading.Lock()

    def _call(self, fn: Callable[[], T]) -> T:
        retrying = Retrying(
            stop=stop_after_attempt(self.retry.attempts),
            wait=wait_random_exponential(
                multiplier=self.retry.initial_backoff_s, max=self.retry.max_backoff_s
            ),
            retry=retry_if_exception(is_retryable),
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:
            raise scrubbed(exc, _client_secrets.get(self.client, ())) from None

    def list_files(self) -> list[tuple[str, int]]:
        """Every object under the prefix except the manifest, as (relative path, size)."""

        def list_all() -> list[tuple[str, int]]:
            found = []
            paginator = self.client.get_paginator("list_objects_v2")
            pages = paginator.paginate(Bucket=self.location.bucket, Prefix=self.location.prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(self.location.prefix) :]
                    if rel and not is_metadata_path(rel) and not rel.endswith("/"):
                        found.append((rel, obj["Size"]))
            return sorted(found)

        return self._call(list_all)

    def read_range_into(
        self,
        path: str,
        offset: int,
        view: memoryview,
        landed: Callable[[int], None] | None = None,
        step: int = LANDED_STEP,
    ) -> None:
        """Read ``len(view)`` bytes at ``offset`` into ``view`` (a chunk's slot in a mapped
        file, say). ``landed(n)``, when given, is called with bytes [0, n) in after each
        read of up to ``step`` bytes, so the caller can verify pieces as they arrive
        (BLAKE3 keeps up: sha256 here stalled the server's stream between reads,
        docs/benchmarks.md). Without it the body is read in one ``readinto``. A retried
        attempt overwrites what a failed one left, and says so from 0 again."""
        if step < 1:
            raise ValueError(f"read step must be at least 1 byte, not {step}")
        self._read_into(path, offset, view, landed, step)

    def last_read(self) -> tuple[float, float] | None:
        """This thread's last complete ranged read: seconds to its first byte (about a
        round trip, plus the server's latency) and seconds from there to its last."""
        timing: tuple[float, float] | None = getattr(self._last_read, "timing", None)
        return timing

    def renew_connection(self) -> None:
        """Close this thread's connection to the origin: its next read opens a new one."""
        self._http.close()

    def read_range(self, path: str, offset: int, size: int) -> bytearray:
        buf = bytearray(size)
        self._read_into(path, offset, memoryview(buf))
        return buf

    def _read_into(
        self,
        path: str,
        offset: int,
        view: memoryview,
        landed: Callable[[int], None] | None = None,
        step: int = LANDED_STEP,
    ) -> None:
        key, total = self.location.key(path), len(view)
        # With ``landed``, a retry resumes where the last attempt stopped: bytes already
        # landed (and maybe verified and served on) are never written again.
        resume = [0]
        if not total:
            return

        def get() -> None:
            start = resume[0]
            size, part = total - start, view[start:]
            url = urlsplit(self._presigned(key))
            scheme, host = url.scheme, url.netloc
            headers = {"Range": f"bytes={offset + start}-{offset + total - 1}"}
            asked = time.monotonic()
            try:
                resp = self._http.request(
                    "GET", host, f"{url.path}?{url.query}", headers, scheme=scheme
                )
                first_byte = time.monotonic()
                if resp.status not in (200, 206):
                    error = error_from_response(resp, "GetObject")
                    self._http.drop(scheme, host)
                    raise error
                if resp.length != size:
                    self._http.drop(scheme, host)  # never read a body we did not ask for
                    raise OriginConnectionError(
                        f"{self.location}{path}: asked for {size} bytes at {offset + start}, "
                        f"the answer has {resp.length}"
                    )
                if landed is None:
                    got = read_into(resp, part)
                else:

                    def progress(n: int) -> None:
                        resume[0] = start + n
                        landed(start + n)

                    got = read_into(resp, part, progress, step)
            except OriginConnectionError:
                raise
            except (OSError, http.client.HTTPException) as exc:
                self._http.drop(scheme, host)
                raise OriginConnectionError(f"{self.location}{path}: {exc!r}") from exc
            if got != size:
                self._http.drop(scheme, host)
                raise IncompleteReadError(actual_bytes=got, expected_bytes=size)
            self._http.done(scheme, host, resp)
            self._last_read.timing = (first_byte - asked, time.monotonic() - first_byte)

        self._call(get)

    def _presigned(self, key: str) -> str:
        """A presigned GET URL for ``key``, reused for PRESIGN_REUSE_S."""
        now = time.monotonic()
        with self._urls_lock:
            cached = self._urls.get(key)
            if cached and now - cached[0] < PRESIGN_REUSE_S:
                return cached[1]
        url = self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.location.bucket, "Key": key},
            ExpiresIn=PRESIGN_EXPIRES_S,
        )
        with self._urls_lock:
            self._urls[key] = (now, url)
        return url

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        """The whole object; over ``max_bytes`` it is refused before its body is read."""
        key = self.location.key(path)

        def get() -> bytes:
            answer = self.client.get_object(Bucket=self.location.bucket, Key=key)
            body = answer["Body"]
            try:
                if max_bytes is not None and answer.get("ContentLength", 0) > max_bytes:
                    raise ObjectTooLargeError(
                        f"{self.location}{path} is {answer['ContentLength']} bytes, "
                        f"over the {max_bytes} bytes it may take"
                    )
                data = body.read() if max_bytes is None else body.read(max_bytes + 1)
                if max_bytes is not None and len(data) > max_bytes:
                    raise ObjectTooLargeError(
                        f"{self.location}{path} is over the {max_bytes} bytes it may take"
                    )
                return data
            finally:
                body.close()

        return self._call(get)

    def put_bytes(self, path: str, data: bytes) -> None:
        key = self.location.key(path)
        self._call(lambda: self.client.put_object(Bucket=self.location.bucket, Key=key, Body=data))

    def read_manifest(self) -> Manifest:
        source = f"{self.location}{MANIFEST_NAME}"
        try:
            data = self.read_bytes(MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectTooLargeError as exc:
            raise ManifestError(f"{source} is invalid: {exc}") from None
        return Manifest.parse(data, source=source)

    def write_manifest(self, manifest: Manifest, pieces: bytes | None = None) -> None:
        """Write the manifest, its piece layer (version 2) first: a manifest at the
        origin means everything it names is there."""
        if manifest.piece_layer_path is not None:
            if pieces is None:
                raise ValueError(f"manifest {manifest.digest} needs its piece layer")
            self.put_bytes(manifest.piece_layer_path, pieces)
        self.put_bytes(MANIFEST_NAME, manifest.canonical_bytes())

    def upload_file(
        self,
        local: Path,
        path: str,
        *,
        part_size: int = DEFAULT_CHUNK_SIZE,
        workers: int = 8,
        on_bytes: ProgressFn | None = None,
    ) -> None:
        """Upload one file; parts go up in parallel, each retried on its own."""
        size = local.stat().st_size
        part_size = max(part_size, MIN_PART_SIZE, math.ceil(size / MAX_PARTS))
        if size <= part_size:
            self.put_bytes(path, local.read_bytes())
            if on_bytes:
                on_bytes(size)
            return
        bucket, key = self.location.bucket, self.location.key(path)
        upload_id = self._call(
            lambda: self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        )

        def upload_part(number: int) -> str:
            offset = (number - 1) * part_size
            with open(local, "rb") as f:
                f.seek(offset)
                body = f.read(part_size)
            etag = self._call(
                lambda: self.client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                )["ETag"]
            )
            if on_bytes:
                on_bytes(len(body))
            return etag

        numbers = range(1, math.ceil(size / part_size) + 1)
        try:
            with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                etags = list(pool.map(upload_part, numbers))
            parts: list[CompletedPartTypeDef] = [
                {"PartNumber": n, "ETag": e} for n, e in zip(numbers, etags, strict=True)
            ]
            self._call(
                lambda: self.client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
            )
        except BaseException:
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise


def publish(
    folder: Path,
    origin: S3Origin,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    workers: int = 8,
    on_hashed: ProgressFn | None = None,
    on_uploaded: ProgressFn | None = None,
    version: Literal[1, 2] = 2,
    piece_size: int | None = None,
) -> Manifest:
    """Hash ``folder``, upload every file, then the piece layer and the manifest.

    The manifest goes last: its presence at the origin means every file it lists is there.
    """
    local = LocalFolder(folder)
    manifest, pieces = build_manifest_with_pieces(
        local,
        chunk_size=chunk_size,
        workers=workers,
        on_bytes=on_hashed,
        version=version,
        piece_size=piece_size,
    )
    for entry in manifest.files:
        origin.upload_file(
            folder / entry.path,
            entry.path,
            part_size=chunk_size,
            workers=workers,
            on_bytes=on_uploaded,
        )
    origin.write_manifest(manifest, pieces)
    return manifest
