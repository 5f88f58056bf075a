"""The `weightship` endpoint plugin: routes on vLLM's own API server port.

GET  /weightship/v1/loaded        what every rank loaded (core.verification.LoadReport)
POST /weightship/v1/seed/join     forwarded to this replica's seed root, if it is one
GET  /weightship/v1/seed/status   the broadcasts it ran as a root
POST /weightship/v1/swap          swap verified weights in place (``swap``, ``swapdriver``)
GET  /weightship/v1/swap          the latest swap's state
POST /weightship/v1/swap/verified the verifier passed the swapped weights: traffic may have them

and a middleware that stamps every response with the weights that made it
(``X-Weightship-Revision``, ``X-Weightship-Manifest-Digest``) and holds requests while a
swap runs (``stamp``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.error
import urllib.request
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import State

from weightship.api.inference import (
    LOADED_PATH,
    MAX_SWAP_BODY,
    SWAP_PATH,
    VERIFIED_PATH,
    FailureReason,
    SwapAnswer,
    SwapRequest,
    SwapRequestError,
    parse_verified,
)
from weightship.integrations.serving import (
    Answer,
    Parsed,
    SwapAuth,
    SwapTracker,
    Weights,
    accepted,
    already_loaded,
    bad_request,
    busy,
    refused,
    verified_answer,
)
from weightship.seeding.endpoints import handle_join, handle_status
from weightship.seeding.protocol import JOIN_PATH, STATUS_PATH

from .reports import merge, read_rank_reports
from .roots import SEED_PORT_FILE
from .settings import RUN_DIR_ENV, PluginSettings
from .stamp import StampMiddleware, WeightsGate
from .swap import not_swappable
from .swapdriver import SwapDriver

log = logging.getLogger("vllm.weightship")

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


async def join(request: Request) -> JSONResponse:
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_JOIN_BYTES:
            return JSONResponse({"accepted": False, "reason": FailureReason.BAD_REQUEST}, 413)
    status, doc = await asyncio.to_thread(forward, run_dir(), "POST", JOIN_PATH, body)
    return JSONResponse(doc, status)


async def seed_status() -> JSONResponse:
    status, doc = await asyncio.to_thread(forward, run_dir(), "GET", STATUS_PATH, None)
    return JSONResponse(doc, status)


class SwapService:
    """The swap endpoint's state: who may swap, the gate, the latest swap."""

    def __init__(self, env: dict[str, str] | os._Environ[str]) -> None:
        self.auth = SwapAuth.from_env(env)
        self.gate = WeightsGate(Weights.from_env(env))
        self.tracker = SwapTracker()
        self.driver: SwapDriver | None = None
        self.unswappable = "the engine is not up yet"

    def bind(self, engine_client: Any, args: Namespace) -> None:
        why = not_swappable(engine_client, args)
        if why is not None:
            self.unswappable = why
            return
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        config = engine_client.vllm_config
        extra = config.load_config.model_loader_extra_config
        settings = PluginSettings.from_env(os.environ, extra if isinstance(extra, dict) else {})
        self.driver = SwapDriver(
            engine=engine_client,
            gate=self.gate,
            tracker=self.tracker,
            run_dir=run_dir(),
            cache_dir=settings.cache_dir,
            world=int(config.parallel_config.world_size),
            make_update=lambda info: WeightTransferUpdateRequest(update_info=info),
        )

    async def _authorized(
        self, request: Request, parse: Callable[[bytes], Parsed]
    ) -> Parsed | JSONResponse:
        """The body, parsed, once the token opens this pod's swap to its digest; else the
        answer (the token is checked for presence before the body is read)."""
        authorization = request.headers.get("authorization")
        refusal = self.auth.missing(authorization)
        if refusal is not None:
            return respond(refused(refusal))
        try:
            body = await read_bounded(request, MAX_SWAP_BODY)
        except SwapRequestError as exc:
            return respond(bad_request(exc))
        parsed = self.auth.authorize(authorization, body, parse, time.time())
        return respond(parsed) if isinstance(parsed, tuple) else parsed

    async def post(self, request: Request) -> JSONResponse:
        swap = await self._authorized(request, SwapRequest.parse)
        if isinstance(swap, JSONResponse):
            return swap
        driver = self.driver
        if driver is None:
            return respond((501, SwapAnswer(False, FailureReason.NOT_SWAPPABLE, self.unswappable)))
        if driver.running():
            return respond(busy(self.tracker.current))
        if (
            driver.mixed is None
            and self.gate.weights.manifest_digest == swap.manifest_digest
            and await asyncio.to_thread(driver.loaded_digest) == swap.manifest_digest
        ):
            return respond(already_loaded(swap.manifest_digest, self.tracker.current))
        if driver.running():  # another POST started one while this one read the reports
            return respond(busy(self.tracker.current))
        state = driver.start(swap)  # no await since the check: nothing else ran between
        log.info("swap to %s (%s) accepted", swap.manifest_digest, swap.revision)
        return respond(accepted(state))

    async def verified(self, request: Request) -> JSONResponse:
        """POST /weightship/v1/swap/verified: the verifier passed these weights (with the
        swap's token): the gate opens to every request. 409 when the server holds other
        weights for verification (or none: then nothing changes)."""
        digest = await self._authorized(request, parse_verified)
        if isinstance(digest, JSONResponse):
            return digest
        opened = self.gate.verified(digest)
        if opened:
            log.info("swapped weights %s verified: serving every request", digest)
        gate = self.gate
        return respond(
            verified_answer(opened, gate.mode, gate.weights.manifest_digest, gate.last_held_s)
        )

    def is_verifier(self, header: str | None) -> bool:
        return self.auth.opens_verification(header, self.gate.weights.manifest_digest, time.time())

    def loaded(self) -> dict[str, Any]:
        """GET /weightship/v1/loaded. While a swap runs the ranks change their reports one
        after the other: the answer is Loading until it is over, never a mix of both."""
        doc = loaded_document(run_dir())
        current = self.tracker.current
        if current.running:
            doc.update(
                state="Loading",
                manifestDigest=current.manifest_digest,
                verified=False,
                reason=None,
                message=(
                    f"swapping in place from {current.from_manifest_digest} to "
                    f"{current.manifest_digest} ({current.revision})"
                ),
            )
        return doc

    async def get(self) -> JSONResponse:
        """The latest swap's state, and whether this server can swap at all (an operator
        replaces a pod that cannot)."""
        doc = self.tracker.current.to_json()
        doc["swappable"] = self.driver is not None
        if self.driver is None:
            doc["notSwappable"] = self.unswappable
        return JSONResponse(doc)


