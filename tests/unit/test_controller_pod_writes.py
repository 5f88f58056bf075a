"""Kube.patch_pod_conditions: many pods at once, one pod's writes in order, no error lost."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest
from kubernetes import client

from weightship.controller.kube import POD_WRITERS, Kube, PodConditionWrite


class RecordingCore:
    """Stands in for CoreV1Api's one pod status write (a unit test of one function)."""

    def __init__(self, fail: str | None) -> None:
        self.fail = fail
        self.lock = threading.Lock()
        self.writes: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        self.in_flight = 0
        self.most_in_flight = 0
        self.all_started = threading.Barrier(POD_WRITERS, timeout=10)

    def patch_namespaced_pod_status(self, name: str, namespace: str, patch: Any) -> Any:
        reason = patch["status"]["conditions"][0]["reason"]
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.threads.add(threading.current_thread().name)
        if reason == "first":
            self.all_started.wait()  # every writer busy at once, or this times out
        with self.lock:
            self.in_flight -= 1
            self.writes.append((name, reason))
        if name == self.fail:
            raise RuntimeError(f"{name} refused")
        return {"metadata": {"name": name, "namespace": namespace}}


def recording_kube(fail: str | None = None) -> tuple[Kube, RecordingCore]:
    kube, core = Kube(client.ApiClient()), RecordingCore(fail)
    kube.core = cast(Any, core)
    return kube, core


def write(pod: str, reason: str) -> PodConditionWrite:
    return PodConditionWrite(pod, {"type": "t", "status": "False", "reason": reason})


def test_pods_are_written_at_once_and_each_pods_writes_in_order() -> None:
    kube, core = recording_kube()
    pods = [f"p{i}" for i in range(3 * POD_WRITERS)]
    firsts = [write(p, "first") for p in pods[:POD_WRITERS]]
    rest = [write(p, "gate") for p in pods]
    kube.patch_pod_conditions("ns", [*firsts, *rest, *(write(p, "drain") for p in pods)])
    assert core.most_in_flight == POD_WRITERS
    for pod in pods:
        reasons = [reason for name, reason in core.writes if name == pod]
        assert reasons == (["first"] if pod in pods[:POD_WRITERS] else []) + ["gate", "drain"]


def test_a_failed_write_is_raised_after_the_others_are_tried() -> None:
    kube, core = recording_kube(fail="p1")
    with pytest.raises(RuntimeError, match="p1 refused"):
        kube.patch_pod_conditions("ns", [write(f"p{i}", "gate") for i in range(20)])
    assert sorted(name for name, _ in core.writes) == sorted(f"p{i}" for i in range(20))


def test_one_pod_is_written_on_the_callers_thread() -> None:
    kube, core = recording_kube()
    kube.patch_pod_conditions("ns", [write("only", "gate"), write("only", "drain")])
    assert core.writes == [("only", "gate"), ("only", "drain")]
    assert core.threads == {threading.current_thread().name}
