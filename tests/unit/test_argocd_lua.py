"""The Argo CD health check and actions in argocd/, run the way Argo CD runs them.

Argo CD runs custom Lua in gopher-lua (Lua 5.1) with only the base, table and package
libraries and a safe `os` (time, date) reachable only through require("os"), sets the object
as the global `obj`, and encodes the returned table to JSON (util/lua/lua.go). lupa's Lua 5.1
runtime is put in the same sandbox; test_argocd_vm.py runs the scripts in Argo CD's own VM.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

from weightship.api.models import ModelRollout
from weightship.api.status import PHASES, ControlStatus
from weightship.core.phase import argocd_health

ARGOCD = Path(__file__).resolve().parents[2] / "argocd"
ACTIONS = ARGOCD / "actions"
FROZEN = datetime(2026, 1, 1, 12, 40, tzinfo=UTC)
HEALTH_TESTS = yaml.safe_load((ARGOCD / "health_test.yaml").read_text())["tests"]
ACTION_TESTS = yaml.safe_load((ACTIONS / "action_test.yaml").read_text())
# strftime flags of Argo CD's os.date (util/lua/oslib_safe.go) that the scripts may use.
DATE_FLAGS = {"Y": "%Y", "m": "%m", "d": "%d", "H": "%H", "M": "%M", "S": "%S", "X": "%H:%M:%S"}


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def os_date(now: datetime) -> Any:
    def date(fmt: str = "%c", *_: Any) -> str:
        fmt = fmt.removeprefix("!")  # UTC; the clock is UTC already
        return re.sub(r"%(.)", lambda m: now.strftime(DATE_FLAGS.get(m[1], "%%" + m[1])), fmt)

    return date


def to_lua(lua: Any, value: Any) -> Any:
    """JSON-like Python value -> Lua value, as Argo CD's decodeValue does (null = absent,
    null list entries dropped)."""
    if isinstance(value, dict):
        return lua.table_from({k: to_lua(lua, v) for k, v in value.items() if v is not None})
    if isinstance(value, list):
        return lua.table_from([to_lua(lua, v) for v in value if v is not None])
    return value


def from_lua(value: Any) -> Any:
    """Lua value -> JSON-like Python value, as gopher-json encodes it: a table with keys 1..n
    is an array, an empty table is an empty array, any other table an object."""
    if lua51.lua_type(value) != "table":
        return value
    items = {k: from_lua(v) for k, v in value.items()}
    if list(items) == list(range(1, len(items) + 1)):
        return list(items.values())
    assert all(isinstance(k, str) for k in items), f"non-string keys: {list(items)}"
    return items


def clean_returned(new: Any, old: Any) -> Any:
    """Argo CD's cleanReturnedObj: an empty array where the input had an object is an object."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: clean_returned(v, old[k]) if k in old else v for k, v in new.items()}
    if isinstance(new, list) and isinstance(old, dict) and not new:
        return {}
    if isinstance(new, list) and isinstance(old, list):
        return [clean_returned(n, o) for n, o in zip(new, old, strict=False)] + new[len(old) :]
    return new


def run(script: str, obj: dict[str, Any] | None, now: datetime = FROZEN) -> Any:
    """Run a script in a fresh sandboxed Lua 5.1 state, as Argo CD does for every call."""
    lua = lua51.LuaRuntime()
    lua.execute('getmetatable("").__index = nil')  # no string methods without the string lib
    g = lua.globals()
    for lib in ("string", "math", "io", "debug", "coroutine", "dofile", "loadfile"):
        g[lib] = None
    # Argo CD has no global `os`: its safe os module (time, date) comes only through
    # require("os") (util/lua/lua.go preloads it; OpenSafeOs registers it elsewhere).
    g.os = None
    safe_os = lua.table_from({"date": os_date(now), "time": lambda *_: int(now.timestamp())})
    lua.execute(
        "local safe_os = ...; package.loaded.os = nil;"
        " package.preload.os = function() return safe_os end",
        safe_os,
    )
    if obj is not None:
        g.obj = to_lua(lua, obj)
    return from_lua(lua.execute(script))


def run_file(path: Path, obj: dict[str, Any], now: datetime = FROZEN) -> Any:
    return run(path.read_text(), obj, now)


def run_action(name: str, obj: dict[str, Any], now: datetime = FROZEN) -> dict[str, Any]:
    out = run_file(ACTIONS / name / "action.lua", copy.deepcopy(obj), now)
    return clean_returned(out, obj)


def test_sandbox_is_as_strict_as_argocd() -> None:
    """Scripts that use a library Argo CD does not open must fail here too."""
    with pytest.raises(lua51.LuaError):
        run('return string.format("%d", 1)', None)
    with pytest.raises(lua51.LuaError):
        run('return ("abc"):sub(1, 1)', None)
    with pytest.raises(lua51.LuaError):
        run("return math.floor(1.5)", None)
    with pytest.raises(lua51.LuaError):
        run('return os.date("!%Y-%m-%dT%XZ")', None)
    assert run('local os = require("os"); return os.date("!%Y-%m-%dT%XZ")', None) == (
        "2026-01-01T12:40:00Z"
    )
    assert run('return tonumber("10") > 9 and #{1, 2} == 2', None) is True


def test_round_trip_keeps_empty_objects() -> None:
    obj = {"spec": {"steps": [{"pause": {}}], "empty": []}, "n": 3}
    assert clean_returned(run("return obj", obj), obj) == obj


