"""``python -m weightship.integrations.sglang [options] [-- <the SGLang command>]``

The adapter in SGLang's own container (no sidecar): it verifies the start weights, then
starts SGLang (the command after ``--``, which must listen on loopback at
``--sglang-url``) and serves the pod's port. Without a command it fronts an SGLang started
otherwise. It exits with SGLang's exit status, and stops SGLang on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from weightship.api.env import CACHE_DIR_ENV, TERMINATION_LOG_ENV
from weightship.api.inference import DEFAULT_TERMINATION_LOG, termination_message
from weightship.integrations.serving import SwapAuth, Weights

from .adapter import Adapter
from .client import SGLangClient
from .server import REQUEST_DEADLINE_S, serve

log = logging.getLogger("weightship.sglang")

URL_ENV = "WEIGHTSHIP_SGLANG_URL"
ADMIN_KEY_ENV = "WEIGHTSHIP_SGLANG_ADMIN_KEY"  # SGLang's --admin-api-key, if it has one


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    args = list(argv)
    command: list[str] = []
    if "--" in args:
        at = args.index("--")
        args, command = args[:at], args[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m weightship.integrations.sglang")
    parser.add_argument("--host", default="0.0.0.0", help="address to serve on")  # noqa: S104
    parser.add_argument("--port", type=int, default=8000, help="the pod's serving port")
    parser.add_argument(
        "--sglang-url",
        default=os.environ.get(URL_ENV, "http://127.0.0.1:30000"),
        help="SGLang's own address: loopback only",
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=1800.0, help="seconds SGLang may take to start"
    )
    parser.add_argument(
        "--abort-on-drain-timeout",
        action="store_true",
        help="cut the requests still running when a swap's drain timeout passes (SGLang "
        "aborts them) and swap; by default they finish and that swap is refused",
    )
    parser.add_argument(
        "--request-deadline",
        type=float,
        default=REQUEST_DEADLINE_S,
        help="seconds one request (held through a swap, then generated) may take",
    )
    return parser.parse_args(args), command


def upstream_of(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SystemExit(f"--sglang-url must be http://<loopback host>:<port>, got {url!r}")
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"SGLang must listen on loopback (its admin routes), got {url!r}")
    return parts.hostname, parts.port or 80


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    upstream = upstream_of(args.sglang_url)
    env = os.environ
    cache = env.get(CACHE_DIR_ENV)
    adapter = Adapter(
        client=SGLangClient(args.sglang_url, admin_key=env.get(ADMIN_KEY_ENV) or None),
        auth=SwapAuth.from_env(env),
        cache_dir=Path(cache) if cache else None,
        start=Weights.from_env(env),
        abort_on_drain_timeout=args.abort_on_drain_timeout,
    )
    server = serve(
        adapter, args.host, args.port, upstream, request_deadline_s=args.request_deadline
    )
    server.start("sglang-adapter")
    log.info("serving %s:%d in front of %s", args.host, server.server_port, args.sglang_url)

    model = adapter.verify_start()
    if model is None:
        # Never start SGLang on bytes that did not match; say why, on the port and on the
        # way out.
        if adapter.failure is not None:
            path = env.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG
            write_termination(Path(path), termination_message(adapter.failure))
        threading.Event().wait()  # the verifier reads the Failed report; kubelet restarts
        return 1
    child = subprocess.Popen(command) if command else None
    if child is not None:
        stop_child_on_term(child)
    threading.Thread(
        target=adapter.await_server, args=(model, args.ready_timeout), daemon=True
    ).start()
    if child is None:
        threading.Event().wait()
        return 0
    code = child.wait()
    log.info("SGLang exited with %d", code)
    server.stop()
    return code


def stop_child_on_term(child: subprocess.Popen[bytes]) -> None:
    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)


def write_termination(path: Path, text: str) -> None:
    """The container's termination message (kubelet reads it when the container ends)."""
    with contextlib.suppress(OSError):  # not in a container
        path.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
