"""The swap driver (API server) and the worker sessions together, with vLLM's engine client
replaced by one that runs each collective step on every rank's session in turn, as vLLM's
executor does, and a model that only keeps what ``load_weights`` gave it. What the real
vLLM does with the same steps is in e2e/test_vllm_swap_engine.py."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from weightship.api.inference import FailureReason, LoadReport, SwapRequest
from weightship.core.inplace import INTACT_REASONS
from weightship.integrations.serving import SwapTracker, Weights
from weightship.integrations.vllm.reports import (
    RankReport,
    merge,
    read_rank_reports,
    write_rank_report,
)
from weightship.integrations.vllm.settings import PluginSettings
from weightship.integrations.vllm.staging import SwapFaults, SwapSession, remember_loaded
from weightship.integrations.vllm.stamp import Ticket, WeightsGate
from weightship.integrations.vllm.swapdriver import SwapDriver
from weightship.loader.load import load_model
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_testing.tinyvllm.build import build


@dataclass
class Staged:
    cache: Path
    manifests: dict[str, Manifest]

    def digest(self, name: str) -> str:
        return self.manifests[name].digest

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        m = self.manifests[name]
        files = self.cache / "models" / m.digest_hex / "files"
        return load_model(files, m).tensors


def stage_into(cache: Path, folder: Path, manifest: Manifest) -> None:
    model = cache / "models" / manifest.digest_hex
    shutil.copytree(folder, model / "files", ignore=shutil.ignore_patterns(MANIFEST_NAME))
    (model / "manifest.json").write_bytes(manifest.canonical_bytes())
    (model / "STAGED").write_text("")


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Staged:
    root = tmp_path_factory.mktemp("staged")
    cache = root / "cache"
    manifests = {}
    for name, variant, seed in [("v1", "good", 0), ("v2", "good", 1), ("v3", "subtly-bad", 0)]:
        built = build(root / name, variant, seed=seed)  # type: ignore[arg-type]
        stage_into(cache, built.path, built.manifest)
        manifests[name] = built.manifest
    other = root / "v5"
    build(other, "good", seed=5)
    (other / "tokenizer_config.json").write_text("{}")
    (other / MANIFEST_NAME).unlink()
    manifests["v5"] = build_manifest(LocalFolder(other), chunk_size=1 << 20)
    stage_into(cache, other, manifests["v5"])
    return Staged(cache, manifests)


class Model:
    """What a vLLM model is to a swap: ``load_weights(iterable of (name, tensor))``."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.params = {k: v.clone() for k, v in tensors.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        names = set()
        for name, tensor in weights:
            self.params[name].copy_(tensor)
            names.add(name)
        return names


@dataclass
class Engine:
    """vLLM's engine client, with the collective RPC run on each rank's session."""

    sessions: list[SwapSession]
    models: list[Model]
    calls: list[str] = field(default_factory=list)
    fail_on: str | None = None
    slow: float = 0.0
    sleeping: bool = False  # vLLM's sleep mode (which pauses the scheduler too)
    paused: bool = False
    sleep_checks: int = 0

    async def is_sleeping(self) -> bool:
        """As vLLM says it: asleep, or only paused."""
        self.sleep_checks += 1
        return self.sleeping or self.paused

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def start_weight_update(self) -> None:
        self.calls.append("start")
        await asyncio.sleep(self.slow)
        for s in self.sessions:
            s.start()

    async def update_weights(self, request: Any) -> None:
        info = dict(request)
        self.calls.append(f"update:{info['op']}")
        if self.fail_on == info["op"]:
            raise RuntimeError("the engine refused")
        for s, m in zip(self.sessions, self.models, strict=True):
            s.handle(info, m, None)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish:{weight_version}")
        for s in self.sessions:
            s.finish()

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.calls.append("reset_prefix_cache")
        return True


@dataclass
class Server:
    engine: Engine
    driver: SwapDriver
    gate: WeightsGate
    run_dir: Path

    async def swap(self, staged: Staged, name: str, **timeouts: int) -> dict[str, Any]:
        request = SwapRequest(staged.digest(name), name, **timeouts)
        self.driver.start(request)
        assert self.driver.task is not None
        await self.driver.task
        return self.driver.tracker.current.to_json()

    def loaded(self) -> LoadReport:
        return merge(read_rank_reports(self.run_dir))

    def faults(self, spec: str) -> None:
        for s in self.engine.sessions:
            s.env = {"WEIGHTSHIP_VLLM_SWAP_FAULT": spec}


def server(staged: Staged, tmp_path: Path, world: int) -> Server:
    run_dir = tmp_path / "run"
    settings = PluginSettings(staged.cache, staged.digest("v1"), run_dir)
    remember_loaded(staged.manifests["v1"], "v1")
    v1 = staged.tensors("v1")
    for rank in range(world):
        report = LoadReport("Loaded", staged.digest("v1"), verified=True, source="cache")
        write_rank_report(run_dir, RankReport(rank, world, report))
    sessions = [SwapSession(lambda: settings, rank, world, env={}) for rank in range(world)]
    engine = Engine(sessions, [Model(v1) for _ in range(world)])
    gate = WeightsGate(Weights("v1", staged.digest("v1")))
    driver = SwapDriver(engine, gate, SwapTracker(), run_dir, staged.cache, world)
    return Server(engine, driver, gate, run_dir)