@pytest.mark.parametrize("case", HEALTH_TESTS, ids=lambda c: c["inputPath"])
def test_health(case: dict[str, Any]) -> None:
    health = run_file(ARGOCD / "health.lua", load(ARGOCD / case["inputPath"]))
    assert health == case["healthStatus"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(("generation", "observed"), [(3, 3), (4, 3), (10, 9), (10, 10)])
def test_health_matches_core(phase: str, generation: int, observed: int) -> None:
    """health.lua and weightship.core.phase.argocd_health agree on every phase."""
    obj = load(ARGOCD / "testdata" / "healthy.yaml")
    obj["metadata"]["generation"] = generation
    obj["status"].update(phase=phase, observedGeneration=observed, conditions=[])
    health = run_file(ARGOCD / "health.lua", obj)
    assert health["status"] == argocd_health(
        phase, generation=generation, observed_generation=observed
    )


@pytest.mark.parametrize("case", ACTION_TESTS["discoveryTests"], ids=lambda c: c["inputPath"])
def test_discovery(case: dict[str, Any]) -> None:
    actions = run_file(ACTIONS / "discovery.lua", load(ACTIONS / case["inputPath"]))
    got = sorted(({"name": name, **spec} for name, spec in actions.items()), key=by_name)
    assert got == sorted(case["result"], key=by_name)


def by_name(action: dict[str, Any]) -> str:
    return str(action["name"])


def test_discovery_names_every_action() -> None:
    scripts = {p.parent.name for p in ACTIONS.glob("*/action.lua")}
    assert scripts == {"promote", "promote-full", "abort", "retry"}
    for case in ACTION_TESTS["discoveryTests"]:
        assert {a["name"] for a in case["result"]} == scripts
    assert {case["action"] for case in ACTION_TESTS["actionTests"]} == scripts


def without_control(obj: dict[str, Any]) -> dict[str, Any]:
    status = {k: v for k, v in obj.get("status", {}).items() if k != "control"}
    return {k: v for k, v in obj.items() if k != "status"} | {"status": status}


@pytest.mark.parametrize(
    "case",
    ACTION_TESTS["actionTests"],
    ids=lambda c: f"{c['action']}:{Path(c['inputPath']).stem}",
)
def test_action(case: dict[str, Any]) -> None:
    before = load(ACTIONS / case["inputPath"])
    after = run_action(case["action"], before)
    assert after == load(ACTIONS / case["expectedOutputPath"])
    # Only status.control changes: no spec drift, nothing else the controller owns.
    assert without_control(after) == without_control(before)
    # The request has the API's field names and is pending for the controller.
    control = after["status"]["control"]
    assert ControlStatus.model_validate(control).to_k8s() == control
    field = "promote" if case["action"].startswith("promote") else case["action"]
    request = getattr(ControlStatus.model_validate(control), field)
    assert request.pending
    assert request.requested_by == "argocd"


def test_action_timestamp_is_rfc3339_now() -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    after = run_action("promote", load(ARGOCD / "testdata" / "paused.yaml"), now)
    requested = after["status"]["control"]["promote"]["requestedAt"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", requested)
    assert datetime.fromisoformat(requested) == now


def test_clicks_within_one_second_are_never_lost() -> None:
    """The controller acts while requestedAt != acknowledged: a click in the same second as
    an acknowledged one must still produce a pending request."""
    obj = load(ARGOCD / "testdata" / "paused.yaml")
    tokens = []
    for _ in range(3):
        obj = run_action("promote", obj)
        request = obj["status"]["control"]["promote"]
        assert request["requestedAt"] != request.get("acknowledged")
        tokens.append(request["requestedAt"])
        request["acknowledged"] = request["requestedAt"]  # the controller acted on it
    assert tokens == ["2026-01-01T12:40:00Z", "2026-01-01T12:40:00Z-2", "2026-01-01T12:40:00Z"]


def test_samples_are_valid_and_all_used() -> None:
    used = {ARGOCD / c["inputPath"] for c in HEALTH_TESTS}
    for case in ACTION_TESTS["discoveryTests"] + ACTION_TESTS["actionTests"]:
        paths = [case["inputPath"], case.get("expectedOutputPath", case["inputPath"])]
        used |= {(ACTIONS / path).resolve() for path in paths}
    samples = set(ARGOCD.glob("testdata/*.yaml"))
    assert samples == {p.resolve() for p in used}
    for path in samples - {ARGOCD / "testdata" / "unknown_phase.yaml"}:
        ModelRollout.from_body(load(path))


def test_argocd_cm_patch_is_in_sync() -> None:
    spec = importlib.util.spec_from_file_location("argocd_render", ARGOCD / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    for path, script in render.render_actions().items():
        assert path.read_text() == script, f"{path} is stale: run python argocd/render.py"
    patch = render.render()
    assert (ARGOCD / "argocd-cm-patch.yaml").read_text() == patch, "run python argocd/render.py"
    doc = render.DOC.read_text()
    assert render.render_doc(doc, patch) == doc, "run python argocd/render.py"
    # And the patch really carries the scripts, byte for byte.
    data = yaml.safe_load(patch)["data"]
    assert (
        data["resource.customizations.health.weightship.io_ModelRollout"]
        == (ARGOCD / "health.lua").read_text()
    )
    actions = yaml.safe_load(data["resource.customizations.actions.weightship.io_ModelRollout"])
    assert actions["discovery.lua"] == (ACTIONS / "discovery.lua").read_text()
    for definition in actions["definitions"]:
        script = (ACTIONS / definition["name"] / "action.lua").read_text()
        assert definition["action.lua"] == script
