"""A standby operator takes over: two operator processes with the chart's
`operator.replicas: 2` settings (leader election on a Lease), the leader SIGKILLed in the
middle of a canary's pause. The standby finishes the rollout; no step runs twice, no
ReplicaSet is duplicated, nothing writes the rollout while no one holds the Lease, and the
new leader's writes all come after its acquisition. Then a graceful handover (SIGTERM
releases the Lease).

The takeover times are printed (run with -s), not asserted:

    flock /work/coord/heavy.lock env WEIGHTSHIP_KEEP_CLUSTER=1 \\
        .venv/bin/pytest e2e/test_standby.py -s -q
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from kubernetes import client, watch

from e2e.operator_fixtures import (
    OperatorProcess,
    Rollouts,
    publish_models,
    rollout_body,
    s3_secret,
)
from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERSION
from weightship_dev import testkit
from weightship_dev.install import CHART, helm

NAMESPACE_PREFIX = "sb-"
RELEASE = "ws"
LEASE = f"{RELEASE}-weightship-operator"  # the chart's <fullname>-operator
STEPS: list[dict[str, Any]] = [
    {"setWeight": 50},
    {"pause": {"duration": "20s"}},
    {"setWeight": 100},
    {"pause": {"duration": "1s"}},
]


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("standby")
    s3.create_bucket(Bucket=bucket)
    yield publish_models(
        cluster.s3_endpoint, bucket, tmp_path_factory.mktemp("models"), ["v1", "v2"]
    )
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def chart_operator_env(cluster: Any, lease_namespace: str) -> dict[str, str]:
    """The leader-election settings the chart gives its operator pods at replicas: 2, as
    the environment of a local `weightship operator` (whose args OperatorProcess fixes)."""
    version = client.VersionApi(cluster.api).get_code().git_version
    out = helm(
        cluster.paths, "template", RELEASE, str(CHART), "--namespace", lease_namespace,
        "--kube-version", version, "--set", "operator.replicas=2",
    )  # fmt: skip
    deploy = next(
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
    )
    assert deploy["spec"]["replicas"] == 2
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert "--leader-elect" in container["args"]
    env = {
        e["name"]: e["value"]
        for e in container["env"]
        if e["name"].startswith("WEIGHTSHIP_LEADER_ELECT") and "value" in e
    }
    assert env["WEIGHTSHIP_LEADER_ELECT_LEASE"] == LEASE
    # --leader-elect as its variable; the Lease in POD_NAMESPACE (the release's) as ours.
    return {**env, "WEIGHTSHIP_LEADER_ELECT": "true", "POD_NAMESPACE": lease_namespace}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Seen:
    at: float  # when the watch delivered it (time.time())
    version: int  # resourceVersion (etcd's revision: ordered on this one etcd)
    obj: dict[str, Any]


@dataclass
class Recorder:
    """Every version of one object, from a watch (polling could miss a short-lived one)."""

    list_fn: Callable[..., Any]
    args: tuple[Any, ...]
    name: str
    seen: list[Seen] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Recorder:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        version = ""
        while not self.stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.list_fn,
                    *self.args,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=version or None,
                    timeout_seconds=5,
                ):
                    obj = event["raw_object"]
                    version = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.seen.append(Seen(time.time(), int(version), obj))
                    if self.stop.is_set():
                        break
            except Exception:  # a 410 or a dropped stream: list again from the start
                version = ""
            finally:
                w.stop()

    def first(self, check: Callable[[dict[str, Any]], bool]) -> Seen | None:
        return next((s for s in list(self.seen) if check(s.obj)), None)


def lease_holder(obj: dict[str, Any]) -> str:
    return str((obj.get("spec") or {}).get("holderIdentity") or "")


def reconciled_at(op: OperatorProcess, port: int, namespace: str, name: str) -> float | None:
    """When `op` last reconciled the rollout (its metrics), None before it did once."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    pattern = (
        r"^weightship_rollout_last_reconcile_timestamp_seconds\{"
        rf'(?=[^}}]*namespace="{namespace}")(?=[^}}]*name="{name}")[^}}]*\}} (\S+)$'
    )
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else None


