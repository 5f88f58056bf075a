"""Pods see only what their rollout pins (issue 20, item 4), end to end: the real agents on
the process nodes keep a view per updatePolicy InPlaceIfPossible rollout, hard-linked to
exactly the models it pins once staged; its pods mount that view read-only and find every
pinned revision there, a later one appearing while they run; a revision no longer pinned
leaves it; another rollout's weights never appear. Uses the `agents` fixture: run under
`flock /work/coord/heavy.lock`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.agent_fixtures import CACHE_DIR, PROCESS, Agents, cache_root
from e2e.operator_fixtures import Rollouts, publish_models, rollout_body
from weightship import rollouts as user_actions
from weightship.api.names import GROUP, ROLLOUT_LABEL, ROLLOUT_PLURAL, VERSION
from weightship.controller.builders import (
    MODEL_VOLUMES,
    VIEW_READY_VOLUME,
    VIEW_VOLUME,
    rollout_view_root,
)
from weightship.data.s3 import S3Location, S3Origin
from weightship_dev import testkit

NAMESPACE_PREFIX = "pv-"
MiB = 1 << 20
# Runs in the pod: reports what its view shows (whenever that changes), then serves as
# the echo server (readiness). `mine`: its own model is there, which it must be from the
# first line on, since the pod may not start before. `write`: the errno of a write.
PROBE = """
import json, os, runpy, sys, threading, time
from pathlib import Path
from weightship.loader.load import locate_staged

cache, digest = Path(os.environ["WEIGHTSHIP_CACHE_DIR"]), os.environ["WEIGHTSHIP_MANIFEST_DIGEST"]

def report():
    last = None
    while True:
        names = sorted(p.name for p in (cache / "models").iterdir())
        try:
            (cache / "models" / "probe").write_text("x")
            write = 0
        except OSError as e:
            write = e.errno
        state = {
            "models": [n for n in names if locate_staged(cache, "sha256:" + n)],
            "mine": locate_staged(cache, digest) is not None,
            "files": sorted(os.listdir(os.environ["WEIGHTSHIP_MODEL_DIR"])),
            "write": write,
        }
        if state != last:
            print("VIEW " + json.dumps(state), flush=True)
            last = state
        time.sleep(0.3)

threading.Thread(target=report, daemon=True).start()
sys.argv = ["echoserver"]
runpy.run_module("weightship_dev.echoserver", run_name="__main__")
"""
EROFS = 30


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("pv")
    s3.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("pv")
    yield publish_models(cluster.s3_endpoint, bucket, root, ["v1", "v2", "other"], size=3 * MiB)
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def digest_of(cluster: Any, uri: str) -> str:
    s3 = testkit.local_s3(cluster.s3_endpoint)
    return S3Origin(s3, S3Location.parse(uri)).read_manifest().digest


def body(cluster: Any, name: str, uri: str, revision: str, **canary: Any) -> dict[str, Any]:
    out = rollout_body(name, uri, revision, [{"setWeight": 100}], cluster.s3_endpoint, 1, **canary)
    out["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    return out


def shown(cluster: Any, node: str, uid: str) -> set[str]:
    """The digests a node's view of rollout ``uid`` shows (STAGED written)."""
    models = cache_root(cluster, node) / "views" / uid / "models"
    if not models.is_dir():
        return set()
    return {"sha256:" + p.name for p in models.iterdir() if (p / "STAGED").is_file()}


def views_on(cluster: Any, node: str) -> set[str]:
    views = cache_root(cluster, node) / "views"
    return (
        {p.name for p in views.iterdir() if not p.name.startswith(".")} if views.is_dir() else set()
    )


def pods(cluster: Any, namespace: str, rollout: str) -> list[Any]:
    return [
        p
        for p in cluster.core.list_namespaced_pod(
            namespace, label_selector=f"{ROLLOUT_LABEL}={rollout}"
        ).items
        if p.metadata.deletion_timestamp is None
    ]


def reports(cluster: Any, pod: Any) -> list[dict[str, Any]]:
    """The VIEW lines the probe printed, in order."""
    log = (
        Path(cluster.paths.root)
        / "nodes"
        / pod.spec.node_name
        / "logs"
        / f"{pod.metadata.namespace}_{pod.metadata.name}_server.log"
    )
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return [json.loads(line[5:]) for line in lines if line.startswith("VIEW ")]


def wait_views(cluster: Any, uid: str, want: set[str], never: set[str], what: str) -> None:
    def check() -> bool:
        for node in cluster.process_nodes:
            found = shown(cluster, node, uid)
            assert not found & never, f"{node}: the view of {uid} shows {found & never}"
        return all(shown(cluster, n, uid) == want for n in cluster.process_nodes)

    testkit.wait_until(
        check,
        timeout=90,
        what=what,
        detail=lambda: str({n: shown(cluster, n, uid) for n in cluster.process_nodes}),
    )


def wait_pod_sees(cluster: Any, pod: Any, hexes: list[str], what: str) -> dict[str, Any]:
    def seen() -> dict[str, Any] | None:
        found = reports(cluster, pod)
        return found[-1] if found and found[-1]["models"] == hexes else None

    return testkit.wait_until(
        seen, timeout=60, what=what, detail=lambda: str(reports(cluster, pod)[-3:])
    )


