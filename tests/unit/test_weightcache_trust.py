"""Readers trust a WeightCache only for the node it is named after."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from weightship.agent.desired import cache_node, live_peers, staged_on
from weightship.controller.cache import caches_for, index_cache_entries
from weightship.controller.snapshot import prefetch_observation


def cache(name: str, node: str | None, state: str) -> dict[str, Any]:
    spec = {} if node is None else {"nodeName": node}
    manifests = [{"digest": "sha256:a", "state": state, "bytesDone": 5, "bytesTotal": 5}]
    return {"metadata": {"name": name}, "spec": spec, "status": {"manifests": manifests}}


def test_a_weightcache_naming_another_node_is_ignored() -> None:
    # n2's agent (or anyone able to write n2's object) claims n1 is staged.
    caches = [cache("n1", "n1", "Staging"), cache("n2", "n1", "Staged")]
    observed = prefetch_observation("sha256:a", ["n1", "n2"], caches)
    states = {n.name: n.state for n in observed.nodes}
    assert states == {"n1": "Staging", "n2": "Pending"}


def test_the_operators_cache_index_ignores_a_weightcache_naming_another_node() -> None:
    """The informer path: entries indexed from n2's object claiming n1 mark nobody Staged."""
    caches = [
        cache("n1", "n1", "Staging"),
        cache("n2", "n1", "Staged"),  # n2 speaking for n1
        cache("n3", None, "Staged"),
    ]
    entries = [e for body in caches for e in index_cache_entries(body).values()]
    observed = prefetch_observation("sha256:a", ["n1", "n2", "n3"], caches_for(entries))
    states = {n.name: n.state for n in observed.nodes}
    assert states == {"n1": "Staging", "n2": "Pending", "n3": "Staged"}


def test_a_weightcache_without_a_node_name_speaks_for_its_name() -> None:
    observed = prefetch_observation("sha256:a", ["n1"], [cache("n1", None, "Staged")])
    assert [n.state for n in observed.nodes] == ["Staged"]


def peer_cache(name: str, node: str | None, endpoint: str, staged: str) -> dict[str, Any]:
    body = cache(name, node, "Staged")
    body["status"]["manifests"][0]["digest"] = staged
    body["status"].update(peerEndpoint=endpoint, updatedAt="2026-01-01T00:00:00Z")
    return body


def test_agents_ignore_a_weightcache_that_names_another_node() -> None:
    """The agents' readers (peers and who holds a model) trust metadata.name, as the
    operator does: n2's object claiming to be n1 repoints nobody and stages nothing."""
    now = datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)
    caches = [
        peer_cache("n1", "n1", "10.0.0.1:8479", "sha256:b"),
        peer_cache("n2", "n1", "10.6.6.6:8479", "sha256:a"),  # n2 speaking for n1
        peer_cache("n3", None, "10.0.0.3:8479", "sha256:a"),
    ]
    assert live_peers(caches, "me", now, 180) == [("n1", "10.0.0.1:8479"), ("n3", "10.0.0.3:8479")]
    assert staged_on(caches, "sha256:a") == {"n3"}
    assert cache_node(caches[1]) is None and cache_node(caches[2]) == "n3"