def scraped(port: int) -> dict[str, float]:
    """The weightship_* series of an operator's /metrics, without labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        name: float(value)
        for name, value in re.findall(r"^(weightship_[a-z_]+) (\S+)$", text, re.M)
    }


def step_runs(seen: list[Seen], revision: str) -> list[int]:
    """The canary's step indices in the order they were written, repeats collapsed."""
    runs: list[int] = []
    for s in seen:
        status = s.obj.get("status") or {}
        if (status.get("canaryRevision") or {}).get("revision") != revision:
            continue
        index = status.get("currentStepIndex")
        if index is not None and (not runs or runs[-1] != index):
            runs.append(int(index))
    return runs


def test_standby_takes_over_mid_canary_and_finishes_it(
    cluster: Any, crds: None, namespace: str, models: dict[str, str]
) -> None:
    s3_secret(cluster.core, namespace)
    rollouts = Rollouts(cluster.api, namespace)
    env = chart_operator_env(cluster, namespace)
    ports = {"a": free_port(), "b": free_port()}

    def operator(who: str) -> OperatorProcess:
        return OperatorProcess(
            cluster.paths.admin_kubeconfig,
            cluster.paths.root / f"operator-standby-{who}.log",
            namespaces=(f"{NAMESPACE_PREFIX}*",),
            env={**env, "POD_ID": f"operator-{who}"},
            metrics_port=ports[who],
        )

    leases = client.CoordinationV1Api(cluster.api)
    lease = Recorder(leases.list_namespaced_lease, (namespace,), LEASE).start()
    rollout = Recorder(
        client.CustomObjectsApi(cluster.api).list_namespaced_custom_object,
        (GROUP, VERSION, namespace, ROLLOUT_PLURAL),
        "llm",
    ).start()
    a, b = operator("a"), operator("b")
    try:
        a.start()
        testkit.wait_until(
            lambda: lease.first(lambda o: lease_holder(o) == "operator-a"),
            timeout=60,
            what="operator-a holds the Lease",
            detail=a.tail,
        )
        b.start()
        testkit.wait_until(
            lambda: "standby: Lease" in (b.log_path.read_text(errors="replace")),
            timeout=60,
            what="operator-b waits as a standby",
            detail=b.tail,
        )
        rollouts.create(rollout_body("llm", models["v1"], "v1", STEPS, cluster.s3_endpoint))
        rollouts.healthy_on("llm", "v1")
        rollouts.set_model("llm", models["v2"], "v2")
        paused = rollouts.wait(
            "llm",
            "the canary's timed pause",
            lambda s: (
                (s.get("canaryRevision") or {}).get("revision") == "v2"
                and s.get("currentStepIndex") == 1
                and s.get("canaryWeight") == 50
            ),
        )
        assert reconciled_at(a, ports["a"], namespace, "llm") is not None
        # The standby runs no kopf and no workers; it answers the scrape (no target down)
        # with weightship_operator_leader 0 alone, none of the leader's series.
        assert scraped(ports["a"])["weightship_operator_leader"] == 1.0
        assert scraped(ports["b"]) == {"weightship_operator_leader": 0.0}
        pause_started = paused["status"]["pauseStartTime"]

        killed_at = time.time()
        a.kill()  # SIGKILL to its process group; returns once it is reaped
        after_kill = int(
            client.CustomObjectsApi(cluster.api).list_namespaced_custom_object(
                GROUP, VERSION, namespace, ROLLOUT_PLURAL
            )["metadata"]["resourceVersion"]
        )
        acquired = testkit.wait_until(
            lambda: lease.first(lambda o: lease_holder(o) == "operator-b"),
            timeout=60,
            what="operator-b takes the Lease",
            interval=0.1,
            detail=b.tail,
        )
        first_reconcile = testkit.wait_until(
            lambda: reconciled_at(b, ports["b"], namespace, "llm"),
            timeout=60,
            what="operator-b reconciles the rollout",
            interval=0.1,
            detail=b.tail,
        )
        final = rollouts.healthy_on("llm", "v2", timeout=180)
        finished_at = time.time()

        # A graceful stop releases the Lease: a standby takes it at its next look.
        a = operator("a")
        a.start()
        testkit.wait_until(
            lambda: "standby: Lease" in (a.log_path.read_text(errors="replace")),
            timeout=60,
            what="operator-a waits as a standby",
            detail=a.tail,
        )
        stopping_at = time.time()
        b.stop()
        handed = testkit.wait_until(
            lambda: lease.first(
                lambda o: (
                    lease_holder(o) == "operator-a"
                    and int(o["metadata"]["resourceVersion"]) > acquired.version
                )
            ),
            timeout=60,
            what="operator-a takes the released Lease",
            interval=0.1,
            detail=a.tail,
        )
        handed_reconcile = testkit.wait_until(
            lambda: reconciled_at(a, ports["a"], namespace, "llm"),
            timeout=60,
            what="operator-a reconciles the rollout again",
            interval=0.1,
            detail=a.tail,
        )
        released = lease.first(
            lambda o: (
                not lease_holder(o) and int(o["metadata"]["resourceVersion"]) > acquired.version
            )
        )
    finally:
        a.stop()
        b.stop()
        lease.stop.set()
        rollout.stop.set()

    acquire_time = acquired.obj["spec"]["acquireTime"]
    print(
        "\nstandby takeover after SIGKILL of the leader: "
        f"Lease taken {acquired.at - killed_at:.2f} s, "
        f"first reconcile {first_reconcile - killed_at:.2f} s after the kill "
        f"(acquireTime {acquire_time}); rollout Healthy {finished_at - killed_at:.1f} s after"
        f"\ngraceful handover (SIGTERM): Lease taken {handed.at - stopping_at:.2f} s, "
        f"first reconcile {handed_reconcile - stopping_at:.2f} s after the stop "
        f"(Lease {'released' if released else 'not released: the stop was cut short'})"
    )

    # Nobody writes the rollout while nobody holds the Lease: every write after the kill
    # is the new leader's, after its acquisition (writes of the dead leader, in flight at
    # the kill, land before `after_kill`).
    writes = [s for s in rollout.seen if s.version > after_kill]
    assert writes, "the standby wrote the rollout"
    assert all(s.version > acquired.version for s in writes), [
        (s.version, acquired.version) for s in writes
    ]
    assert acquired.obj["spec"]["leaseTransitions"] >= 1
    versions = [s.version for s in rollout.seen]
    assert versions == sorted(versions)
    generations = [(s.obj.get("status") or {}).get("observedGeneration") or 0 for s in rollout.seen]
    assert generations == sorted(generations), generations

    # No step ran twice: the canary's steps were written in order, each once; the pause
    # went on from where the dead leader started it; each StepCompleted event once.
    assert step_runs(rollout.seen, "v2") == [0, 1, 2, 3], step_runs(rollout.seen, "v2")
    pause_starts = {
        (s.obj.get("status") or {}).get("pauseStartTime")
        for s in rollout.seen
        if (s.obj.get("status") or {}).get("currentStepIndex") == 1
        and ((s.obj.get("status") or {}).get("canaryRevision") or {}).get("revision") == "v2"
    }
    assert pause_starts == {pause_started}, pause_starts
    completed = [e.message for e in rollouts.events("llm") if e.reason == "StepCompleted"]
    assert len(completed) == len(set(completed)), f"a step ran twice: {completed}"
    assert any(m.startswith("step 2/4 completed") for m in completed), completed

    # One ReplicaSet per revision.
    hashes = [rs.metadata.labels[f"{GROUP}/revision-hash"] for rs in rollouts.replicasets("llm")]
    assert len(hashes) == len(set(hashes)) == 2, hashes
    promoted = [h["revision"] for h in final["status"]["history"] if h["outcome"] == "Promoted"]
    assert promoted == ["v1", "v2"]
