"""The watch caches' values, the view over them, and read-your-writes (controller/cache.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from weightship.api.names import ROLLOUT_LABEL
from weightship.controller.builders import CACHE_VOLUME
from weightship.controller.cache import (
    ClusterView,
    WriteOverlay,
    index_cache_entries,
    index_node_labels,
    index_pod,
    index_replicaset,
)
from weightship.controller.snapshot import prefetch_observation, replica_set_observations
from weightship.controller.verifier import staged_evidence, termination_messages
from weightship.kube.informer import Informer

OWNER = ("ns", "llm")


def rs(name: str, version: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": version,
            "labels": {ROLLOUT_LABEL: "llm", "weightship.io/revision-hash": name[-3:]},
        },
        "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "x"}]}}},
        "status": {"replicas": replicas},
    }


def test_a_write_masks_the_version_it_was_made_against_until_the_watch_moves_on() -> None:
    overlay = WriteOverlay()
    assert overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "1")])[0]["spec"]["replicas"] == 1
    overlay.record(OWNER, "ReplicaSet", rs("llm-aaa", "2", replicas=3))
    # The watch has not delivered the scale yet: the write's answer stands in.
    assert overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "1")])[0]["spec"]["replicas"] == 3
    # Anything newer from the watch (ours, or the ReplicaSet controller's) wins from now on.
    newer = overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "5", replicas=3)])
    assert newer[0]["metadata"]["resourceVersion"] == "5"
    assert overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "1")])[0]["spec"]["replicas"] == 1


def test_two_writes_in_a_row_the_watch_bringing_the_first_keeps_the_second() -> None:
    overlay = WriteOverlay()
    overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "1")])
    overlay.record(OWNER, "ReplicaSet", rs("llm-aaa", "2", replicas=2))
    overlay.record(OWNER, "ReplicaSet", rs("llm-aaa", "3", replicas=4))
    for cached in ("1", "2"):  # the watch brings the first write, not yet the second
        merged = overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", cached, replicas=2)])
        assert merged[0]["metadata"]["resourceVersion"] == "3"
    # A version this operator did not write wins: the watch has moved past both.
    merged = overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "9", replicas=4)])
    assert merged[0]["metadata"]["resourceVersion"] == "9"


def test_a_created_then_changed_object_stands_in_until_the_watch_brings_the_change() -> None:
    overlay = WriteOverlay()
    overlay.merge(OWNER, "ReplicaSet", [])
    overlay.record(OWNER, "ReplicaSet", rs("llm-bbb", "7", replicas=1))
    overlay.record(OWNER, "ReplicaSet", rs("llm-bbb", "8", replicas=2))
    assert overlay.merge(OWNER, "ReplicaSet", [])[0]["metadata"]["resourceVersion"] == "8"
    created = overlay.merge(OWNER, "ReplicaSet", [rs("llm-bbb", "7", replicas=1)])
    assert created[0]["metadata"]["resourceVersion"] == "8"
    assert overlay.merge(OWNER, "ReplicaSet", [rs("llm-bbb", "8", replicas=2)])[0]["spec"] == {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "x"}]}},
    }


def test_a_created_object_is_seen_before_the_watch_brings_it_and_dropped_once_gone() -> None:
    overlay = WriteOverlay()
    assert overlay.merge(OWNER, "ReplicaSet", []) == []
    overlay.record(OWNER, "ReplicaSet", rs("llm-bbb", "7"))
    assert [r["metadata"]["name"] for r in overlay.merge(OWNER, "ReplicaSet", [])] == ["llm-bbb"]
    assert len(overlay.merge(OWNER, "ReplicaSet", [rs("llm-bbb", "7")])) == 1
    assert overlay.merge(OWNER, "ReplicaSet", []) == []  # seen, then deleted: gone


def test_an_unconfirmed_write_stops_masking_after_its_max_age() -> None:
    now = [0.0]
    overlay = WriteOverlay(max_age_s=10, clock=lambda: now[0])
    overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "1")])
    overlay.record(OWNER, "ReplicaSet", rs("llm-aaa", "2", replicas=3))
    now[0] = 11
    assert overlay.merge(OWNER, "ReplicaSet", [rs("llm-aaa", "1")])[0]["spec"]["replicas"] == 1


def test_trimmed_pods_and_replica_sets_project_like_the_full_objects() -> None:
    pod = {
        "metadata": {
            "name": "llm-aaa-x",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "3",
            "labels": {ROLLOUT_LABEL: "llm", "weightship.io/revision-hash": "aaa"},
            "annotations": {"weightship.io/loaded": '{"source": "cache", "seconds": 1.5}'},
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "server", "image": "x", "env": [{"name": "A"}]}],
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "weightship.io/weights-verified", "status": "True"},
            ],
            "containerStatuses": [{"name": "server", "restartCount": 2, "image": "x"}],
        },
    }
    replica_set = rs("llm-aaa", "1", replicas=2)
    full = replica_set_observations([replica_set], [pod])
    trimmed = replica_set_observations([index_replicaset(replica_set)], [index_pod(pod)])
    assert full == trimmed and trimmed[0].verified == 1 and trimmed[0].loads[0].seconds == 1.5
    assert "managedFields" not in index_pod(pod)["metadata"]
    assert index_pod(pod)["status"]["containerStatuses"] == [
        {"name": "server", "restartCount": 2, "state": {}, "lastState": {}}
    ]


def test_trimmed_pods_keep_what_the_verifier_reads() -> None:
    """checksumMode staged reads the containers' args and cache mount; a refused load is
    read from the termination message (both from the trimmed pod the cache holds)."""
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.32.0",
                    "args": ["$(WEIGHTSHIP_MODEL_DIR)"],
                    "volumeMounts": [
                        {
                            "name": CACHE_VOLUME,
                            "mountPath": "/var/cache/weightship",
                            "readOnly": True,
                        }
                    ],
                }
            ],
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "vllm",
                    "restartCount": 1,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": "refused " * 1000}},
                }
            ],
        },
    }
    trimmed = index_pod(pod)
    evidence = staged_evidence(trimmed, None)
    assert evidence.serves_model_dir and evidence.cache_read_only and evidence.node == "n1"
    (message,) = termination_messages(trimmed)
    assert message.startswith("refused") and len(message) == 4096


def list_nothing(**_: Any) -> Any:
    raise AssertionError("the informer's thread is not started here")


def weight_cache(node: str, *entries: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": node},
        "spec": {"nodeName": node},
        "status": {"manifests": entries},
    }


def test_the_view_reads_a_selector_and_a_digest_on_the_event_loop() -> None:
    caches = [
        weight_cache("n1", {"digest": "sha256:a", "state": "Staged", "bytesDone": 10}),
        weight_cache("n2", {"digest": "sha256:a", "state": "Staging", "bytesDone": 4}),
        weight_cache("n3", {"digest": "sha256:b", "state": "Staged"}),
    ]
    nodes = Informer("nodes", list_nothing, index_node_labels)
    cache_informer = Informer("weightcaches", list_nothing, index_cache_entries)
    indexes: dict[str, dict[Any, list[Any]]] = {
        "rollouts": {OWNER: [{"metadata": {"name": "llm", "namespace": "ns"}}]},
        "rollout_replicasets": {OWNER: [rs("llm-aaa", "1")]},
        "rollout_pods": {},
    }
    view = ClusterView(indexes, nodes, cache_informer)
    assert not view.staging({"gpu": "h100"}, "sha256:a").synced  # nothing listed yet
    nodes.replace_all(
        [
            {"metadata": {"name": "n1", "labels": {"gpu": "h100", "pool": "a"}}},
            {"metadata": {"name": "n2", "labels": {"gpu": "h100", "pool": "b"}}},
            {"metadata": {"name": "n3", "labels": {"gpu": "a100"}}},
        ]
    )
    cache_informer.replace_all(caches)
    nodes.synced.set()
    cache_informer.synced.set()
    # A watch event moves an entry, a deleted cache takes its entries with it.
    cache_informer.put(weight_cache("n3", {"digest": "sha256:b", "state": "Staging"}))
    cache_informer.delete(weight_cache("n4"))
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    try:
        view.loop = loop
        staging = view.staging({"gpu": "h100"}, "sha256:a")
        objects = view.rollout_objects("ns", "llm")
        gone = view.rollout_objects("ns", "other")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()
    assert staging.target_nodes == ["n1", "n2"]
    observed = prefetch_observation("sha256:a", staging.target_nodes, staging.caches)
    expected = prefetch_observation("sha256:a", ["n1", "n2"], caches)
    assert observed == expected and observed.staged_nodes == 1
    assert objects is not None and len(objects.replica_sets) == 1 and objects.pods == []
    assert gone is None
    assert view.node_has_label("n1", "gpu", "h100") and not view.node_has_label("n3", "gpu", "x")
    assert [e["state"] for e in cache_informer.values("sha256:b")] == ["Staging"]


class _Raw:
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()

    def release_conn(self) -> None:
        pass


def test_the_informer_lists_in_pages_then_watches_from_the_listings_version() -> None:
    nodes = [{"metadata": {"name": f"n{i}", "labels": {"gpu": "h100"}}} for i in range(5)]
    calls: list[dict[str, Any]] = []
    informer: Informer

    def list_fn(**kwargs: Any) -> _Raw:
        calls.append(kwargs)
        if kwargs.get("watch"):
            informer._stop.set()  # one watch request is all this test needs
            raise RuntimeError("stop")
        start = int(kwargs["_continue"] or 0)
        end = start + kwargs["limit"]
        meta: dict[str, Any] = {"resourceVersion": "42"}
        if end < len(nodes):
            meta["continue"] = str(end)
        return _Raw({"metadata": meta, "items": nodes[start:end]})

    informer = Informer("nodes", list_fn, index_node_labels, page_size=2, retry_s=0)
    informer._run()
    lists = [c for c in calls if not c.get("watch")]
    assert [(c["limit"], c["_continue"]) for c in lists] == [(2, None), (2, "2"), (2, "4")]
    assert informer.synced.is_set() and len(informer.items()) == 5
    assert calls[-1]["watch"] and calls[-1]["resource_version"] == "42"


def test_node_labels_are_kept_as_shared_strings() -> None:
    first, second = (
        # Strings made at run time, as json.loads makes them: equal, not the same object.
        index_node_labels({"metadata": {"name": n, "labels": {"".join("gpu"): "".join("h100")}}})
        for n in ("a", "b")
    )
    ((key_a, value_a),) = first["a"].items()
    ((key_b, value_b),) = second["b"].items()
    assert key_a is key_b and value_a is value_b
