"""A stand-in inference server for in-place updates at fleet size (test tooling, issue 39).

It speaks the weightship vLLM plugin's swap and verification protocol as the operator's
swapper and verifier use it, without vLLM, torch or weights: ``POST``/``GET
/weightship/v1/swap`` (the pod's swap token checked), ``POST
/weightship/v1/swap/verified``, ``GET /weightship/v1/loaded``, the OpenAI chat and
completion endpoints answering with the revision's answer (``--answer``,
``--revision-answer``), ``/health`` for the readiness probe, and the
``X-Weightship-Revision`` / ``X-Weightship-Manifest-Digest`` stamps on every response. What
it shares with the plugin it imports rather than copies: the request, answer and state
documents (``weightship.api.inference``), the token check, the swap's state machine and the
answers (``weightship.integrations.serving``), and the plugin's own gate and stamping
middleware (``weightship.integrations.vllm.stamp``), which holds requests through a swap and
serves swapped weights to the verifier alone until it says they passed.

A swap takes as long as a real one: the gate closes, in-flight requests drain (up to the
request's drain timeout), the gate is sealed, and ``--swap-seconds`` pass (default 1.0 s:
what ``bench/bench_vllm_swap.py`` measured for a 198.5 MiB checkpoint, docs/integrations.md)
where vLLM would stage, apply and commit. A start takes ``--start-seconds`` (default 0):
until then every route answers 503, as a vLLM that is still loading answers nothing.

One process per pod (``python3 -m weightship_dev.standin``, the pod's env as the operator
sets it: WEIGHTSHIP_MODEL_REVISION, WEIGHTSHIP_MANIFEST_DIGEST, WEIGHTSHIP_SEED_KEY,
WEIGHTSHIP_ROLLOUT_UID, WEIGHTSHIP_POD_NAME), about 60 MB and a second of CPU to start; or
one process for many KWOK pods (``weightship_dev.standinfleet``), each pod told apart by
the address a request came to. Served by aiohttp (which kopf and the kubernetes client
bring), through a small ASGI bridge, so the plugin's ASGI middleware runs unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from weightship.api.env import MANIFEST_DIGEST_ENV, POD_NAME_ENV, ROLLOUT_UID_ENV, SEED_KEY_ENV
from weightship.api.inference import (
    LOADED_PATH,
    MAX_SWAP_BODY,
    SWAP_PATH,
    VERIFIED_PATH,
    FailureReason,
    LoadReport,
    LoadSource,
    SwapAnswer,
    SwapRequest,
    SwapRequestError,
    parse_verified,
)
from weightship.core.seedtoken import parse_key
from weightship.integrations.serving import (
    Answer,
    Parsed,
    StepTimes,
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
from weightship.integrations.vllm.stamp import StampMiddleware, WeightsGate, asgi_header

log = logging.getLogger("weightship.standin")

DEFAULT_PORT = 8000  # vLLM's
DEFAULT_SWAP_S = 1.0  # bench_vllm_swap, 198.5 MiB, TP 1: 1.019 s (docs/integrations.md)
DEFAULT_ANSWER = "Paris."  # tinyvllm's good answer to its golden prompt
SERVED_MODEL = "tiny"
CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
MAX_BODY = 1 << 20  # a chat request's body; the swap routes' is MAX_SWAP_BODY
# What cleaning up after a timed-out swap may take, beyond its own timeouts (as the plugin's
# swapdriver.CLEANUP_GRACE_S): how long the gate holds requests at most.
CLEANUP_GRACE_S = 30.0
MODULE = "weightship_dev.standin"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class Behaviour:
    """How long things take and what the model answers (the command line's flags)."""

    swap_seconds: float = DEFAULT_SWAP_S
    start_seconds: float = 0.0
    answer: str = DEFAULT_ANSWER
    revision_answers: Mapping[str, str] = field(default_factory=dict)

    def answer_for(self, revision: str) -> str:
        return self.revision_answers.get(revision, self.answer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python3 -m {MODULE}",
        description="A stand-in inference server speaking the weightship vLLM plugin's "
        "swap and verification protocol (test tooling).",
    )
    p.add_argument("--host", default="0.0.0.0")  # noqa: S104  (a pod's own address)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--swap-seconds",
        type=_seconds,
        default=DEFAULT_SWAP_S,
        help="how long a swap's stage, apply and commit take (default %(default)s s: "
        "vLLM with a 198.5 MiB checkpoint, bench_vllm_swap)",
    )
    p.add_argument(
        "--start-seconds",
        type=_seconds,
        default=0.0,
        help="how long the server takes to start: every route answers 503 until then",
    )
    p.add_argument("--answer", default=DEFAULT_ANSWER, help="what the model answers")
    p.add_argument(
        "--revision-answer",
        action="append",
        default=[],
        metavar="REVISION=TEXT",
        help="what the model answers with these weights (a subtly bad revision)",
    )
    return p


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: seconds must be in [0, 3600]")
    return value


