"""The shared list-then-watch cache as the agent uses it: ModelRollouts of every namespace,
listed once from the watch cache, then watched; `on_change` after the list and each event."""

from __future__ import annotations

import json
import threading
from typing import Any

from weightship.agent.kube import rollout_informer
from weightship.kube.informer import Informer


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
