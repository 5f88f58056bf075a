import http.client
import itertools
import json
import random
import threading
import time
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from click.testing import CliRunner
from moto.server import ThreadedMotoServer
from prometheus_client import CollectorRegistry

from weightship.data.chunkstore import ChunkStore
from weightship.data.cli import manifest_command, parse_size, publish_command
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.s3 import (
    OriginConnectionError,
    RetryPolicy,
    S3Location,
    S3Origin,
    S3Settings,
    make_client,
    publish,
)
from weightship.data.stage import stage
from weightship.httpserver import Server
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.chunkhash import ChunkVerificationError, PieceLayer
from weightship.weightformat.manifest import Manifest, ManifestError
from weightship.weightformat.paths import MANIFEST_NAME

MiB = 1024 * 1024
KiB = 1024
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


class FaultyFront:
    """A real HTTP server in front of moto that forwards every request, except that the
    next chunk GETs (ranged) can be answered with an S3 error or cut off mid-body."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        # (status, code), "cut", "no-range", "slow-body"
        self.faults: list[tuple[int, str] | str] = []
        self.ranged_gets = 0
        self.connections = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                front.connections += 1

            def do_GET(self) -> None:
                if "Range" in self.headers:
                    front.ranged_gets += 1
                    fault = front.faults.pop(0) if front.faults else None
                    if isinstance(fault, tuple):
                        status, code = fault
                        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>"
                        self._answer(status, {"Content-Type": "application/xml"}, body.encode())
                        return
                    if fault == "no-range":  # a server that ignores Range
                        self._answer(200, {}, b"0123456789")
                        return
                    if fault == "slow-body":  # the headers 0.1 s late, the body 0.2 s later
                        time.sleep(0.1)
                        self.send_response(206)
                        self.send_header("Content-Length", "4")
                        self.end_headers()
                        self.wfile.flush()
                        time.sleep(0.2)
                        self.wfile.write(b"3456")
                        return
                    if fault == "cut":
                        self.send_response(206)
                        self.send_header("Content-Length", "4")
                        self.end_headers()
                        self.wfile.write(b"xy")
                        self.close_connection = True
                        return
                self._forward()

            def do_PUT(self) -> None:
                self._forward()

            do_POST = do_HEAD = do_DELETE = do_PUT

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(front.upstream, timeout=10)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                hop_by_hop = ("transfer-encoding", "connection", "keep-alive")
                headers = {k: v for k, v in resp.getheaders() if k.lower() not in hop_by_hop}
                headers["Content-Length"] = str(len(data))
                self._answer(resp.status, headers, data)

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("server", "date"):
                        self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        self.server = Server(("127.0.0.1", 0), Handler).start("s3")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def front(endpoint: str) -> Iterator[FaultyFront]:
    f = FaultyFront(endpoint)
    yield f
    f.stop()


@pytest.fixture
def faulty(front: FaultyFront) -> S3Origin:
    """An origin whose every request goes through ``front``."""
    settings = S3Settings(
        endpoint_url=front.endpoint, region="us-east-1", access_key_id="k", secret_access_key="s"
    )
    client = make_client(settings)
    bucket = f"weights-{next(_buckets)}"
    client.create_bucket(Bucket=bucket)
    origin = S3Origin(client, S3Location(bucket, "models/llama/"), retry=QUICK_RETRY)
    origin.put_bytes("w.bin", b"0123456789")
    return origin


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
    assert published.version == 2 and published.piece_layer_path
    assert origin.read_manifest().digest == published.digest
    # the piece layer went up next to the weights, and is not listed as one
    pieces = origin.read_bytes(published.piece_layer_path)
    assert PieceLayer(published, pieces).raw == pieces
    assert sorted(p for p, _ in origin.list_files()) == ["model.safetensors", "sub/tokenizer.json"]
    from_s3 = build_manifest(origin, chunk_size=1 * MiB, workers=2)
    assert from_s3.digest == build_manifest(LocalFolder(weights), chunk_size=1 * MiB).digest
    assert from_s3.digest == published.digest
    data = (weights / "model.safetensors").read_bytes()
    assert origin.read_range("model.safetensors", 3 * MiB, 100) == data[3 * MiB : 3 * MiB + 100]
    # Read in steps, each reported as it lands (for pieces to be verified as they arrive).
    piece = data[MiB // 2 : MiB // 2 + 2 * MiB + 7]
    got = bytearray(len(piece))
    landed: list[int] = []
    origin.read_range_into("model.safetensors", MiB // 2, memoryview(got), landed.append)
    assert got == piece
    assert landed == sorted(landed) and landed[-1] == len(piece) and len(landed) >= 3
    # A caller may ask for a smaller step (one piece): never more than that lands at once.
    stepped: list[int] = []
    view = memoryview(got)
    origin.read_range_into("model.safetensors", MiB // 2, view, stepped.append, 256 * KiB)
    steps = [b - a for a, b in zip([0, *stepped], stepped, strict=False)]
    assert got == piece and stepped[-1] == len(piece)
    assert max(steps) <= 256 * KiB and len(stepped) >= len(piece) // (256 * KiB)
    with pytest.raises(ValueError, match="read step"):
        origin.read_range_into("model.safetensors", 0, memoryview(got), stepped.append, 0)


def test_slowdown_is_retried(faulty: S3Origin, front: FaultyFront) -> None:
    front.faults = [(503, "SlowDown")] * 3
    assert faulty.read_range("w.bin", 2, 4) == b"2345"
    assert front.ranged_gets == 4


@pytest.mark.parametrize(("status", "code"), [(403, "AccessDenied"), (404, "NoSuchKey")])
def test_client_errors_are_not_retried(
    faulty: S3Origin, front: FaultyFront, status: int, code: str
) -> None:
    front.faults = [(status, code)] * 100
    with pytest.raises(ClientError, match=code) as raised:
        faulty.read_range("w.bin", 0, 4)
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert front.ranged_gets == 1


def test_retries_give_up_after_the_policy(faulty: S3Origin, front: FaultyFront) -> None:
    front.faults = [(500, "InternalError")] * 100
    with pytest.raises(ClientError, match="InternalError"):
        faulty.read_range("w.bin", 0, 4)
    assert front.ranged_gets == QUICK_RETRY.attempts


def test_a_body_cut_short_is_retried_on_a_fresh_connection(
    faulty: S3Origin, front: FaultyFront
) -> None:
    front.faults = ["cut", "cut"]
    assert faulty.read_range("w.bin", 3, 4) == b"3456"
    assert front.ranged_gets == 3


def test_a_body_cut_short_resumes_where_it_stopped_when_bytes_are_reported(
    faulty: S3Origin, front: FaultyFront
) -> None:
    # Bytes already reported may be verified and served on: they are never written again.
    front.faults = ["cut"]
    view = memoryview(bytearray(4))
    landed: list[int] = []
    faulty.read_range_into("w.bin", 3, view, landed.append)
    assert bytes(view) == b"xy56"  # the cut answer's 2 bytes stay; the retry asked from 5
    assert landed == [2, 4] and front.ranged_gets == 2


def test_an_answer_of_the_wrong_length_is_never_read_as_the_chunk(
    faulty: S3Origin, front: FaultyFront
) -> None:
    front.faults = ["no-range"] * 100
    with pytest.raises(OriginConnectionError, match="asked for 4 bytes at 2, the answer has 10"):
        faulty.read_range("w.bin", 2, 4)
    assert front.ranged_gets == QUICK_RETRY.attempts
    front.faults = []
    assert faulty.read_range("w.bin", 2, 4) == b"2345"


def test_chunk_gets_reuse_one_connection_per_thread(faulty: S3Origin, front: FaultyFront) -> None:
    before = front.connections
    for i in range(10):
        assert faulty.read_range("w.bin", i, 1) == str(i).encode()
    assert front.connections - before == 1
    with pytest.raises(ClientError, match="InvalidRange"):  # past the end: 416, not retried
        faulty.read_range("w.bin", 20, 4)


def test_a_renewed_connection_is_a_new_one_and_then_reused(
    faulty: S3Origin, front: FaultyFront
) -> None:
    assert faulty.read_range("w.bin", 0, 1) == b"0"
    before = front.connections
    faulty.renew_connection()
    for i in range(1, 4):
        assert faulty.read_range("w.bin", i, 1) == str(i).encode()
    assert front.connections - before == 1


def test_last_read_times_this_threads_first_byte_and_the_rest(
    faulty: S3Origin, front: FaultyFront
) -> None:
    front.faults = ["slow-body"]
    assert faulty.read_range("w.bin", 3, 4) == b"3456"
    timing = faulty.last_read()
    assert timing is not None
    first_byte_s, rest_s = timing
    assert first_byte_s >= 0.09 and rest_s >= 0.15  # (the clocks differ a little)
    elsewhere: list[object] = []
    reader = threading.Thread(target=lambda: elsewhere.append(faulty.last_read()))
    reader.start()
    reader.join()
    assert elsewhere == [None]  # that thread read nothing


def test_presigned_urls_are_never_in_error_messages(faulty: S3Origin, front: FaultyFront) -> None:
    front.faults = ["cut"] * 100
    with pytest.raises(Exception) as raised:
        faulty.read_range("w.bin", 0, 4)
    text = "".join(traceback.format_exception(raised.value))
    assert "X-Amz-Signature" not in text and "X-Amz-Credential" not in text


def test_stage_from_s3(origin: S3Origin, weights: Path, tmp_path: Path) -> None:
    publish(weights, origin, chunk_size=1 * MiB)
    manifest = origin.read_manifest()
    store = ChunkStore(tmp_path / "cache")
    dp = DataPlaneMetrics.create(CollectorRegistry())
    result = stage(manifest, store, origin, [], node="n1", metrics=dp)
    assert result.from_origin == manifest.total_size
    for f in manifest.files:
        assert (result.path / f.path).read_bytes() == (weights / f.path).read_bytes()


def test_stage_from_s3_never_keeps_bytes_that_changed_since_the_manifest(
    origin: S3Origin, weights: Path, tmp_path: Path
) -> None:
    publish(weights, origin, chunk_size=1 * MiB)
    manifest = origin.read_manifest()
    changed = bytearray((weights / "model.safetensors").read_bytes())
    changed[3 * MiB + 7] ^= 0xFF  # one byte of the fourth chunk
    origin.put_bytes("model.safetensors", bytes(changed))
    store = ChunkStore(tmp_path / "cache")
    dp = DataPlaneMetrics.create(CollectorRegistry())
    with pytest.raises(ChunkVerificationError, match="chunk 3 "):
        stage(manifest, store, origin, [], node="n1", metrics=dp, workers=1)
    assert not store.is_staged(manifest.digest)
    assert not (store.files_dir(manifest.digest) / "model.safetensors").exists()
    bad = next(c for c in manifest.chunks if c.file == "model.safetensors" and c.index == 3)
    assert not store.has_chunk(bad.key)
    journal = (store.model_dir(manifest.digest) / "journal").read_text().split()
    assert str(manifest.chunks.index(bad)) not in journal


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


TOKEN = "FwoGZXIvYXdzEXAMPLEsessionTOKEN/with+slashes=="
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def test_credentials_from_a_secret_are_trimmed_and_never_printed(endpoint: str) -> None:
    data = {
        "AWS_ACCESS_KEY_ID": " AKIDEXAMPLE\n",
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY + "\r\n",
        "AWS_SESSION_TOKEN": TOKEN + "\n",  # kubectl create secret --from-file keeps it
    }
    settings = S3Settings.from_secret(endpoint, "us-east-1", data)
    assert settings.access_key_id == "AKIDEXAMPLE"
    assert settings.session_token == TOKEN and settings.secret_access_key == SECRET_KEY
    assert (
        S3Settings.from_secret(endpoint, None, {"AWS_SESSION_TOKEN": " \n"}).session_token is None
    )
    for text in (repr(settings), str(settings)):
        assert TOKEN not in text and SECRET_KEY not in text and "AKIDEXAMPLE" not in text
    # The trimmed token is sent as is: moto answers (the bucket is missing), no header error.
    origin = S3Origin(make_client(settings), S3Location("missing", ""), retry=QUICK_RETRY)
    with pytest.raises(ClientError, match="NoSuchBucket"):
        origin.read_manifest()


@pytest.mark.parametrize("read", ["manifest", "chunk"])
def test_botocore_errors_quoting_a_token_are_scrubbed(endpoint: str, read: str) -> None:
    """A token with a trailing newline reaching botocore (settings made by hand, or a
    Secret read by older code) makes it raise HTTPClientError quoting the token; nothing
    an S3Origin raises may show it, in its text or its traceback."""
    settings = S3Settings(
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id="AKIDEXAMPLE",
        secret_access_key=SECRET_KEY,
        session_token=TOKEN + "\n",
    )
    origin = S3Origin(make_client(settings), S3Location("b", "p/"), retry=QUICK_RETRY)
    with pytest.raises(Exception) as raised:
        if read == "manifest":
            origin.read_manifest()
        else:
            origin.read_range("w.bin", 0, 4)
    text = "".join(traceback.format_exception(raised.value))
    assert TOKEN not in text and TOKEN.replace("/", "%2F") not in text
    assert SECRET_KEY not in text
    assert len(str(raised.value)) <= 1024


def test_error_text_redacts_every_form_of_a_secret_and_caps_length() -> None:
    from weightship.errortext import REDACTED, error_text

    secret = TOKEN + "\n"
    forms = [secret, TOKEN, repr(secret), "X-Amz-Security-Token=" + TOKEN.replace("/", "%2F")]
    exc = ValueError("Invalid header value b'" + TOKEN + "\\n' then " + " / ".join(forms))
    text = error_text(exc, [secret])
    assert TOKEN not in text and "FwoGZXIv" not in text and REDACTED in text
    signed = "GET /b/k?X-Amz-Credential=AKID%2F2026&X-Amz-Signature=abcdef0123 HTTP/1.1"
    assert "abcdef0123" not in error_text(ValueError(signed))
    assert "AKID" not in error_text(ValueError(signed))
    assert len(error_text(ValueError("x" * 10_000_000))) == 1024


def test_an_oversized_manifest_object_is_refused_before_its_body_is_read(
    origin: S3Origin, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightship.data.s3 as s3

    monkeypatch.setattr(s3, "MAX_MANIFEST_BYTES", 1000)
    origin.put_bytes(MANIFEST_NAME, b" " * 1001)
    with pytest.raises(ManifestError, match="over the 1000 bytes"):
        origin.read_manifest()
