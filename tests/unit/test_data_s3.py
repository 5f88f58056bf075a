import hashlib
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError
from click.testing import CliRunner
from moto.server import ThreadedMotoServer
from prometheus_client import CollectorRegistry

from weightship.data.chunkstore import ChunkStore
from weightship.data.cli import manifest_command, parse_size, publish_command
from weightship.data.manifest import MANIFEST_NAME, LocalFolder, Manifest, build_manifest
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.s3 import (
    RetryPolicy,
    S3Location,
    S3Origin,
    S3Settings,
    make_client,
    publish,
)
from weightship.data.stage import stage

MiB = 1024 * 1024
QUICK_RETRY = RetryPolicy(attempts=5, initial_backoff_s=0.001, max_backoff_s=0.01)
_buckets = itertools.count()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def settings(endpoint: str) -> S3Settings:
    return S3Settings(
        endpoint_url=endpoint, region="us-east-1", access_key_id="k", secret_access_key="s"
    )


@pytest.fixture
def origin(settings: S3Settings) -> S3Origin:
    client = make_client(settings)
    bucket = f"weights-{next(_buckets)}"
    client.create_bucket(Bucket=bucket)
    return S3Origin(client, S3Location(bucket, "models/llama/"), retry=QUICK_RETRY)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    folder = tmp_path / "weights"
    (folder / "sub").mkdir(parents=True)
    rng = random.Random(0)
    (folder / "model.safetensors").write_bytes(rng.randbytes(6 * MiB + 5))  # multipart
    (folder / "sub" / "tokenizer.json").write_bytes(b'{"vocab": []}')
    return folder


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data


def inject(origin: S3Origin, operation: str, status: int, code: str, times: int) -> list[int]:
    """Answer the first ``times`` calls of ``operation`` with an S3 error; count all calls."""
    calls: list[int] = []

    def before_send(request: Any, **_: Any) -> AWSResponse | None:
        calls.append(len(calls))
        if len(calls) > times:
            return None
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    origin.client.meta.events.register(f"before-send.s3.{operation}", before_send)
    return calls


def test_location_parsing() -> None:
    assert S3Location.parse("s3://b/p/q") == S3Location("b", "p/q/")
    assert S3Location.parse("s3://b") == S3Location("b", "")
    assert S3Location("b", "p/").key("x/y") == "p/x/y"
    with pytest.raises(ValueError, match=r"'\.\.'"):
        S3Location("b", "p/").key("../other-model/w")
    with pytest.raises(ValueError, match="not an s3"):
        S3Location.parse("https://b/p")


def test_publish_then_build_from_s3_matches_local(origin: S3Origin, weights: Path) -> None:
    published = publish(weights, origin, chunk_size=1 * MiB, workers=4)
    assert origin.read_manifest().digest == published.digest
    assert sorted(p for p, _ in origin.list_files()) == ["model.safetensors", "sub/tokenizer.json"]
    from_s3 = build_manifest(origin, chunk_size=1 * MiB, workers=2)
    assert from_s3.digest == build_manifest(LocalFolder(weights), chunk_size=1 * MiB).digest
    data = (weights / "model.safetensors").read_bytes()
    assert origin.read_range("model.safetensors", 3 * MiB, 100) == data[3 * MiB : 3 * MiB + 100]
    # Hashed as the body streams in, in pieces: the same digest as hashing it after.
    piece = data[MiB // 2 : MiB // 2 + 2 * MiB + 7]
    got, digest = origin.read_range_hashed("model.safetensors", MiB // 2, len(piece))
    assert got == piece
    assert digest == hashlib.sha256(piece).hexdigest()


def test_slowdown_is_retried(origin: S3Origin) -> None:
    origin.put_bytes("w.bin", b"0123456789")
    calls = inject(origin, "GetObject", 503, "SlowDown", times=3)
    assert origin.read_range("w.bin", 2, 4) == b"2345"
    assert len(calls) == 4


@pytest.mark.parametrize(("status", "code"), [(403, "AccessDenied"), (404, "NoSuchKey")])
def test_client_errors_are_not_retried(origin: S3Origin, status: int, code: str) -> None:
    calls = inject(origin, "GetObject", status, code, times=100)
    with pytest.raises(ClientError, match=code):
        origin.read_range("w.bin", 0, 4)
    assert len(calls) == 1


def test_retries_give_up_after_the_policy(origin: S3Origin) -> None:
    calls = inject(origin, "GetObject", 500, "InternalError", times=100)
    with pytest.raises(ClientError, match="InternalError"):
        origin.read_range("w.bin", 0, 4)
    assert len(calls) == QUICK_RETRY.attempts


def test_stage_from_s3(origin: S3Origin, weights: Path, tmp_path: Path) -> None:
    publish(weights, origin, chunk_size=1 * MiB)
    manifest = origin.read_manifest()
    store = ChunkStore(tmp_path / "cache")
    dp = DataPlaneMetrics.create(CollectorRegistry())
    result = stage(manifest, store, origin, [], node="n1", metrics=dp)
    assert result.from_origin == manifest.total_size
    for f in manifest.files:
        assert (result.path / f.path).read_bytes() == (weights / f.path).read_bytes()


def test_cli_publish_and_manifest(
    settings: S3Settings, origin: S3Origin, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert settings.endpoint_url
    common = ["--endpoint", settings.endpoint_url, "--region", "us-east-1", "--chunk-size", "1Mi"]
    uri = str(origin.location)
    runner = CliRunner()

    result = runner.invoke(publish_command, [str(weights), uri, *common])
    assert result.exit_code == 0, result.output
    digest = origin.read_manifest().digest
    assert digest in result.output

    # `manifest` over the published prefix prints the same content identity.
    result = runner.invoke(manifest_command, [uri, *common])
    assert result.exit_code == 0, result.output
    printed = result.stdout.strip().splitlines()[0]
    assert Manifest.parse(printed).digest == digest

    # And over the local folder, --write puts the manifest beside the weights.
    result = runner.invoke(manifest_command, [str(weights), "--write", "--chunk-size", "1Mi"])
    assert result.exit_code == 0, result.output
    assert Manifest.parse((weights / MANIFEST_NAME).read_bytes()).digest == digest
    assert json.loads((weights / MANIFEST_NAME).read_bytes())["createdAt"]

    result = runner.invoke(manifest_command, [str(weights / "nope")])
    assert result.exit_code != 0 and "neither s3" in result.output


def test_parse_size() -> None:
    assert parse_size("16Mi") == parse_size("16MiB") == 16 * MiB
    assert parse_size("4M") == 4_000_000
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError):
        parse_size("lots")