def behaviour(args: argparse.Namespace) -> Behaviour:
    answers = {}
    for item in args.revision_answer:
        revision, sep, text = item.partition("=")
        if not sep or not revision:
            raise SystemExit(f"--revision-answer {item!r}: expected REVISION=TEXT")
        answers[revision] = text
    return Behaviour(args.swap_seconds, args.start_seconds, args.answer, answers)


def behaviour_from_argv(argv: Sequence[str]) -> Behaviour:
    """The behaviour a pod's container arguments ask for (the fleet reads them)."""
    return behaviour(parser().parse_args(list(argv)))


def command(
    *, swap_seconds: float, start_seconds: float, port: int = DEFAULT_PORT, **answers: str
) -> list[str]:
    """A container's command that runs the stand-in (``answers``: ``answer=`` only)."""
    argv = [
        "python3",
        "-m",
        MODULE,
        "--port",
        str(port),
        "--swap-seconds",
        f"{swap_seconds:g}",
        "--start-seconds",
        f"{start_seconds:g}",
    ]
    if "answer" in answers:
        argv += ["--answer", answers["answer"]]
    return argv


def auth_from_env(env: Mapping[str, str]) -> SwapAuth:
    """As ``SwapAuth.from_env`` (the key, the rollout's uid, the pod's name), without
    ``weightship.seeding``'s import of torch: a malformed key is no key."""
    text = env.get(SEED_KEY_ENV, "").strip()
    try:
        key = parse_key(text) if text else None
    except ValueError:
        key = None
    name = env.get(POD_NAME_ENV, "").strip() or env.get("POD_NAME", "").strip() or "standin"
    return SwapAuth(key, env.get(ROLLOUT_UID_ENV, "").strip(), name)


# -- one pod's server ----------------------------------------------------------------------


