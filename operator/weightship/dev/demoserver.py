"""The demo fleet's stand-in model server (`python -m weightship.dev.demoserver`).

At start it stages its weights from S3 (WEIGHTSHIP_MODEL_URI) into a scratch directory
with the project's verified data path: every chunk is checked against the manifest, so a
corrupt model never loads. Then it serves /healthz, / (what it loaded) and /metrics. A
model that fails verification makes it exit non-zero: the pod never turns Ready, and
the rollout's progress deadline rolls the canary back.
(The reference inference server with golden prompts replaces this in a later issue.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from weightship.data.chunkstore import ChunkStore
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.s3 import S3Location, S3Origin, S3Settings, make_client
from weightship.data.stage import stage
from weightship.dev.echoserver import Handler, Server


def load_weights() -> dict[str, str]:
    uri = os.environ["WEIGHTSHIP_MODEL_URI"]
    want = os.environ["WEIGHTSHIP_MANIFEST_DIGEST"]
    client = make_client(
        S3Settings(
            endpoint_url=os.environ.get("WEIGHTSHIP_S3_ENDPOINT"),
            region="us-east-1",
            access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
        )
    )
    origin = S3Origin(client, S3Location.parse(uri))
    manifest = origin.read_manifest()
    if manifest.digest != want:
        raise SystemExit(f"manifest at {uri} is {manifest.digest}, the rollout wants {want}")
    store = ChunkStore(Path(os.environ.get("SCRATCH_DIR", "/tmp")) / "weights")
    result = stage(
        manifest,
        store,
        origin,
        [],
        node=os.environ.get("NODE_NAME", "local"),
        metrics=DataPlaneMetrics.create(CollectorRegistry()),
    )
    return {
        "digest": manifest.digest,
        "bytes": str(result.total_bytes),
        "revision": os.environ.get("WEIGHTSHIP_MODEL_REVISION", ""),
    }


def main() -> None:
    try:
        loaded = load_weights()
    except Exception as e:
        print(f"refusing to serve: weights failed verification: {e}", file=sys.stderr)
        sys.exit(3)
    print(f"loaded and verified {json.dumps(loaded)}", flush=True)
    os.environ["ECHO_MESSAGE"] = json.dumps(loaded)
    Server(("0.0.0.0", int(os.environ.get("ECHO_PORT", "8080"))), Handler).serve_forever()  # noqa: S104


if __name__ == "__main__":
    main()
