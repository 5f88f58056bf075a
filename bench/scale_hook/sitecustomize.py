"""Loaded by bench_scale's operator processes (PYTHONPATH): counts the operator's own
kubernetes-client requests by verb and resource, exported on its /metrics as
bench_client_requests_total. The API server's counts cover the whole shared cluster;
these are this one process's, in both designs alike."""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes.client import rest
from prometheus_client import Counter

REQUESTS = Counter(
    "bench_client_requests", "kubernetes-client requests of this process", ["verb", "resource"]
)


def classify(method: str, url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    # /api/v1/... or /apis/<group>/<version>/...
    rest_of = segments[2:] if segments[:1] == ["api"] else segments[3:]
    if rest_of[:1] == ["namespaces"] and len(rest_of) >= 3:
        rest_of = rest_of[2:]
    resource = rest_of[0] if rest_of else "?"
    named = len(rest_of) >= 2
    if len(rest_of) >= 3:
        resource = f"{resource}/{rest_of[2]}"
    verb = method.upper()
    if verb == "GET" and not named:
        verb = "WATCH" if parse_qs(parts.query).get("watch") == ["true"] else "LIST"
    return verb, resource


_request = rest.RESTClientObject.request
# A file to append each write's verb, path and body to (JSON lines), to see what a
# rollout's writes were: BENCH_WRITE_LOG=/tmp/writes.jsonl.
WRITE_LOG = os.environ.get("BENCH_WRITE_LOG")


def _counted(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
    verb, resource = classify(method, url)
    REQUESTS.labels(verb, resource).inc()
    if WRITE_LOG and verb not in ("GET", "LIST", "WATCH"):
        line = {"t": time.time(), "verb": verb, "path": urlsplit(url).path}
        if resource.endswith("/status") or resource == "events":
            line["body"] = kwargs.get("body")
        with open(WRITE_LOG, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
    return _request(self, method, url, *args, **kwargs)


rest.RESTClientObject.request = _counted
