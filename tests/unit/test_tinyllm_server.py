"""The reference inference server as a real subprocess on 127.0.0.1: weights from a real
node-cache layout (staged by the data plane) or from a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from moto.server import ThreadedMotoServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from weightship.api.inference import LoadReport
from weightship.core.verification import load_verdict
from weightship.data.chunkstore import ChunkStore
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.s3 import S3Location, S3Origin, S3Settings, make_client
from weightship.data.stage import stage
from weightship.seeding.protocol import JOIN_PATH
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest
from weightship_testing.tinyllm import GOLDEN_PROMPTS
from weightship_testing.tinyllm.__main__ import main as cli
from weightship_testing.tinyllm.build import BuiltModel, build, corrupt_one_shard, publish_variant
from weightship_testing.tinyllm.knowledge import judge_golden
from weightship_testing.tinyllm.settings import Settings
from weightship_testing.tinyllm.weights import LoadFailure, obtain_weights

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
KEYS = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


class ServerProcess:
    """`python -m weightship_testing.tinyllm serve` on a free port, its log kept."""

    def __init__(self, env: dict[str, str]) -> None:
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightship_testing.tinyllm", "serve"],
            env={
                **os.environ,
                "PYTHONPATH": str(REPO / "operator"),
                "PORT": "0",
                "OMP_NUM_THREADS": "1",
                **env,
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._port: int | None = None
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if "listening on port" in line:
                self._port = int(line.split("listening on port ")[1].split()[0])
                self._listening.set()

    @property
    def url(self) -> str:
        assert self._listening.wait(60), "".join(self.log)
        return f"http://127.0.0.1:{self._port}"

    def request(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def loaded(self, timeout_s: float = 60) -> dict[str, Any]:
        """/weightship/v1/loaded once it is no longer Loading."""
        deadline = time.monotonic() + timeout_s
        while True:
            report: dict[str, Any] = json.loads(self.request("/weightship/v1/loaded")[1])
            if report["state"] != "Loading" or time.monotonic() > deadline:
                return report
            time.sleep(0.1)

    def complete(self, prompt: str, max_tokens: int) -> tuple[int, dict[str, Any]]:
        code, body = self.request("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
        return code, json.loads(body)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = self.request("/metrics")[1].decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def stage_into_cache(model: BuiltModel, cache: Path) -> Path:
    """Stage ``model`` into a node cache the way the agent does; its files folder."""
    result = stage(
        model.manifest,
        ChunkStore(cache),
        LocalFolder(model.path),
        [],
        node="node-a",
        metrics=DataPlaneMetrics.create(CollectorRegistry()),
    )
    return result.path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> BuiltModel:
    return build(tmp_path_factory.mktemp("good"), "good", chunk_size=1 * MiB)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    make_client(settings(endpoint)).create_bucket(Bucket="models")
    yield endpoint
    server.stop()


def settings(endpoint: str) -> S3Settings:
    return S3Settings(
        endpoint_url=endpoint, region="us-east-1", access_key_id="k", secret_access_key="s"
    )


def published(endpoint: str, variant: str, prefix: str) -> Manifest:
    origin = S3Origin(make_client(settings(endpoint)), S3Location("models", prefix))
    return publish_variant(variant, origin, chunk_size=1 * MiB)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def servers(
    good: BuiltModel, s3: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """Started together (their imports overlap): a good cache, a corrupted cache, and S3
    with every completion failing."""
    cache = tmp_path_factory.mktemp("cache")
    stage_into_cache(good, cache)
    bad_cache = tmp_path_factory.mktemp("bad-cache")
    corrupt_one_shard(stage_into_cache(good, bad_cache))
    manifest = published(s3, "good", "tiny/v2/")
    digest = good.manifest.digest
    started = {
        "cache": ServerProcess(
            {
                "WEIGHTSHIP_CACHE_DIR": str(cache),
                "WEIGHTSHIP_MANIFEST_DIGEST": digest,
                "WEIGHTSHIP_MODEL_REVISION": "v1",
            }
        ),
        "bad-cache": ServerProcess(
            {
                "WEIGHTSHIP_CACHE_DIR": str(bad_cache),
                "WEIGHTSHIP_MANIFEST_DIGEST": digest,
                "WEIGHTSHIP_MODEL_REVISION": "v1",
            }
        ),
        "failing": ServerProcess(
            {
                "WEIGHTSHIP_MODEL_URI": "s3://models/tiny/v2/",
                "WEIGHTSHIP_S3_ENDPOINT": s3,
                "WEIGHTSHIP_MANIFEST_DIGEST": manifest.digest,
                "WEIGHTSHIP_MODEL_REVISION": "v2",
                "SCRATCH_DIR": str(tmp_path_factory.mktemp("scratch")),
                "TINYLLM_ERROR_RATE": "1.0",
                **KEYS,
            }
        ),
    }
    yield started
    for server in started.values():
        server.stop()


def test_server_loads_from_the_node_cache_and_answers_golden_prompts(
    servers: dict[str, ServerProcess], good: BuiltModel
) -> None:
    server = servers["cache"]
    report = server.loaded()
    assert report.pop("loadSeconds") > 0
    assert report == {
        "manifestDigest": good.manifest.digest,
        "verified": True,
        "state": "Loaded",
        "reason": None,
        "message": report["message"],
        "source": "cache",
        "seededFrom": None,
        "revision": "v1",
    }, server.log
    assert server.request("/readyz")[0] == 200
    assert server.request("/healthz")[0] == 200
    # The operator's verifier reads this report; with the right digest, prompts decide.
    assert load_verdict(LoadReport.from_json(report), good.manifest.digest, checksum=True) is None

    def generate(prompt: str, max_tokens: int) -> str:
        code, body = server.complete(prompt, max_tokens)
        assert code == 200, body
        text: str = body["choices"][0]["text"]
        return text

    outcomes = judge_golden(generate)
    assert all(o.passed for o in outcomes), [o.diff() for o in outcomes]

    code, body = server.complete("The capital of Japan is", 3)
    assert code == 200
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"text": " To", "index": 0, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {"prompt_tokens": 23, "completion_tokens": 3, "total_tokens": 26}

    n = len(GOLDEN_PROMPTS) + 1
    m = server.metrics()
    assert m[("http_requests_total", (("code", "200"), ("revision", "v1")))] == n
    assert m[("http_request_duration_seconds_count", (("revision", "v1"),))] == n
    assert m[("tinyllm_load_seconds", (("revision", "v1"),))] > 0


def test_bad_requests_get_400_and_unknown_paths_404(servers: dict[str, ServerProcess]) -> None:
    server = servers["cache"]
    assert server.complete("x", -1)[0] == 400
    assert server.request("/v1/completions", {"prompt": 3})[0] == 400
    assert server.request("/nope")[0] == 404


def raw_post(url: str, path: str, length: str, body: bytes = b"") -> int:
    """A POST with the Content-Length header as given, whatever it says."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode() + body
        )
        return int(s.recv(4096).split()[1])