def mode(s: Server) -> str:
    return s.gate.mode


def mixed(s: Server) -> str | None:
    return s.driver.mixed


def holds(model: Model, tensors: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(model.params[k], v) for k, v in tensors.items())


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_swap_runs_every_step_on_every_rank(staged: Staged, tmp_path: Path) -> None:
    s = server(staged, tmp_path, world=2)
    state = run(s.swap(staged, "v2"))
    assert state["state"] == "Swapped", state
    assert s.engine.calls == [
        "pause:wait",
        "start",
        "update:stage",
        "update:apply",
        "update:commit",
        "finish:v2",
        "reset_prefix_cache",
        "resume",
    ]
    v2 = staged.tensors("v2")
    assert all(holds(m, v2) for m in s.engine.models)
    loaded = s.loaded()
    assert loaded.state == "Loaded" and loaded.manifest_digest == staged.digest("v2")
    assert loaded.source == "swap" and loaded.verified
    assert mode(s) == "open" and s.gate.weights == Weights("v2", staged.digest("v2"))
    assert s.gate.epoch == 1
    assert set(state["steps"]) == {"drain", "stage", "apply", "commit", "resume"}


def test_a_damaged_read_on_one_rank_changes_nothing_anywhere(
    staged: Staged, tmp_path: Path
) -> None:
    s = server(staged, tmp_path, world=2)
    s.faults("damage-rank=1")
    state = run(s.swap(staged, "v3"))
    assert state["state"] == "Failed" and state["reason"] == "ChecksumMismatch", state
    assert state["rank"] == 1 and state["message"].startswith("rank 1: "), state
    assert s.engine.calls[-3:] == ["update:discard", "finish:None", "resume"]
    assert "update:apply" not in s.engine.calls
    v1 = staged.tensors("v1")
    assert all(holds(m, v1) for m in s.engine.models)
    assert s.loaded().manifest_digest == staged.digest("v1") and s.loaded().state == "Loaded"
    assert mode(s) == "open" and s.gate.weights.revision == "v1"


def test_a_failure_while_applying_leaves_nothing_served_until_a_good_swap(
    staged: Staged, tmp_path: Path
) -> None:
    s = server(staged, tmp_path, world=2)
    s.faults("apply-fail-rank=1")
    state = run(s.swap(staged, "v3"))
    assert state["state"] == "Failed" and state["reason"] == "MixedWeights", state
    assert state["rank"] == 1
    assert s.engine.calls[-2:] == ["update:poison", "finish:None"]
    assert "resume" not in s.engine.calls  # generation stays paused
    loaded = s.loaded()
    assert loaded.state == "Failed" and loaded.reason == "MixedWeights"
    assert loaded.message is not None and loaded.message.startswith("rank 1: ")
    reports = read_rank_reports(s.run_dir)
    assert [r.report.reason for r in reports] == ["MixedWeights", "MixedWeights"]
    assert mode(s) == "refusing" and s.gate.refusal.reason == "MixedWeights"
    assert mixed(s) is not None

    # A swap that fails before changing anything keeps it that way...
    s.faults("damage-rank=0")
    state = run(s.swap(staged, "v2"))
    assert state["reason"] == "ChecksumMismatch"
    assert "resume" not in s.engine.calls and mode(s) == "refusing"
    # ...and a good one brings the server back.
    s.faults("")
    state = run(s.swap(staged, "v3"))
    assert state["state"] == "Swapped", state
    assert s.engine.calls[-1] == "resume" and mode(s) == "open"
    assert s.loaded().state == "Loaded" and s.loaded().manifest_digest == staged.digest("v3")
    assert mixed(s) is None
    v3 = staged.tensors("v3")
    assert all(holds(m, v3) for m in s.engine.models)


@pytest.mark.parametrize(
    ("name", "reason"),
    [("v5", "ConfigChanged"), ("absent", "NotStaged")],
)
def test_what_cannot_fit_is_refused_before_anything_pauses(
    staged: Staged, tmp_path: Path, name: str, reason: str
) -> None:
    s = server(staged, tmp_path, world=1)
    digest = staged.digest(name) if name in staged.manifests else "sha256:" + "0" * 64

    async def go() -> dict[str, Any]:
        s.driver.start(SwapRequest(digest, "vx"))
        assert s.driver.task is not None
        await s.driver.task
        return s.driver.tracker.current.to_json()

    state = run(go())
    assert state["state"] == "Failed" and state["reason"] == reason, state
    assert s.engine.calls == [] and state["pausedSeconds"] == 0
    assert mode(s) == "open" and s.gate.epoch == 0


