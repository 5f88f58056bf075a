"""The shared list-then-watch cache as the agent uses it: ModelRollouts of every namespace,
listed once from the watch cache, then watched; `on_change` after the list and each event."""

from __future__ import annotations

import http.server
import json
import random
import threading
from collections import Counter
from typing import Any

import urllib3

from weightship.agent.kube import rollout_informer
from weightship.httpserver import Server
from weightship.kube.informer import Informer, relist_delay_s


class _Response:
    """A response read raw (`_preload_content=False`): a listing's data, a watch's lines."""

    def __init__(self, body: Any, lines: list[dict[str, Any]] | None = None) -> None:
        self.data = json.dumps(body).encode()
        self.lines = [json.dumps(line).encode() + b"\n" for line in lines or []]

    def stream(self, amt: int | None = None, decode_content: bool = False) -> list[bytes]:
        return self.lines

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


def rollout(namespace: str, name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name, "resourceVersion": version}}


class _Custom:
    """CustomObjectsApi.list_cluster_custom_object: a listing, then one watch stream; the
    watch after it (the stream timed out) ends the test."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def list_cluster_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        if not kwargs.get("watch"):
            items = [rollout("a", "llm", "1"), rollout("b", "llm", "2")]
            return _Response({"metadata": {"resourceVersion": "7"}, "items": items})
        if len(self.calls) > 2:
            self.stop.set()
            raise RuntimeError("stop")
        events = [
            {"type": "MODIFIED", "object": rollout("a", "llm", "8")},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
            {"type": "DELETED", "object": rollout("b", "llm", "10")},
        ]
        return _Response(None, events)


class _Kube:
    def __init__(self, stop: threading.Event) -> None:
        self.custom = _Custom(stop)


def test_the_agents_informer_lists_from_the_watch_cache_then_watches() -> None:
    stop = threading.Event()
    kube = _Kube(stop)
    seen: list[list[str]] = []
    informer: Informer

    def on_change() -> None:
        seen.append(sorted(o["metadata"]["resourceVersion"] for o in informer.snapshot()))

    informer = rollout_informer(kube, on_change, stop=stop)  # type: ignore[arg-type]
    informer._run()
    (list_args, listing), (_, watching), (_, again) = kube.custom.calls
    assert list_args == ("weightship.io", "v1alpha1", "modelrollouts")
    assert listing == {"resource_version": "0", "_preload_content": False}  # one, unpaged
    assert watching["watch"] and watching["resource_version"] == "7"
    assert again["resource_version"] == "10"  # a bookmark moves it too
    # Two rollouts of one name in two namespaces are two objects; the bookmark is no change.
    assert seen == [["1", "2"], ["2", "8"], ["8"]]
    assert informer.synced.is_set()
    assert [o["metadata"]["namespace"] for o in informer.snapshot()] == ["a"]


class _QuietWatchServer(http.server.BaseHTTPRequestHandler):
    """A listing, then a watch that sends its headers and one event and goes quiet, as a
    watch of a cluster where nothing changes does."""

    quiet = threading.Event()  # set once the watch has sent its event

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if "watch=true" not in self.path:
            body = json.dumps({"metadata": {"resourceVersion": "1"}, "items": []}).encode()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        line = json.dumps({"type": "ADDED", "object": rollout("a", "llm", "2")}).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()
        _QuietWatchServer.quiet.set()
        self.rfile.read(1)  # until the client goes away

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_stop_ends_a_watch_that_receives_nothing() -> None:
    server = Server(("127.0.0.1", 0), _QuietWatchServer).start("apiserver")
    http_pool = urllib3.PoolManager()
    base = f"http://127.0.0.1:{server.server_address[1]}/nodes"

    def list_fn(**kwargs: Any) -> Any:
        query = "?watch=true" if kwargs.get("watch") else ""
        return http_pool.request("GET", base + query, preload_content=False, timeout=60)

    informer = Informer("nodes", list_fn, lambda obj: {}, page_size=None)
    informer.start()
    try:
        assert _QuietWatchServer.quiet.wait(10), "the watch never started"
        stopping = threading.Thread(target=informer.stop, kwargs={"timeout_s": 30})
        stopping.start()
        # Bounded: the server sends nothing more and the client's read timeout is 60 s,
        # so a stop that waited for the next event (close() blocked behind the read)
        # would still be running.
        stopping.join(20)
        assert not stopping.is_alive(), "stop() waited for the quiet watch"
        assert not informer._thread.is_alive()
    finally:
        server.stop()


def test_relists_after_an_outage_are_spread_over_a_window_that_grows_to_its_cap() -> None:
    """Every watch breaks at once when the API server goes: fixed retries would keep a
    fleet in step, and all of it would relist in the same second of its return."""
    windows = [relist_delay_s(n, 0.999999, base_s=1.0, max_s=30.0) for n in range(1, 9)]
    assert [round(w) for w in windows] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert relist_delay_s(10**6, 0.5, base_s=1.0, max_s=30.0) == 15.0
    # 5,000 agents down long enough to reach the cap: when it returns, their next
    # listings arrive spread over 30 s, none in a second's herd.
    rng = random.Random(7)
    arrivals = Counter(
        int(relist_delay_s(8, rng.random(), base_s=1.0, max_s=30.0)) for _ in range(5000)
    )
    assert max(arrivals) == 29 and max(arrivals.values()) < 230  # about 167 a second
