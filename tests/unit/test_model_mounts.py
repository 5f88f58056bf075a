"""Rollout pods mount nothing of a node but their own model, read-only (issue 12, High 3).

The node cache directory is install-time configuration (the operator's
WEIGHTSHIP_CACHE_DIR, the chart's agent.cacheDir); a rollout cannot choose a host path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from weightship.api.models import ModelRollout
from weightship.api.samples import VALID_MANIFEST
from weightship.controller.builders import replicaset_body

HEX = "ab" * 32
DIGEST = f"sha256:{HEX}"
CACHE_DIR = "/mnt/nvme/ws"


def rollout(**prefetch: Any) -> ModelRollout:
    body = copy.deepcopy(VALID_MANIFEST)
    body["metadata"] = {"name": "llm", "namespace": "serving", "uid": "u1"}
    body["spec"]["prefetch"] = {**body["spec"].get("prefetch", {}), **prefetch}
    return ModelRollout.from_body(body)


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
