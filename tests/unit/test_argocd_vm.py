"""The Argo CD health check, discovery and actions in argocd/, run by Argo CD's own Lua VM.

`argocd-lua` (hack/argocd-lua, built by `hack/deps.sh argocd-lua` into the binary cache) is a
few lines of Go around github.com/argoproj/argo-cd/v3/util/lua and gitops-engine's health
entry point: the same sandbox, JSON decoding, "Pending deletion" short cut and cleaning of
returned objects as Argo CD itself. The lupa tests (test_argocd_lua.py) stay for what a
real clock cannot show (a frozen os.date); this file is the word of Argo CD.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.unit.test_argocd_lua import ACTION_TESTS, ACTIONS, ARGOCD, HEALTH_TESTS, load, run_file

from weightship_dev.layout import bin_dir

ARGOCD_LUA = bin_dir() / "argocd-lua"
HEALTH = (ARGOCD / "health.lua").read_text()
DISCOVERY = (ACTIONS / "discovery.lua").read_text()
SAMPLES = sorted(ARGOCD.glob("testdata/*.yaml"))


def argocd(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run cases through Argo CD's VM in one process; each answer is result or error."""
    if not ARGOCD_LUA.exists():
        pytest.fail(f"{ARGOCD_LUA} is missing: run `bash hack/deps.sh argocd-lua` (make deps)")
    done = subprocess.run(
        [str(ARGOCD_LUA)], input=json.dumps(cases), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    answers: list[dict[str, Any]] = json.loads(done.stdout)
    assert len(answers) == len(cases)
    return answers


def one(kind: str, script: str, obj: dict[str, Any]) -> Any:
    (answer,) = argocd([{"kind": kind, "script": script, "object": obj}])
    assert "error" not in answer, answer["error"]
    return answer["result"]


def test_health_of_every_sample_is_as_expected_and_as_lupa_says() -> None:
    expected = {(ARGOCD / c["inputPath"]).resolve(): c["healthStatus"] for c in HEALTH_TESTS}
    answers = argocd([{"kind": "health", "script": HEALTH, "object": load(p)} for p in SAMPLES])
    for path, answer in zip(SAMPLES, answers, strict=True):
        assert "error" not in answer, f"{path.name}: {answer['error']}"
        assert answer["result"] == run_file(ARGOCD / "health.lua", load(path)), path.name
        if path.resolve() in expected:
            assert answer["result"] == expected[path.resolve()], path.name


@pytest.mark.parametrize("case", ACTION_TESTS["discoveryTests"], ids=lambda c: c["inputPath"])
def test_discovery(case: dict[str, Any]) -> None:
    got = one("discovery", DISCOVERY, load(ACTIONS / case["inputPath"]))
    # Argo CD's ResourceAction omits `disabled` when false.
    normalized = sorted(({"disabled": False, **a} for a in got), key=lambda a: a["name"])
    assert normalized == sorted(case["result"], key=lambda a: a["name"])


@pytest.mark.parametrize(
    "case",
    ACTION_TESTS["actionTests"],
    ids=lambda c: f"{c['action']}:{Path(c['inputPath']).stem}",
)
def test_action_writes_the_intended_status_control_patch(case: dict[str, Any]) -> None:
    before = load(ACTIONS / case["inputPath"])
    script = (ACTIONS / case["action"] / "action.lua").read_text()
    started = datetime.now(UTC).replace(microsecond=0)
    (impacted,) = one("action", script, copy.deepcopy(before))
    assert impacted["operation"] == "patch"
    after = impacted["object"]
    field = "promote" if case["action"].startswith("promote") else case["action"]
    request = after["status"]["control"][field]
    # The one thing a real clock changes: the request token is now, in RFC 3339.
    token = request["requestedAt"]
    stamp = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)(-\d+)?", token)
    assert stamp, token
    at = datetime.fromisoformat(stamp[1])
    assert started - timedelta(seconds=1) <= at <= datetime.now(UTC) + timedelta(seconds=1)
    expected = load(ACTIONS / case["expectedOutputPath"])
    expected_request = expected["status"]["control"][field]
    expected_request["requestedAt"] = token
    assert request.get("acknowledged") != token  # pending for the controller
    assert after == expected


def test_actions_fail_in_argocd_without_require_os() -> None:
    """The bug Argo CD users hit (a global `os` does not exist there): guard the sandbox."""
    (answer,) = argocd(
        [{"kind": "action", "script": 'obj.x = os.date("!%Y"); return obj', "object": {}}]
    )
    assert "attempt to index a non-table object(nil) with key 'date'" in answer["error"]


def test_deleting_rollout_is_pending_deletion_without_the_script() -> None:
    obj = load(ARGOCD / "testdata" / "healthy.yaml")
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    assert one("health", HEALTH, obj) == {"status": "Progressing", "message": "Pending deletion"}


def test_null_list_entries_are_dropped_before_the_script_sees_them() -> None:
    """Argo CD drops null entries of lists; the lupa harness does the same."""
    obj = load(ARGOCD / "testdata" / "degraded_aborted.yaml")
    obj["status"]["conditions"] = [None, *obj["status"]["conditions"], None]
    assert one("health", HEALTH, obj) == run_file(ARGOCD / "health.lua", obj)
    assert one("health", HEALTH, obj)["status"] == "Degraded"


@pytest.mark.parametrize("generation", ["1e1", "10\r", "ten"])
def test_odd_generation_strings_read_as_no_generation(generation: str) -> None:
    """gopher-lua's tonumber answers nil for these: health must still be a valid answer."""
    obj = load(ARGOCD / "testdata" / "healthy.yaml")
    obj["metadata"]["generation"] = generation
    health = one("health", HEALTH, obj)
    assert health["status"] in {"Healthy", "Progressing", "Degraded", "Suspended"}
    assert yaml.safe_dump(health)
