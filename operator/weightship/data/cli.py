"""`weightship manifest`, `weightship publish` and `weightship verify-files`."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import click
from botocore.exceptions import BotoCoreError, ClientError
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from weightship.api.env import S3_ENDPOINT_ENV
from weightship.data.s3 import S3Location, S3Origin, S3Settings, make_client, publish
from weightship.weightformat.build import (
    ByteSource,
    LocalFolder,
    ProgressFn,
    build_manifest_with_pieces,
)
from weightship.weightformat.cachedir import MANIFEST_FILE, STAGED_MARKER
from weightship.weightformat.manifest import Manifest, ManifestError, digest_hex
from weightship.weightformat.paths import MANIFEST_NAME

_SIZE = re.compile(r"(\d+)\s*(|K|M|G|Ki|Mi|Gi)(?:B)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 2**10, "mi": 2**20, "gi": 2**30}

console = Console(stderr=True)


def parse_size(text: str) -> int:
    """'16Mi', '16MiB', '4M', '1048576' -> bytes."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r} (try 16Mi)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _size_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    if size <= 0:
        raise click.BadParameter("must be positive")
    return size


def _origin(uri: str, endpoint: str | None, region: str | None) -> S3Origin:
    settings = S3Settings(endpoint_url=endpoint, region=region)
    return S3Origin(make_client(settings), S3Location.parse(uri))


@contextmanager
def _progress(*tasks: tuple[str, int]) -> Iterator[list[ProgressFn]]:
    """One live display (rich allows only one) with a bar per (label, total byte count)."""
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        ids = [bar.add_task(label, total=total) for label, total in tasks]
        yield [functools.partial(bar.advance, task) for task in ids]


@contextmanager
def _clear_errors() -> Iterator[None]:
    try:
        yield
    except (ManifestError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    except (ClientError, BotoCoreError) as exc:
        raise click.ClickException(f"S3: {exc}") from exc


_endpoint = click.option(
    "--endpoint", envvar=S3_ENDPOINT_ENV, help="S3 endpoint URL (MinIO, versitygw)."
)
_region = click.option("--region", envvar="AWS_REGION", help="S3 region.")
_chunk_size = click.option(
    "--chunk-size",
    default="16Mi",
    show_default=True,
    callback=_size_option,
    help="Chunk size; 4Mi-16Mi suits S3 ranged GETs.",
)
_workers = click.option("--workers", default=8, show_default=True, help="Parallel transfers.")


@click.command("manifest")
@click.argument("source")
@click.option("--write", is_flag=True, help=f"Write {MANIFEST_NAME} beside the weights.")
@_endpoint
@_region
@_chunk_size
@_workers
def manifest_command(
    source: str,
    write: bool,
    endpoint: str | None,
    region: str | None,
    chunk_size: int,
    workers: int,
) -> None:
    """Hash the weights at SOURCE (s3://bucket/prefix/ or a folder) into a manifest.

    Prints the manifest unless --write is given; the digest always goes to stderr. A
    version 2 manifest names its piece layer, which --write puts beside it (a printed
    manifest stages only once that is there too).
    """
    with _clear_errors():
        origin = _origin(source, endpoint, region) if source.startswith("s3://") else None
        folder = None if origin else Path(source)
        if folder and not folder.is_dir():
            raise click.ClickException(f"{source} is neither s3://… nor a folder")
        reader: ByteSource = origin or LocalFolder(Path(source))
        total = sum(size for _, size in reader.list_files())
        with _progress(("hashing", total)) as (advance,):
            manifest, pieces = build_manifest_with_pieces(
                reader,
                chunk_size=chunk_size,
                workers=workers,
                created_at=datetime.now(UTC),
                on_bytes=advance,
            )
        if write and origin:
            origin.write_manifest(manifest, pieces)  # the piece layer first
            console.print(f"wrote {origin.location}{MANIFEST_NAME}")
        elif write and folder:
            if manifest.piece_layer_path:
                layer = folder / manifest.piece_layer_path
                layer.parent.mkdir(exist_ok=True)
                layer.write_bytes(pieces)
            tmp = folder / f".{MANIFEST_NAME}.tmp"
            tmp.write_bytes(manifest.canonical_bytes())
            tmp.replace(folder / MANIFEST_NAME)
            console.print(f"wrote {folder / MANIFEST_NAME}")
        else:
            click.echo(manifest.canonical_bytes().decode())
        console.print(
            f"{len(manifest.files)} files, {len(manifest.chunks)} chunks, "
            f"{manifest.total_size} bytes, digest {manifest.digest}"
        )


@click.command("publish")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("destination")
@_endpoint
@_region
@_chunk_size
@_workers
def publish_command(
    folder: Path,
    destination: str,
    endpoint: str | None,
    region: str | None,
    chunk_size: int,
    workers: int,
) -> None:
    """Upload FOLDER to DESTINATION (s3://bucket/prefix/), then its manifest."""
    with _clear_errors():
        origin = _origin(destination, endpoint, region)
        total = sum(size for _, size in LocalFolder(folder).list_files())
        with _progress(("hashing", total), ("uploading", total)) as (hashed, uploaded):
            manifest = publish(
                folder,
                origin,
                chunk_size=chunk_size,
                workers=workers,
                on_hashed=hashed,
                on_uploaded=uploaded,
            )
        console.print(f"published {manifest.total_size} bytes to {origin.location}")
        console.print(f"digest {manifest.digest}")


_HASH_BLOCK = 8 * 1024 * 1024


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def mismatched_files(folder: Path, manifest: Manifest, workers: int = 2) -> list[str]:
    """The manifest's files under ``folder`` that are missing or whose whole-file sha256
    (the one Hugging Face and most tools publish) differs from the manifest's."""

    def bad(path: str, size: int, want: str) -> str | None:
        p = folder / path
        ok = p.is_file() and p.stat().st_size == size and file_sha256(p) == want
        return None if ok else path

    with ThreadPoolExecutor(max(1, workers)) as pool:
        found = pool.map(lambda f: bad(f.path, f.size, f.sha256), manifest.files)
        return [p for p in found if p]


@click.command("verify-files")
@click.argument("cache_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("digests", nargs=-1)
@_workers
def verify_files_command(cache_dir: Path, digests: tuple[str, ...], workers: int) -> None:
    """Check the staged files in a node cache (CACHE_DIR, the agent's cacheDir) against
    each file's sha256 in its manifest: every staged model, or the DIGESTS given
    (sha256:<hex>). Staging verified BLAKE3 chunk and piece digests; this re-reads every
    byte with the whole-file sha256s computed at publish time. Exits 1 on a mismatch."""
    with _clear_errors():
        models = cache_dir / "models"
        wanted = [digest_hex(d) for d in digests] or sorted(
            p.name for p in models.iterdir() if (p / STAGED_MARKER).is_file()
        )
        failed = False
        for hex_digest in wanted:
            mdir = models / hex_digest
            if not (mdir / STAGED_MARKER).is_file():
                console.print(f"sha256:{hex_digest}: not staged in {cache_dir}")
                failed = True
                continue
            manifest_file = mdir / MANIFEST_FILE
            manifest = Manifest.parse(manifest_file.read_bytes(), source=str(manifest_file))
            bad = mismatched_files(mdir / "files", manifest, workers)
            for path in bad:
                click.echo(f"sha256:{hex_digest}: {path} does not match its sha256")
            verdict = f"{len(bad)} of {len(manifest.files)} files bad" if bad else "all match"
            click.echo(f"sha256:{hex_digest}: {len(manifest.files)} files, {verdict}")
            failed = failed or bool(bad)
        if failed:
            raise SystemExit(1)