def respond(answer: Answer) -> JSONResponse:
    status, doc = answer
    return JSONResponse(doc.to_json(), status)


async def read_bounded(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise SwapRequestError(f"the body is over {limit} bytes", 413)
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise SwapRequestError(f"the body is over {limit} bytes", 413)
    return body


class WeightshipEndpoints:
    name = "weightship"
    required_tasks = None

    def __init__(self) -> None:
        self.swaps = SwapService(os.environ)

    async def loaded(self) -> JSONResponse:
        return JSONResponse(self.swaps.loaded())

    def attach_router(self, app: FastAPI) -> None:
        app.add_api_route(LOADED_PATH, self.loaded, methods=["GET"])
        app.add_api_route(JOIN_PATH, join, methods=["POST"])
        app.add_api_route(STATUS_PATH, seed_status, methods=["GET"])
        app.add_api_route(SWAP_PATH, self.swaps.post, methods=["POST"])
        app.add_api_route(SWAP_PATH, self.swaps.get, methods=["GET"])
        app.add_api_route(VERIFIED_PATH, self.swaps.verified, methods=["POST"])
        # vLLM adds its own middlewares (CORS, --api-key, request ids) after this, so they
        # wrap this one: what they answer themselves (an --api-key 401) is not stamped.
        # The app's middleware stack is already built by the time init_state runs.
        app.add_middleware(
            StampMiddleware, gate=self.swaps.gate, is_verifier=self.swaps.is_verifier
        )

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        """The ranks' reports are files in the run directory; the swap service needs the
        engine."""
        if engine_client is not None:
            self.swaps.bind(engine_client, args)


def endpoint_plugin() -> WeightshipEndpoints:
    return WeightshipEndpoints()