def test_pods_see_only_what_their_rollout_pins(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    v1, v2, other = (digest_of(cluster, models[k]) for k in ("v1", "v2", "other"))
    hex1, hex2 = v1.removeprefix("sha256:"), v2.removeprefix("sha256:")
    ns = rollouts.namespace
    # An in-place rollout whose pods run the probe, and a Recreate one beside it.
    mine = body(cluster, "inplace", models["v1"], "v1", updatePolicy="InPlaceIfPossible")
    server = mine["spec"]["template"]["spec"]["containers"][0]
    server["command"] = ["python3", "-c", PROBE]
    uid = rollouts.create(mine)["metadata"]["uid"]
    theirs = rollouts.create(body(cluster, "plain", models["other"], "other"))["metadata"]["uid"]

    # 1. The view shows the pinned model once staged; the other rollout's never, and the
    #    Recreate rollout has no view at all.
    agents.wait_staged(v1)
    agents.wait_staged(other)
    wait_views(cluster, uid, {v1}, {other}, "the in-place view shows v1")
    for node in cluster.process_nodes:
        assert views_on(cluster, node) == {uid}, f"{node}: a view other than the in-place one"
        view = cache_root(cluster, node) / "views" / uid
        assert sorted(p.name for p in view.iterdir()) == ["models", "ready"]
        staged = cache_root(cluster, node) / "models" / hex1 / "files" / "model.safetensors"
        linked = view / "models" / hex1 / "files" / "model.safetensors"
        assert linked.stat().st_ino == staged.stat().st_ino, "a hard link, not a copy"
    rollouts.healthy_on("inplace", "v1")
    rollouts.healthy_on("plain", "other")

    # 2. Its pod mounts the view and its revision's receipt, read-only, nothing else of
    #    the node; the Recreate pod keeps its model's three mounts.
    (pod,) = pods(cluster, ns, "inplace")
    view_root = rollout_view_root(CACHE_DIR, uid)
    host = {v.name: v.host_path for v in pod.spec.volumes if v.host_path is not None}
    assert {n: (h.path, h.type) for n, h in host.items()} == {
        VIEW_VOLUME: (view_root, "Directory"),
        VIEW_READY_VOLUME: (f"{view_root}/ready/{hex1}", "File"),
    }
    assert all(m.read_only for m in pod.spec.containers[0].volume_mounts if m.name in host)
    (plain_pod,) = pods(cluster, ns, "plain")
    assert {v.name for v in plain_pod.spec.volumes if v.host_path is not None} == set(MODEL_VOLUMES)
    first = wait_pod_sees(cluster, pod, [hex1], "the in-place pod sees v1 in its view")
    assert reports(cluster, pod)[0]["mine"], "the pod started before its view showed its model"
    assert first["files"] == ["model.safetensors"] and first["write"] == EROFS

    # 3. A second revision (a new pod template too: replaced, not swapped, since the probe
    #    cannot swap) appears in the view once staged, beside the first while both are
    #    pinned, and the running pod sees it appear without a restart.
    env = [{"name": "PROBE_REVISION", "value": "v2"}]
    rollouts.patch_spec(
        "inplace",
        {
            "model": {"source": {"uri": models["v2"]}, "revision": "v2"},
            "strategy": {"canary": {"steps": [{"setWeight": 50}, {"pause": {}}]}},
            "template": {
                **mine["spec"]["template"],
                "spec": {
                    **mine["spec"]["template"]["spec"],
                    "containers": [{**server, "env": [*server.get("env", []), *env]}],
                },
            },
        },
    )
    rollouts.wait_phase("inplace", "Paused", timeout=120)
    wait_views(cluster, uid, {v1, v2}, {other}, "the view shows v1 and v2")
    seen = wait_pod_sees(cluster, pod, sorted([hex1, hex2]), "the v1 pod sees v2 appear")
    assert seen["write"] == EROFS
    assert pod.metadata.uid in {p.metadata.uid for p in pods(cluster, ns, "inplace")}
    (canary,) = [p for p in pods(cluster, ns, "inplace") if p.metadata.uid != pod.metadata.uid]
    wait_pod_sees(cluster, canary, sorted([hex1, hex2]), "the canary pod sees both")
    assert reports(cluster, canary)[0]["mine"], "the canary pod started before v2 was shown"
    assert {v.host_path.path for v in canary.spec.volumes if v.host_path is not None} == {
        view_root,
        f"{view_root}/ready/{hex2}",
    }

    # 4. Promoted: v1 is no longer pinned (replica-ratio routing keeps no retiring
    #    revision), so it leaves the view; its staged copy is the store's alone again.
    user_actions.promote(cluster.api, ns, "inplace")
    rollouts.healthy_on("inplace", "v2", timeout=120)
    # v1 leaves once the agents see the promotion, which may come after healthy.
    wait_views(cluster, uid, {v2}, {other}, "the view shows v2 alone")
    wait_pod_sees(cluster, canary, [hex2], "the v2 pod no longer sees v1")
    for node in cluster.process_nodes:
        assert views_on(cluster, node) == {uid} and theirs not in views_on(cluster, node)
        view = cache_root(cluster, node) / "views" / uid
        assert {p.name for p in (view / "models").iterdir()} == {hex2}
        assert (view / "ready" / hex1).is_file(), "v1's receipt stays for pods born on it"
        staged = cache_root(cluster, node) / "models" / hex1 / "files" / "model.safetensors"
        if staged.exists():  # not evicted (no need): no view holds a link to it any more
            assert staged.stat().st_nlink == 1

    # 5. The rollout gone, its view goes.
    client.CustomObjectsApi(cluster.api).delete_namespaced_custom_object(
        GROUP, VERSION, ns, ROLLOUT_PLURAL, "inplace"
    )
    testkit.wait_until(
        lambda: all(uid not in views_on(cluster, n) for n in cluster.process_nodes),
        timeout=60,
        what="the deleted rollout's view removed",
    )
