"""Readers trust a WeightCache only for the node it is named after."""

from __future__ import annotations

from typing import Any

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


def test_a_weightcache_without_a_node_name_speaks_for_its_name() -> None:
    observed = prefetch_observation("sha256:a", ["n1"], [cache("n1", None, "Staged")])
    assert [n.state for n in observed.nodes] == ["Staged"]