def test_no_swap_while_the_engine_sleeps(staged: Staged, tmp_path: Path) -> None:
    """vLLM's sleep mode offloads or drops the weights, and an update then crashes the
    engine: the swap is refused before anything pauses, with its own reason, and runs
    once the engine is awake again."""
    s = server(staged, tmp_path, world=1)
    s.engine.sleeping = True
    state = run(s.swap(staged, "v2"))
    assert state["state"] == "Failed" and state["reason"] == FailureReason.ENGINE_SLEEPING
    assert "wake it up" in state["message"] and state["pausedSeconds"] == 0.0
    assert s.engine.sleep_checks == 1
    assert s.engine.calls == []  # nothing paused, nothing sent to the ranks
    assert s.gate.mode == "open" and s.gate.weights.revision == "v1"
    assert s.loaded().manifest_digest == staged.digest("v1")
    assert FailureReason.ENGINE_SLEEPING in INTACT_REASONS  # the pod holds what it had
    s.engine.sleeping = False
    assert run(s.swap(staged, "v2"))["state"] == "Swapped"
    s.engine.paused = True  # paused by someone else (or vLLM's sleep level 0): the same
    state = run(s.swap(staged, "v1"))
    assert state["state"] == "Failed" and state["reason"] == FailureReason.ENGINE_SLEEPING


def test_the_ranks_refuse_a_changed_config_even_if_the_api_server_could_not_tell(
    staged: Staged, tmp_path: Path
) -> None:
    s = server(staged, tmp_path, world=1)
    s.driver.cache_dir = tmp_path / "elsewhere"  # the API server's precheck sees nothing
    shutil.copytree(staged.cache, tmp_path / "elsewhere")
    shutil.rmtree(tmp_path / "elsewhere" / "models" / staged.manifests["v1"].digest_hex)
    state = run(s.swap(staged, "v5"))
    assert state["state"] == "Failed" and state["reason"] == "ConfigChanged", state
    assert state["rank"] == 0 and "tokenizer_config.json differs" in state["message"]
    assert s.engine.calls[-1] == "resume" and s.gate.weights.revision == "v1"


def test_a_drain_timeout_aborts_and_requests_admitted_before_are_cut(
    staged: Staged, tmp_path: Path
) -> None:
    s = server(staged, tmp_path, world=1)

    async def go() -> dict[str, Any]:
        ticket = await s.gate.admit()  # a request that never finishes on its own
        assert isinstance(ticket, Ticket)
        state = await s.swap(staged, "v2", drain_timeout_s=0)
        assert s.gate.is_stale(ticket)
        return state

    state = run(go())
    assert state["state"] == "Swapped", state
    assert s.engine.calls[0] == "pause:abort"
    assert s.engine.calls[-2:] == ["pause:abort", "resume"]  # the stale one, queued: aborted


def test_an_engine_error_before_the_weights_change_resumes_the_old_weights(
    staged: Staged, tmp_path: Path
) -> None:
    s = server(staged, tmp_path, world=1)
    s.engine.fail_on = "stage"
    state = run(s.swap(staged, "v2"))
    assert state["state"] == "Failed" and state["reason"] == "EngineError", state
    assert "the engine refused" in state["message"] and "rank" not in state
    assert s.engine.calls[-3:] == ["update:discard", "finish:None", "resume"]
    assert mode(s) == "open" and s.gate.weights.revision == "v1"


def test_an_engine_error_while_applying_is_mixed_weights(staged: Staged, tmp_path: Path) -> None:
    s = server(staged, tmp_path, world=1)
    s.engine.fail_on = "apply"
    state = run(s.swap(staged, "v2"))
    assert state["state"] == "Failed" and state["reason"] == "MixedWeights", state
    assert mode(s) == "refusing" and "resume" not in s.engine.calls
    assert s.loaded().state == "Failed"


def test_a_swap_that_runs_past_its_timeout_fails(staged: Staged, tmp_path: Path) -> None:
    s = server(staged, tmp_path, world=1)
    s.engine.slow = 5.0  # start_weight_update does not answer in time
    request = SwapRequest(staged.digest("v2"), "v2", 0, 1)  # bounds are the parser's job

    async def go() -> dict[str, Any]:
        s.driver.start(request)
        assert s.driver.task is not None
        await s.driver.task
        return s.driver.tracker.current.to_json()

    state = run(go())
    assert state["state"] == "Failed" and state["reason"] == "SwapTimeout", state
    # The start was sent: its session is closed (vLLM runs the calls in order) before the
    # old weights resume.
    assert s.engine.calls == ["pause:abort", "start", "update:discard", "finish:None", "resume"]
    assert s.gate.weights.revision == "v1" and not s.driver.session


def test_faults_are_off_unless_set(tmp_path: Path) -> None:
    assert SwapFaults.from_env({}) == SwapFaults()
    spec = tmp_path / "fault"
    spec.write_text("stage-delay-s=1.5, damage-rank=1")
    assert SwapFaults.from_env({"WEIGHTSHIP_VLLM_SWAP_FAULT": f"@{spec}"}) == SwapFaults(1.5, 1)
    assert SwapFaults.from_env({"WEIGHTSHIP_VLLM_SWAP_FAULT": "@/nonexistent"}) == SwapFaults()
    with pytest.raises(ValueError):
        SwapFaults.parse("explode")
