"""Shared parts of the data-plane benchmarks: a cached random model, a real S3 server
(versitygw) and its published copy of the model, and small timing helpers.

Everything lives under WSBENCH_DIR (default /var/tmp/wsbench) and is reused across runs:
the model is generated once per size and uploaded once.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from botocore.exceptions import ClientError

from weightship.data.s3 import S3Location, S3Origin, S3Settings, make_client, publish
from weightship.weightformat.build import LocalFolder, build_manifest_with_pieces
from weightship.weightformat.manifest import Manifest

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

MiB = 1 << 20
WORK = Path(os.environ.get("WSBENCH_DIR", "/var/tmp/wsbench"))
S3_ROOT = WORK / "s3"
VERSITYGW = Path(os.environ.get("WSBENCH_VERSITYGW", "~/.cache/weightship/bin/versitygw"))
ACCESS_KEY, SECRET_KEY, REGION = "wsbench", "wsbench-secret-key", "us-east-1"
BUCKET = "wsbench"
PUBLISH_CHUNK = 16 * MiB
SERVER_PIDS: dict[str, int] = {}  # endpoint URL -> pid of the versitygw serving it


def versitygw_path() -> Path:
    return VERSITYGW.expanduser()


def settings(endpoint: str, connections: int = 32) -> S3Settings:
    return S3Settings(
        endpoint_url=endpoint,
        region=REGION,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        max_connections=connections,
    )


def make_model(total_bytes: int, files: int = 4) -> Path:
    """A folder of ``files`` shards of random bytes totalling ``total_bytes``, made once."""
    folder = WORK / f"model-{total_bytes}"
    done = WORK / f"model-{total_bytes}.complete"  # outside the folder: not a model file
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(total_bytes)
    sizes = [total_bytes // files] * files
    sizes[-1] += total_bytes - sum(sizes)
    for i, size in enumerate(sizes, 1):
        with open(folder / f"model-{i:05d}-of-{files:05d}.safetensors", "wb") as f:
            for off in range(0, size, 16 * MiB):
                f.write(rng.randbytes(min(16 * MiB, size - off)))
    done.touch()
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def netns_prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def wait_tcp(host: str, port: int, *, netns: str | None = None, timeout_s: float = 20) -> None:
    """Wait (bounded) until something accepts connections on host:port."""
    probe = [*netns_prefix(netns), "bash", "-c", f"exec 3<>/dev/tcp/{host}/{port}"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if subprocess.run(probe, capture_output=True, timeout=10).returncode == 0:
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


@contextmanager
def versitygw(host: str, port: int, *, netns: str | None = None) -> Iterator[str]:
    """Run versitygw (posix backend over S3_ROOT) on host:port; yield its endpoint URL."""
    binary = versitygw_path()
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} not found: run hack/deps.sh")
    S3_ROOT.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ROOT_ACCESS_KEY": ACCESS_KEY, "ROOT_SECRET_KEY": SECRET_KEY}
    cmd = [str(binary), "--port", f"{host}:{port}", "--quiet", "--keep-alive"]
    with open(WORK / "versitygw.log", "ab") as log:
        proc = subprocess.Popen(
            [*netns_prefix(netns), *cmd, "posix", str(S3_ROOT)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://{host}:{port}"
    SERVER_PIDS[endpoint] = proc.pid  # `ip netns exec` execs: the pid is versitygw's
    try:
        wait_tcp(host, port, netns=netns)
        yield endpoint
    finally:
        SERVER_PIDS.pop(endpoint, None)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def model_location(model: Path) -> S3Location:
    return S3Location(BUCKET, model.name + "/")


def ensure_published(client: S3Client, model: Path) -> None:
    """Upload ``model`` (files, then manifest) unless an earlier run already did."""
    with suppress(ClientError):  # already exists
        client.create_bucket(Bucket=BUCKET)
    marker = WORK / f"{model.name}.published"
    if marker.exists():
        return
    publish(model, S3Origin(client, model_location(model)), chunk_size=PUBLISH_CHUNK, workers=4)
    marker.touch()


def manifest_path(
    model: Path, chunk_size: int, version: int = 2, piece_size: int | None = None
) -> Path:
    pieces = f".p{piece_size}" if piece_size else ""  # None: the format's default
    return WORK / f"{model.name}.c{chunk_size}{pieces}.v{version}.json"


def manifest_for(
    model: Path, chunk_size: int, version: Literal[1, 2] = 2, piece_size: int | None = None
) -> Manifest:
    """The manifest of ``model`` at ``chunk_size`` (and ``piece_size``, None: the format's
    default), cached, with its piece layer (version 2) beside it; ``local_origin`` puts
    the piece layers on the S3 server. The bytes are the ones the S3 server holds, so
    staging may use any chunk size without uploading the weights again."""
    cached = manifest_path(model, chunk_size, version, piece_size)
    if cached.exists():
        return Manifest.parse(cached.read_bytes())
    manifest, pieces = build_manifest_with_pieces(
        LocalFolder(model), chunk_size=chunk_size, workers=2, version=version, piece_size=piece_size
    )
    if manifest.piece_layer_path:
        cached.with_suffix(".pieces").write_bytes(pieces)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(manifest.canonical_bytes())
    tmp.replace(cached)
    return manifest


def upload_piece_layers(client: S3Client, model: Path) -> None:
    """Put every cached manifest's piece layer of ``model`` on the S3 server (once)."""
    for cached in WORK.glob(f"{model.name}.c*.v2.json"):
        manifest = Manifest.parse(cached.read_bytes())
        path, pieces = manifest.piece_layer_path, cached.with_suffix(".pieces")
        if path is None or not pieces.exists():
            continue
        key = model_location(model).key(path)
        try:
            client.head_object(Bucket=BUCKET, Key=key)
        except ClientError:
            client.put_object(Bucket=BUCKET, Key=key, Body=pieces.read_bytes())


@contextmanager
def local_origin(model: Path) -> Iterator[tuple[str, S3Client]]:
    """versitygw on loopback with ``model`` published; yields (endpoint, client)."""
    with versitygw("127.0.0.1", free_port()) as endpoint:
        client = make_client(settings(endpoint))
        ensure_published(client, model)
        upload_piece_layers(client, model)
        yield endpoint, client


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MiB):
            h.update(block)
    return h.hexdigest()


def verify_files(folder: Path, manifest: Manifest, threads: int = 2) -> list[str]:
    """Paths under ``folder`` whose sha256 differs from the manifest (hashed in parallel)."""

    def bad(entry_path: str, want: str) -> str | None:
        p = folder / entry_path
        return None if p.is_file() and sha256_file(p) == want else entry_path

    with ThreadPoolExecutor(threads) as pool:
        found = pool.map(lambda f: bad(f.path, f.sha256), manifest.files)
        return [p for p in found if p]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


T = TypeVar("T")


def median_of(runs: list[T], seconds: Callable[[T], float]) -> T:
    """The run with the median time (the lower one of an even count): a real run, so its
    other figures (CPU) are that run's, not a mix."""
    return sorted(runs, key=seconds)[(len(runs) - 1) // 2]


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, columns padded for the terminal."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def settle(below: float, max_s: float) -> float:
    """Wait, ``max_s`` at most, for the 1-minute load average to fall below ``below`` (the
    last round's node processes push it to 3-11 on 2 cores, and load slows some modes more
    than others); return the load average the round starts at."""
    deadline = time.monotonic() + max_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]
