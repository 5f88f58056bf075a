"""The reference inference server (`python -m weightship_testing.tinyllm serve`).

It listens at once (the pod gets its IP and port) and obtains its weights in a background
thread. Weights that fail verification are never served: the server keeps running, says
why on /weightship/v1/loaded and answers completions with 503.

GET  /healthz               200 once the process is up
GET  /readyz                200 only when the weights are loaded and verified
GET  /weightship/v1/loaded  what was loaded (read by the operator's readiness-gate verifier)
GET  /metrics               Prometheus: completions by code, latency, load seconds
POST /v1/completions        OpenAI-style, greedy whatever the temperature
POST /weightship/v1/seed/join    once loaded and verified: new replicas join a broadcast
GET  /weightship/v1/seed/status  the broadcasts this replica ran as a root
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from weightship.api.inference import LOADED_PATH, LoadReport
from weightship.httpserver import QuietHandler, Server
from weightship.seeding.endpoints import handle_join, handle_status
from weightship.seeding.protocol import JOIN_PATH, STATUS_PATH
from weightship.seeding.root import SeedRoot
from weightship.weightformat.manifest import Manifest
from weightship_testing.errorrate import ErrorInjector
from weightship_testing.tinyllm.model import TinyLLM
from weightship_testing.tinyllm.settings import Settings
from weightship_testing.tinyllm.weights import LoadFailure, obtain_weights

log = logging.getLogger("tinyllm")

COMPLETIONS_PATH = "/v1/completions"
MODEL_NAME = "tinyllm"
MAX_TOKENS_LIMIT = 4096  # as spec.validation.goldenPrompts[].maxTokens


class Metrics:
    def __init__(self, revision: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "http_requests",
            "Completions answered, by status code",
            ["code", "revision"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "http_request_duration_seconds",
            "Time to answer a completion",
            ["revision"],
            registry=self.registry,
        )
        self.load_seconds = Gauge(
            "tinyllm_load_seconds",
            "Seconds it took to obtain and verify the weights",
            ["revision"],
            registry=self.registry,
        )
        self.revision = revision


class BadRequest(ValueError):
    pass


class App:
    """The server's state: settings, what is loaded, metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.status = LoadReport(state="Loading", manifest_digest=settings.manifest_digest)
        self.model: TinyLLM | None = None
        self.metrics = Metrics(settings.revision)
        self.errors = ErrorInjector(settings.error_rate)
        self.seed_root: SeedRoot | None = None

    def load(self) -> None:
        """Obtain the weights (run in a background thread). The model is set before the
        status says Loaded, and each is replaced whole, so readers need no lock."""
        try:
            got = obtain_weights(self.settings)
            model = TinyLLM(got.tensors, got.config, device=self.settings.device)
        except LoadFailure as exc:
            self._failed(exc.reason, exc.message, exc.digest)
            return
        except Exception as exc:
            self._failed("LoadError", f"{type(exc).__name__}: {exc}", None)
            return
        self.metrics.load_seconds.labels(self.settings.revision).set(got.seconds)
        self.model = model
        self.status = LoadReport(
            state="Loaded",
            manifest_digest=got.manifest.digest,
            verified=got.verified,
            source=got.source,
            seeded_from=got.seeded_from,
            load_seconds=got.seconds,
            message=f"{got.manifest.total_size} bytes from {got.source}",
        )
        log.info("loaded %s from %s in %.2f s", got.manifest.digest, got.source, got.seconds)
        self._become_root(got.tensors, got.manifest, got.verified)

    def _become_root(
        self, tensors: dict[str, torch.Tensor], manifest: Manifest, verified: bool
    ) -> None:
        """A verified replica can seed new ones (the operator picks which one does)."""
        settings = self.settings
        if not verified or settings.root.host is None:
            return
        try:
            self.seed_root = SeedRoot.from_settings(tensors, manifest, settings.root)
        except Exception as exc:  # e.g. a manifest without tensor checksums
            log.warning("this replica cannot seed others: %s", exc)

    def _failed(self, reason: str, message: str, digest: str | None) -> None:
        log.error("refusing to serve: %s: %s", reason, message)
        self.status = LoadReport(
            state="Failed",
            manifest_digest=digest or self.status.manifest_digest,
            reason=reason,
            message=message,
        )

    def loaded_report(self) -> dict[str, Any]:
        return {**self.status.to_json(), "revision": self.settings.revision}

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        model, status = self.model, self.status
        if model is None or status.state != "Loaded":
            detail = status.message or "weights are loading"
            return 503, _error(f"not serving: {status.state}: {detail}", "unavailable")
        prompt, max_tokens = _parse_completion(body)
        if self.errors.next_fails():
            return 500, _error("injected failure (TINYLLM_ERROR_RATE)", "server_error")
        done = model.complete(prompt, max_tokens)
        return 200, {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME,
            "choices": [
                {
                    "text": done.text,
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": done.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            },
        }


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


def _parse_completion(body: dict[str, Any]) -> tuple[str, int]:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string")
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or not 0 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadRequest(f"max_tokens must be an integer from 0 to {MAX_TOKENS_LIMIT}")
    return prompt, max_tokens


def make_handler(app: App) -> type[BaseHTTPRequestHandler]:
    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"  # keep-alive for the verifier and load generators
        _send = QuietHandler.send_bytes
        _json = QuietHandler.send_json

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ready = app.status.state == "Loaded" and app.status.verified
                self._send(200 if ready else 503, f"{app.status.state}\n".encode(), "text/plain")
            elif path == LOADED_PATH:
                self._json(200, app.loaded_report())
            elif path == "/metrics":
                self._send(200, generate_latest(app.metrics.registry), CONTENT_TYPE_LATEST)
            elif path == STATUS_PATH:
                self._json(*handle_status(app.seed_root))
            else:
                self._json(404, _error(f"no route {path}", "not_found"))

        def do_POST(self) -> None:
            raw = self.read_body()  # 400/413 answered for a bad or oversized length
            if raw is None:
                return
            if self.path.split("?", 1)[0] == JOIN_PATH:
                self._json(*handle_join(app.seed_root, raw))
                return
            if self.path.split("?", 1)[0] != COMPLETIONS_PATH:
                self._json(404, _error(f"no route {self.path}", "not_found"))
                return
            started = time.monotonic()
            if app.settings.extra_latency_s:
                time.sleep(app.settings.extra_latency_s)
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                code, doc = app.complete(body)
            except (BadRequest, json.JSONDecodeError) as exc:
                code, doc = 400, _error(str(exc), "invalid_request_error")
            except Exception as exc:  # a bug must still be an answer, and counted
                log.exception("completion failed")
                code, doc = 500, _error(f"{type(exc).__name__}: {exc}", "server_error")
            revision = app.settings.revision
            app.metrics.requests.labels(code=str(code), revision=revision).inc()
            app.metrics.latency.labels(revision=revision).observe(time.monotonic() - started)
            self._json(code, doc)

    return Handler


def serve(settings: Settings) -> None:
    """Listen, load in the background, serve until killed."""
    app = App(settings)
    server = Server(("0.0.0.0", settings.port), make_handler(app))  # noqa: S104 - the pod's IP
    log.info("listening on port %d (revision %r)", server.server_port, settings.revision)
    threading.Thread(target=app.load, name="load-weights", daemon=True).start()
    server.serve_forever()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="tinyllm %(levelname)s %(message)s")
    serve(Settings.from_env(os.environ))
