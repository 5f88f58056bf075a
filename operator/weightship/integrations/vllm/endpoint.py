"""The `weightship` endpoint plugin: routes on vLLM's own API server port.

GET  /weightship/v1/loaded        what every rank loaded (core.verification.LoadReport)
POST /weightship/v1/seed/join     forwarded to this replica's seed root, if it is one
GET  /weightship/v1/seed/status   the broadcasts it ran as a root
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State

from weightship.seeding.endpoints import handle_join, handle_status
from weightship.seeding.protocol import JOIN_PATH, STATUS_PATH

from .loader import SEED_PORT_FILE
from .reports import merge, read_rank_reports
from .settings import RUN_DIR_ENV

LOADED_PATH = "/weightship/v1/loaded"
MAX_JOIN_BYTES = 64 * 1024
FORWARD_TIMEOUT_S = 30.0


def run_dir() -> Path:
    return Path(os.environ.get(RUN_DIR_ENV) or f"/tmp/weightship-vllm-{os.getpid()}")


def loaded_document(folder: Path) -> dict[str, Any]:
    reports = read_rank_reports(folder)
    doc = merge(reports).to_json()
    doc["ranks"] = [r.to_json() for r in sorted(reports, key=lambda r: r.rank)]
    return doc


def forward(folder: Path, method: str, path: str, body: bytes | None) -> tuple[int, dict[str, Any]]:
    """To the worker's loopback seed server; a replica that is no root says so (409)."""
    try:
        port = int((folder / SEED_PORT_FILE).read_text())
    except (OSError, ValueError):
        return handle_join(None, b"") if method == "POST" else handle_status(None)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=FORWARD_TIMEOUT_S) as response:  # noqa: S310
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except (OSError, ValueError) as err:
        return 503, {"accepted": False, "reason": "RootUnavailable", "message": str(err)}


async def loaded() -> JSONResponse:
    return JSONResponse(loaded_document(run_dir()))


async def join(request: Request) -> JSONResponse:
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_JOIN_BYTES:
            return JSONResponse({"accepted": False, "reason": "BadRequest"}, 413)
    status, doc = await asyncio.to_thread(forward, run_dir(), "POST", JOIN_PATH, body)
    return JSONResponse(doc, status)


async def seed_status() -> JSONResponse:
    status, doc = await asyncio.to_thread(forward, run_dir(), "GET", STATUS_PATH, None)
    return JSONResponse(doc, status)


class WeightshipEndpoints:
    name = "weightship"
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route(LOADED_PATH, loaded, methods=["GET"])
        app.add_api_route(JOIN_PATH, join, methods=["POST"])
        app.add_api_route(STATUS_PATH, seed_status, methods=["GET"])

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        """No per-app state: the ranks' reports are files in the run directory."""


def endpoint_plugin() -> WeightshipEndpoints:
    return WeightshipEndpoints()
