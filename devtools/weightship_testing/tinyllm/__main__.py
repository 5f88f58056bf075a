"""`python -m weightship_testing.tinyllm build|publish|serve`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from weightship.data.cli import parse_size
from weightship.data.s3 import S3Location, S3Origin, S3Settings, make_client
from weightship_testing.tinyllm.knowledge import VARIANTS, Variant


def _bytes(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _model_size_or_tiny(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    return None if value == "tiny" else _bytes(ctx, param, value)


_variant = click.option("--variant", type=click.Choice(VARIANTS), default="good", show_default=True)
_model_size = click.option(
    "--size",
    default="tiny",
    show_default=True,
    callback=_model_size_or_tiny,
    help="About how big the weights are (e.g. 512Mi); tiny is about 12 MB.",
)
_chunk_size = click.option(
    "--chunk-size",
    default="16Mi",
    show_default=True,
    callback=_bytes,
    help="Manifest chunk size (e.g. 1Mi).",
)
_seed = click.option("--seed", default=0, show_default=True, help="Seed of the random blocks.")


@click.group()
def main() -> None:
    """The tiny reference model: build or publish a version, or serve one."""


@main.command("build")
@_variant
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@_model_size
@_chunk_size
@_seed
def build_command(
    variant: Variant, out: Path, size: int | None, chunk_size: int, seed: int
) -> None:
    """Write a model version and its weightship-manifest.json into OUT."""
    from weightship_testing.tinyllm.build import build

    built = build(out, variant, size=size, chunk_size=chunk_size, seed=seed)
    click.echo(json.dumps({"path": str(out), "variant": variant, "digest": built.manifest.digest}))


@main.command("publish")
@_variant
@click.argument("destination")
@click.option("--endpoint", envvar="WEIGHTSHIP_S3_ENDPOINT", help="S3 endpoint URL.")
@click.option("--region", envvar="AWS_REGION", default="us-east-1", show_default=True)
@click.option("--create-bucket", is_flag=True, help="Create the bucket if it is missing.")
@_model_size
@_chunk_size
@_seed
def publish_command(
    variant: Variant,
    destination: str,
    endpoint: str | None,
    region: str,
    create_bucket: bool,
    size: int | None,
    chunk_size: int,
    seed: int,
) -> None:
    """Upload a model version to DESTINATION (s3://bucket/prefix/), its manifest last.

    Credentials come from the usual AWS_* variables. Prints the manifest digest as JSON.
    """
    from weightship_testing.tinyllm.build import publish_variant

    location = S3Location.parse(destination)
    client = make_client(S3Settings(endpoint_url=endpoint, region=region))
    if create_bucket and location.bucket not in {
        b["Name"] for b in client.list_buckets().get("Buckets", [])
    }:
        client.create_bucket(Bucket=location.bucket)
    manifest = publish_variant(
        variant,
        S3Origin(client, location),
        size=size,
        chunk_size=chunk_size,
        seed=seed,
    )
    click.echo(json.dumps({"uri": str(location), "variant": variant, "digest": manifest.digest}))


@main.command("serve")
def serve_command() -> None:
    """Serve the model the environment names (see docs/tinyllm.md)."""
    from weightship_testing.tinyllm.server import main as serve_main

    serve_main()


if __name__ == "__main__":
    main()
