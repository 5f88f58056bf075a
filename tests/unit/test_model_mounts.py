"""Rollout pods mount nothing of a node but their own model, read-only (issue 12, High 3),
or with updatePolicy InPlaceIfPossible their rollout's view: the models that rollout pins,
and nothing else (issue 20).

The node cache directory is install-time configuration (the operator's
WEIGHTSHIP_CACHE_DIR, the chart's agent.cacheDir); a rollout cannot choose a host path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from weightship.api.models import ModelRollout
from weightship.controller.builders import (
    VIEW_READY_VOLUME,
    VIEW_VOLUME,
    mounts_view,
    pod_model_dir,
    replicaset_body,
    rollout_view_root,
)
from weightship.controller.verifier import staged_evidence
from weightship_testing.samples import VALID_MANIFEST

HEX = "ab" * 32
DIGEST = f"sha256:{HEX}"
CACHE_DIR = "/mnt/nvme/ws"
UID = "3f2c6a1e-8d4b-4e9a-b7c5-0a1b2c3d4e5f"


def rollout(*, policy: str | None = None, uid: str = "u1", **prefetch: Any) -> ModelRollout:
    body = copy.deepcopy(VALID_MANIFEST)
    body["metadata"] = {"name": "llm", "namespace": "serving", "uid": uid}
    body["spec"]["prefetch"] = {**body["spec"].get("prefetch", {}), **prefetch}
    if policy:
        body["spec"]["strategy"]["canary"]["updatePolicy"] = policy
    return ModelRollout.from_body(body)


def in_place(**prefetch: Any) -> ModelRollout:
    return rollout(policy="InPlaceIfPossible", uid=UID, **prefetch)


def pod_spec(r: ModelRollout, template: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    assert r.spec.template is not None
    rs = replicaset_body(
        r,
        template=template or r.spec.template.to_k8s(),
        revision_hash="abc123",
        manifest_digest=kw.pop("digest", DIGEST),
        replicas=1,
        require_staged=True,
        cache_dir=CACHE_DIR,
        **kw,
    )
    spec: dict[str, Any] = rs["spec"]["template"]["spec"]
    return spec


def test_a_pod_mounts_only_its_models_files_read_only() -> None:
    spec = pod_spec(rollout())
    host = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    root = f"{CACHE_DIR}/models/{HEX}"
    assert sorted((h["path"], h["type"]) for h in host.values()) == [
        (f"{root}/STAGED", "File"),  # exists only once every chunk was verified
        (f"{root}/files", "Directory"),
        (f"{root}/manifest.json", "File"),
    ]
    for container in spec["containers"]:
        mounts = [m for m in container["volumeMounts"] if m["name"] in host]
        assert len(mounts) == len(host)
        for mount in mounts:
            assert mount["readOnly"] is True
            assert mount["mountPath"] == host[mount["name"]]["path"]  # the path it has there
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["WEIGHTSHIP_CACHE_DIR"] == CACHE_DIR
        assert env["WEIGHTSHIP_MODEL_DIR"] == f"{root}/files"


def test_a_template_cannot_smuggle_a_host_path_under_the_models_volume_names() -> None:
    r = rollout()
    assert r.spec.template is not None
    template = r.spec.template.to_k8s()
    template["spec"]["volumes"] = [
        {"name": "weightship-cache", "hostPath": {"path": "/", "type": "Directory"}}
    ]
    spec = pod_spec(r, template)
    paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert "/" not in paths and len(paths) == 3


def test_without_prefetch_nothing_of_the_node_is_mounted() -> None:
    spec = pod_spec(rollout(enabled=False))
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    # ...nor named: a server told of a cache path it was not given would read whatever a
    # node leaves there (on process nodes: the host's own /var/cache) instead of its origin.
    names = {e["name"] for c in spec["containers"] for e in c.get("env") or []}
    assert "WEIGHTSHIP_MANIFEST_DIGEST" in names
    assert not names & {"WEIGHTSHIP_CACHE_DIR", "WEIGHTSHIP_MODEL_DIR"}


@pytest.mark.parametrize("digest", [f"sha256:{HEX}\n", "sha256:../../etc", f"sha256:{HEX}/.."])
def test_a_digest_that_is_not_hex_never_becomes_a_host_path(digest: str) -> None:
    with pytest.raises(ValueError, match="not a sha256 manifest digest"):
        pod_spec(rollout(), digest=digest)


def test_a_stored_cache_path_is_ignored() -> None:
    """Admission refuses cachePath (e2e/test_admission); a rollout stored before the upgrade
    keeps the old default unchanged (ratcheting), and it changes nothing at run time."""
    spec = pod_spec(rollout(cachePath="/"))
    paths = [v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v]
    assert len(paths) == 3 and all(p.startswith(f"{CACHE_DIR}/models/{HEX}/") for p in paths)


def test_an_in_place_pod_mounts_its_rollouts_view_and_nothing_else() -> None:
    spec = pod_spec(in_place())
    view = f"{CACHE_DIR}/views/{UID}"
    assert rollout_view_root(CACHE_DIR, UID) == view
    host = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert host == {
        VIEW_VOLUME: {"path": view, "type": "Directory"},
        # Its revision's receipt, written once the view shows the model: the pod waits.
        VIEW_READY_VOLUME: {"path": f"{view}/ready/{HEX}", "type": "File"},
    }
    for container in spec["containers"]:
        mounts = [m for m in container["volumeMounts"] if m["name"] in host]
        assert [m["name"] for m in mounts] == [VIEW_VOLUME, VIEW_READY_VOLUME]  # parent first
        for mount in mounts:
            assert mount["readOnly"] is True
            assert mount["mountPath"] == host[mount["name"]]["path"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        # locate_staged(WEIGHTSHIP_CACHE_DIR, digest) finds every revision the view shows.
        assert env["WEIGHTSHIP_CACHE_DIR"] == view
        assert env["WEIGHTSHIP_MODEL_DIR"] == f"{view}/models/{HEX}/files"
        assert env["WEIGHTSHIP_MANIFEST_DIGEST"] == DIGEST
    assert not any(p["path"].startswith(f"{CACHE_DIR}/models") for p in host.values())


def test_recreate_rollouts_keep_their_three_mounts() -> None:
    for r in (rollout(), rollout(policy="Recreate", uid=UID)):
        spec = pod_spec(r)
        paths = sorted(v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v)
        root = f"{CACHE_DIR}/models/{HEX}"
        assert paths == [f"{root}/STAGED", f"{root}/files", f"{root}/manifest.json"]


def test_an_in_place_rollout_without_prefetch_mounts_nothing() -> None:
    spec = pod_spec(in_place(enabled=False))
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    names = {e["name"] for c in spec["containers"] for e in c.get("env") or []}
    assert not names & {"WEIGHTSHIP_CACHE_DIR", "WEIGHTSHIP_MODEL_DIR"}


@pytest.mark.parametrize("uid", ["u1", "../../..", "", UID.upper(), UID + "/.."])
def test_a_uid_that_is_not_a_uuid_never_becomes_a_host_path(uid: str) -> None:
    with pytest.raises(ValueError, match="not a UUID"):
        pod_spec(rollout(policy="InPlaceIfPossible", uid=uid))


def test_a_template_cannot_smuggle_a_host_path_under_the_view_names() -> None:
    r = in_place()
    assert r.spec.template is not None
    template = r.spec.template.to_k8s()
    template["spec"]["volumes"] = [
        {"name": VIEW_VOLUME, "hostPath": {"path": "/", "type": "Directory"}},
        {"name": "weightship-staged", "hostPath": {"path": "/etc", "type": "Directory"}},
    ]
    template["spec"]["containers"][0]["volumeMounts"] = [
        {"name": VIEW_VOLUME, "mountPath": "/host"},
        {"name": "weightship-staged", "mountPath": "/etc-of-the-node"},
    ]
    spec = pod_spec(r, template)
    paths = sorted(v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v)
    assert paths == [f"{CACHE_DIR}/views/{UID}", f"{CACHE_DIR}/views/{UID}/ready/{HEX}"]
    mounts = spec["containers"][0]["volumeMounts"]
    assert {m["mountPath"] for m in mounts} == set(paths)


def test_the_verifier_reads_the_view_mount_as_the_node_cache() -> None:
    r = in_place()
    spec = pod_spec(r)
    pod = {"metadata": {"name": "p"}, "spec": {**spec, "nodeName": "n1"}}
    assert mounts_view(pod) and not mounts_view({"spec": pod_spec(rollout())})
    model_dir = pod_model_dir(CACHE_DIR, DIGEST, view_uid=UID)
    assert model_dir == f"{CACHE_DIR}/views/{UID}/models/{HEX}/files"
    pod["spec"]["containers"][0]["args"] = [model_dir]
    evidence = staged_evidence(pod, model_dir)
    assert evidence.cache_read_only and evidence.serves_model_dir
    pod["spec"]["containers"][0]["volumeMounts"][-1]["readOnly"] = False
    assert not staged_evidence(pod, model_dir).cache_read_only