class PodServer:
    """One inference server: the plugin's gate in front of a model that answers at once,
    swaps in ``swap_seconds`` and starts in ``start_seconds``. Call ``app`` (ASGI)."""

    def __init__(
        self,
        env: Mapping[str, str],
        behaviour: Behaviour,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.behaviour = behaviour
        self.auth = auth_from_env(env)
        self.gate = WeightsGate(Weights.from_env(env))
        self.tracker = SwapTracker()
        self.loaded_digest = env.get(MANIFEST_DIGEST_ENV) or None  # every "rank" holds it
        self.source: LoadSource = "cache"
        self._clock = clock
        self._ready_at = clock() + behaviour.start_seconds
        self._task: asyncio.Task[None] | None = None
        self.app = StampMiddleware(self._route, gate=self.gate, is_verifier=self._is_verifier)

    @property
    def started(self) -> bool:
        return self._clock() >= self._ready_at

    def swapping(self) -> bool:
        return self._task is not None and not self._task.done()

    def _is_verifier(self, header: str | None) -> bool:
        return self.auth.opens_verification(header, self.gate.weights.manifest_digest, time.time())

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope.get("method", "GET"), str(scope.get("path", ""))
        if not self.started:
            await _json(send, 503, {"error": "starting", "reason": FailureReason.NOT_READY})
            return
        if method == "GET" and path == HEALTH_PATH:
            await _json(send, 200, {})
        elif method == "GET" and path == MODELS_PATH:
            await _json(send, 200, {"object": "list", "data": [{"id": SERVED_MODEL}]})
        elif method == "GET" and path == LOADED_PATH:
            await _json(send, 200, self.loaded())
        elif method == "GET" and path == SWAP_PATH:
            await _json(send, 200, {**self.tracker.current.to_json(), "swappable": True})
        elif method == "POST" and path == SWAP_PATH:
            await _answer(send, await self.post_swap(scope, receive))
        elif method == "POST" and path == VERIFIED_PATH:
            await _answer(send, await self.post_verified(scope, receive))
        elif method == "POST" and path in (CHAT_PATH, COMPLETION_PATH):
            await self.complete(send, chat=path == CHAT_PATH, body=await _body(receive, MAX_BODY))
        else:
            await _json(send, 404, {"error": f"no route {method} {path}"})

    # -- the plugin's routes ---------------------------------------------------------------

    def loaded(self) -> dict[str, Any]:
        """GET LOADED_PATH: Loading while a swap runs, else what every rank holds."""
        current = self.tracker.current
        if current.running:
            report = LoadReport(
                "Loading",
                current.manifest_digest,
                message=f"swapping in place from {current.from_manifest_digest} to "
                f"{current.manifest_digest} ({current.revision})",
            )
        else:
            report = LoadReport("Loaded", self.loaded_digest, verified=True, source=self.source)
        return report.to_json()

    async def _authorized(
        self, scope: Scope, receive: Receive, parse: Callable[[bytes], Parsed]
    ) -> Parsed | Answer:
        authorization = asgi_header(scope, "authorization")
        refusal = self.auth.missing(authorization)
        if refusal is not None:
            return refused(refusal)
        try:
            body = await _body(receive, MAX_SWAP_BODY)
        except SwapRequestError as exc:
            return bad_request(exc)
        return self.auth.authorize(authorization, body, parse, time.time())

    async def post_swap(self, scope: Scope, receive: Receive) -> Answer:
        swap = await self._authorized(scope, receive, SwapRequest.parse)
        if isinstance(swap, tuple):
            return swap
        if self.swapping():
            return busy(self.tracker.current)
        if self.gate.weights.manifest_digest == swap.manifest_digest == self.loaded_digest:
            return already_loaded(swap.manifest_digest, self.tracker.current)
        state = self.tracker.begin(swap, self.gate.weights.manifest_digest)
        self._task = asyncio.get_running_loop().create_task(self._swap(swap))
        log.info("swap to %s (%s) accepted", swap.manifest_digest, swap.revision)
        return accepted(state)

    async def post_verified(self, scope: Scope, receive: Receive) -> Answer:
        digest = await self._authorized(scope, receive, parse_verified)
        if isinstance(digest, tuple):
            return digest
        opened = self.gate.verified(digest)
        return verified_answer(opened, self.gate.mode, self.gate.weights.manifest_digest)

    async def _swap(self, request: SwapRequest) -> None:
        """The plugin's swapdriver, its engine a sleep: close, drain, seal, swap, then open
        (or verify)."""
        new = Weights(request.revision, request.manifest_digest)
        self.gate.close(request.drain_timeout_s + request.swap_timeout_s + CLEANUP_GRACE_S)
        closed = time.monotonic()
        steps = StepTimes()
        await self.gate.wait_idle(request.drain_timeout_s)  # then the rest is cut (seal)
        steps.done("drain")
        self.gate.seal()
        self.tracker.loading(time.monotonic() - closed)
        await asyncio.sleep(self.behaviour.swap_seconds)
        steps.done("swap")
        self.loaded_digest, self.source = request.manifest_digest, "swap"
        if request.hold_until_verified:
            self.gate.verifying(new, request.swap_timeout_s)
        else:
            self.gate.open(new)
        self.tracker.swapped(time.monotonic() - closed, self.behaviour.swap_seconds, steps.seconds)

    # -- the model ---------------------------------------------------------------------------

    async def complete(self, send: Send, *, chat: bool, body: bytes) -> None:
        """The answer of the weights the gate admitted this request with (the stamp)."""
        try:
            doc = json.loads(body)
        except ValueError:
            await _json(send, 400, {"error": {"message": "the body is not JSON"}})
            return
        if not isinstance(doc, dict):
            await _json(send, 400, {"error": {"message": "the body must be a JSON object"}})
            return
        text = self.behaviour.answer_for(self.gate.weights.revision)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        await _json(
            send,
            200,
            {
                "object": "chat.completion" if chat else "text_completion",
                "model": str(doc.get("model") or SERVED_MODEL),
                "created": int(time.time()),
                "choices": [choice],
            },
        )


async def _body(receive: Receive, limit: int) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if len(body) > limit:
            raise SwapRequestError(f"the body is over {limit} bytes", 413)
        if not message.get("more_body"):
            return body


async def _json(send: Send, status: int, doc: Mapping[str, Any]) -> None:
    data = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _answer(send: Send, answer: Answer) -> None:
    status, doc = answer
    assert isinstance(doc, SwapAnswer)
    await _json(send, status, doc.to_json())


# -- HTTP: aiohttp in front of the ASGI apps ------------------------------------------------

# The server the request came to, by the address it came to (the fleet's KWOK pods), or
# None: no pod there.
Resolve = Callable[[str], PodServer | None]


async def asgi_handler(request: web.BaseRequest, resolve: Resolve) -> web.StreamResponse:
    """Hand the request to the ASGI app of the pod whose address it came to."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    server = resolve(str(sockname[0]) if sockname else "")
    if server is None:
        return web.json_response({"error": "no pod at this address"}, status=404)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return web.json_response({"error": "the body is too large"}, status=413)
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    response: web.StreamResponse | None = None

    async def send(message: Message) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=int(message["status"]))
            for key, value in message.get("headers") or []:
                response.headers.add(bytes(key).decode("latin-1"), bytes(value).decode("latin-1"))
            await response.prepare(request)
        elif message["type"] == "http.response.body" and response is not None:
            await response.write(bytes(message.get("body", b"")))
            if not message.get("more_body"):
                await response.write_eof()

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.raw_path.encode("latin-1"),
        "query_string": request.query_string.encode("latin-1"),
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in request.raw_headers],
        "client": request.transport.get_extra_info("peername") if request.transport else None,
        "server": sockname,
    }
    try:
        await server.app(scope, receive, send)
    except ConnectionError:  # the client went away (a held request it gave up on)
        return response if response is not None else web.Response(status=499)
    if response is None:  # the app sent nothing: an error of this stand-in's
        return web.json_response({"error": "no answer"}, status=500)
    return response


async def serve(host: str, port: int, resolve: Resolve) -> web.TCPSite:
    """Listen; the site runs until the event loop stops."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        return await asgi_handler(request, resolve)

    # aiohttp's requests read at most 1 MiB (BaseRequest's client_max_size): MAX_BODY.
    runner = web.ServerRunner(web.Server(handle), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return site


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # a line per probe
    how = behaviour(args)

    async def run() -> None:
        server = PodServer(os.environ, how)
        await serve(args.host, args.port, lambda _address: server)
        log.info(
            "stand-in serving %s on %s:%d (swap %.3g s, start %.3g s)",
            server.gate.weights.revision,
            args.host,
            args.port,
            how.swap_seconds,
            how.start_seconds,
        )
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