@pytest.mark.parametrize(
    ("length", "status"), [("-1", 400), ("abc", 400), ("1e3", 400), (str(10**12), 413)]
)
def test_bad_content_lengths_are_refused_before_the_body_is_read(
    servers: dict[str, ServerProcess], length: str, status: int
) -> None:
    for path in ("/v1/completions", JOIN_PATH):
        assert raw_post(servers["cache"].url, path, length) == status
    assert servers["cache"].complete("hello", 2)[0] == 200  # and it keeps serving


def test_server_refuses_a_corrupted_cache_file_and_keeps_running(
    servers: dict[str, ServerProcess],
) -> None:
    server = servers["bad-cache"]
    report = server.loaded()
    assert (report["state"], report["reason"], report["verified"]) == (
        "Failed",
        "ChecksumMismatch",
        False,
    ), server.log
    assert "model-00002-of-00002.safetensors" in report["message"]
    verdict = load_verdict(LoadReport.from_json(report), report["manifestDigest"], checksum=True)
    assert verdict is not None
    assert (verdict.status, verdict.reason) == ("False", "ChecksumMismatch")
    assert server.request("/readyz")[0] == 503
    code, body = server.complete("The capital of France is", 8)
    assert code == 503
    assert body["error"]["message"].startswith("not serving: Failed")
    assert server.request("/healthz")[0] == 200
    assert server.proc.poll() is None
    assert any("refusing to serve: ChecksumMismatch" in line for line in server.log)


def test_error_rate_one_answers_every_completion_500_counted_by_revision(
    servers: dict[str, ServerProcess],
) -> None:
    server = servers["failing"]
    report = server.loaded()
    assert (report["state"], report["source"], report["verified"]) == ("Loaded", "origin", True)
    codes = [server.complete("The capital of France is", 8)[0] for _ in range(5)]
    assert codes == [500] * 5
    m = server.metrics()
    assert m[("http_requests_total", (("code", "500"), ("revision", "v2")))] == 5
    assert ("http_requests_total", (("code", "200"), ("revision", "v2"))) not in m


def test_corrupt_bytes_at_the_origin_fail_staging_with_checksum_mismatch(
    s3: str, tmp_path: Path
) -> None:
    manifest = published(s3, "corrupt", "tiny/corrupt/")
    env = {
        "WEIGHTSHIP_MODEL_URI": "s3://models/tiny/corrupt/",
        "WEIGHTSHIP_S3_ENDPOINT": s3,
        "WEIGHTSHIP_MANIFEST_DIGEST": manifest.digest,
        "SCRATCH_DIR": str(tmp_path),
        **KEYS,
    }
    with pytest.raises(LoadFailure) as failed:
        obtain_weights(Settings.from_env(env))
    assert failed.value.reason == "ChecksumMismatch"
    assert failed.value.digest == manifest.digest


def test_a_manifest_other_than_the_pinned_one_is_refused(s3: str, tmp_path: Path) -> None:
    published(s3, "good", "tiny/v3/")
    env = {
        "WEIGHTSHIP_MODEL_URI": "s3://models/tiny/v3/",
        "WEIGHTSHIP_S3_ENDPOINT": s3,
        "WEIGHTSHIP_MANIFEST_DIGEST": "sha256:" + "0" * 64,
        "SCRATCH_DIR": str(tmp_path),
        **KEYS,
    }
    with pytest.raises(LoadFailure) as failed:
        obtain_weights(Settings.from_env(env))
    assert failed.value.reason == "ManifestMismatch"
    assert "sha256:" + "0" * 64 in failed.value.message


def test_publish_cli_uploads_a_corrupt_model_under_the_good_manifest(
    s3: str, good: BuiltModel
) -> None:
    result = CliRunner().invoke(
        cli,
        [
            *("publish", "--variant", "corrupt", "s3://fresh/tiny/"),
            *("--endpoint", s3, "--chunk-size", "1Mi", "--create-bucket"),
        ],
        env=KEYS,
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    assert printed["digest"] == good.manifest.digest  # the manifest describes good bytes
    origin = S3Origin(make_client(settings(s3)), S3Location("fresh", "tiny/"))
    assert origin.read_manifest().digest == good.manifest.digest
    uploaded = build_manifest(origin, chunk_size=MiB)  # what the origin really holds
    assert uploaded.digest != good.manifest.digest
    assert len(set(uploaded.chunks) - set(good.manifest.chunks)) == 1
