"""A tiny HTTP server for proving the local cluster is real (`python -m weightship_dev.echoserver`).

GET /          JSON: pod name, namespace, node, pod IP, selected env
GET /peer?ip=  fetch another pod's `/` from inside this pod (pod-to-pod traffic)
GET /whoami    read this pod through the API with the pod's own service-account token
GET /metrics   Prometheus metrics (a request counter)
GET /healthz   200 once started
POST /v1/completions  an OpenAI-style completion (the prompt reversed); ECHO_ERROR_RATE
               of them answer 500, counted in weightship_echo_http_requests_total
On start it writes `<ECHO_DATA_DIR>/<pod>.started`; on SIGTERM `<pod>.terminated`, then
exits: the tests read these from each node's hostPath directory.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from types import FrameType
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from weightship.httpserver import QuietHandler, Server
from weightship_testing.errorrate import ErrorInjector

REQUESTS = Counter("weightship_echo_requests", "Requests served", ["path"])
HTTP_REQUESTS = Counter(
    "weightship_echo_http_requests", "Completions answered, by status code", ["code", "revision"]
)


ERRORS = ErrorInjector(float(os.environ.get("ECHO_ERROR_RATE", "0") or 0))
POD_NETWORK = ipaddress.ip_network("198.18.0.0/16")


def identity() -> dict[str, str]:
    keys = (
        "POD_NAME",
        "POD_NAMESPACE",
        "NODE_NAME",
        "POD_IP",
        "HOST_IP",
        "ECHO_MESSAGE",
        "KUBERNETES_SERVICE_HOST",
    )
    return {k: os.environ.get(k, "") for k in keys}


class Handler(QuietHandler):
    _send = QuietHandler.send_bytes

    def do_GET(self) -> None:
        url = urlparse(self.path)
        REQUESTS.labels(path=url.path).inc()
        if url.path == "/metrics":
            self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
        elif url.path == "/healthz":
            self._send(200, b"ok", "text/plain")
        elif url.path == "/peer":
            self._peer(parse_qs(url.query))
        elif url.path == "/whoami":
            self._whoami()
        elif url.path == "/":
            self._send(200, json.dumps(identity()).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        url = urlparse(self.path)
        REQUESTS.labels(path=url.path).inc()
        if url.path != "/v1/completions":
            self._send(404, b"{}")
            return
        length = int(self.headers.get("Content-Length") or 0)
        prompt = json.loads(self.rfile.read(length) or b"{}").get("prompt", "")
        code = 500 if ERRORS.next_fails() else 200
        HTTP_REQUESTS.labels(
            code=str(code), revision=os.environ.get("WEIGHTSHIP_MODEL_REVISION", "")
        ).inc()
        body = (
            {"error": "injected"}
            if code == 500
            else {"object": "text_completion", "choices": [{"index": 0, "text": prompt[::-1]}]}
        )
        self._send(code, json.dumps(body).encode())

    def _peer(self, query: dict[str, list[str]]) -> None:
        ip = ipaddress.ip_address(query.get("ip", ["0.0.0.0"])[0])  # noqa: S104
        port = int(query.get("port", ["8080"])[0])
        if ip not in POD_NETWORK:
            self._send(400, b'{"error": "only pod addresses"}')
            return
        with urllib.request.urlopen(f"http://{ip}:{port}/", timeout=5) as resp:
            self._send(200, resp.read())

    def _whoami(self) -> None:
        from kubernetes import client, config

        config.load_incluster_config()
        pod = client.CoreV1Api().read_namespaced_pod(
            os.environ["POD_NAME"], os.environ["POD_NAMESPACE"]
        )
        self._send(200, json.dumps({"uid": pod.metadata.uid, "node": pod.spec.node_name}).encode())


def main() -> None:
    port = int(os.environ.get("ECHO_PORT", "8080"))
    data = Path(os.environ["ECHO_DATA_DIR"]) if os.environ.get("ECHO_DATA_DIR") else None
    pod = os.environ.get("POD_NAME", "pod")
    server = Server(("0.0.0.0", port), Handler)  # noqa: S104 - the pod's own namespace

    def on_term(signum: int, frame: FrameType | None) -> None:
        if data:
            (data / f"{pod}.terminated").write_text("SIGTERM\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    if data:
        data.mkdir(parents=True, exist_ok=True)
        (data / f"{pod}.started").write_text(json.dumps(identity()))
    server.serve_forever()


if __name__ == "__main__":
    main()
