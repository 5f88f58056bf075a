"""The vLLM plugin's parts that need no vLLM: rank reports and their merge, settings, the
verified tensor stream and the node-cache lookup (the real vLLM runs in e2e/test_vllm.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from weightship.api.inference import LoadReport, report_from_termination, termination_message
from weightship.integrations.vllm import claim_run_dir
from weightship.integrations.vllm.reports import (
    RankReport,
    merge,
    read_rank_reports,
    write_rank_report,
)
from weightship.integrations.vllm.settings import (
    RUN_DIR_ENV,
    RUN_OWNER_ENV,
    PluginSettings,
    SettingsError,
)
from weightship.integrations.vllm.weights import (
    LoadFailure,
    check_model_dir,
    checked_tensors,
    obtain,
)
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_testing.tinyvllm.build import build

DIGEST = "sha256:" + "a" * 64


def loaded(digest: str = DIGEST, source: str = "cache", seconds: float = 1.0) -> LoadReport:
    return LoadReport(
        state="Loaded",
        manifest_digest=digest,
        verified=True,
        source=source,  # type: ignore[arg-type]
        load_seconds=seconds,
        message="ok",
    )


def test_no_report_yet_is_loading() -> None:
    assert merge([]).state == "Loading"


def test_one_rank_is_its_report() -> None:
    merged = merge([RankReport(0, 1, loaded())])
    assert merged.state == "Loaded" and merged.verified and merged.manifest_digest == DIGEST


def test_tensor_parallel_is_loaded_only_when_every_rank_is() -> None:
    half = merge([RankReport(0, 2, loaded())])
    assert half.state == "Loading" and half.message == "1/2 ranks loaded"
    full = merge([RankReport(1, 2, loaded(seconds=3.0)), RankReport(0, 2, loaded())])
    assert full.state == "Loaded" and full.verified and full.load_seconds == 3.0


def test_any_failed_rank_fails_the_server() -> None:
    failed = LoadReport(state="Failed", reason="ChecksumMismatch", message="bad chunk")
    merged = merge([RankReport(0, 2, loaded()), RankReport(1, 2, failed)])
    assert merged.state == "Failed" and merged.reason == "ChecksumMismatch"
    assert merged.message == "rank 1: bad chunk"


def test_ranks_with_other_digests_fail() -> None:
    other = "sha256:" + "b" * 64
    merged = merge([RankReport(0, 2, loaded()), RankReport(1, 2, loaded(other))])
    assert merged.state == "Failed" and merged.reason == "RanksDisagree"


def test_unverified_rank_makes_the_server_unverified() -> None:
    unverified = LoadReport(state="Loaded", manifest_digest=DIGEST, verified=False)
    assert not merge([RankReport(0, 2, loaded()), RankReport(1, 2, unverified)]).verified


def test_reports_round_trip_through_the_run_dir(tmp_path: Path) -> None:
    write_rank_report(tmp_path, RankReport(1, 2, loaded()))
    write_rank_report(tmp_path, RankReport(0, 2, loaded()))
    (tmp_path / "rank-7.json").write_text("{not json")  # skipped, not fatal
    reports = read_rank_reports(tmp_path)
    assert [r.rank for r in reports] == [0, 1]
    assert merge(reports).state == "Loaded"


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="bad rank"):
        RankReport.from_json({"rank": 2, "worldSize": 2, "state": "Loaded"})


def test_termination_message_round_trip() -> None:
    failed = LoadReport(
        state="Failed", reason="ChecksumMismatch", message="x", manifest_digest=DIGEST
    )
    text = "vLLM log line\n" + termination_message(failed)
    assert report_from_termination(text) == failed
    assert report_from_termination("Traceback ...") is None
    assert report_from_termination(termination_message(loaded())) is None  # only refusals


def test_the_first_process_claims_a_fresh_run_dir(tmp_path: Path) -> None:
    env: dict[str, str] = {RUN_DIR_ENV: str(tmp_path)}
    (tmp_path / "rank-0.json").write_text("stale")
    assert claim_run_dir(env) == tmp_path
    assert not (tmp_path / "rank-0.json").exists() and env[RUN_OWNER_ENV]
    (tmp_path / "rank-0.json").write_text("this run's")
    claim_run_dir(env)  # a worker of the same server: keeps the reports
    assert (tmp_path / "rank-0.json").exists()
    fresh: dict[str, str] = {}
    assert claim_run_dir(fresh).is_dir()


def test_settings_from_env_and_extra_config(tmp_path: Path) -> None:
    env = {
        "WEIGHTSHIP_CACHE_DIR": "/var/cache/weightship",
        "WEIGHTSHIP_MANIFEST_DIGEST": DIGEST,
        RUN_DIR_ENV: str(tmp_path),
        "WEIGHTSHIP_SEED_ROOT": "http://10.0.0.1:8000",
        "WEIGHTSHIP_SEED_GROUP": "g",
        "WEIGHTSHIP_POD_NAME": "p-1",
    }
    settings = PluginSettings.from_env(env, {"cache_dir": "/other"})
    assert settings.cache_dir == Path("/other") and settings.manifest_digest == DIGEST
    assert settings.seed is not None and settings.seed.member == "p-1"
    with pytest.raises(SettingsError, match="unknown keys"):
        PluginSettings.from_env(env, {"cache": "/x"})


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """tinyvllm staged as the node agent leaves it: models/<hex>/{files,manifest.json,STAGED}."""
    built = build(tmp_path_factory.mktemp("built"))
    cache = tmp_path_factory.mktemp("cache")
    model = cache / "models" / built.manifest.digest.removeprefix("sha256:")
    shutil.copytree(built.path, model / "files", ignore=shutil.ignore_patterns(MANIFEST_NAME))
    (model / "manifest.json").write_bytes(built.manifest.canonical_bytes())
    (model / "STAGED").write_text("")
    return cache, built.manifest


def settings_for(cache: Path, digest: str, tmp_path: Path) -> PluginSettings:
    return PluginSettings(cache_dir=cache, manifest_digest=digest, run_dir=tmp_path)


def test_obtain_verifies_the_staged_model(staged: tuple[Path, Manifest], tmp_path: Path) -> None:
    cache, manifest = staged
    files = cache / "models" / manifest.digest.removeprefix("sha256:") / "files"
    got = obtain(settings_for(cache, manifest.digest, tmp_path), files)
    assert got.source == "cache" and got.manifest.digest == manifest.digest
    names = [name for name, _ in checked_tensors(got.tensors, got.manifest)]
    assert sorted(names) == sorted(t.name for t in manifest.tensors)


def test_a_model_not_staged_or_another_folder_is_refused(
    staged: tuple[Path, Manifest], tmp_path: Path
) -> None:
    cache, manifest = staged
    with pytest.raises(LoadFailure) as not_staged:
        obtain(settings_for(cache, "sha256:" + "c" * 64, tmp_path), tmp_path)
    assert not_staged.value.reason == "NotStaged"
    files = cache / "models" / manifest.digest.removeprefix("sha256:") / "files"
    with pytest.raises(LoadFailure) as elsewhere:
        check_model_dir(tmp_path, files, manifest)
    assert elsewhere.value.reason == "ModelPathMismatch"


def test_a_tensor_changed_after_loading_is_refused(
    staged: tuple[Path, Manifest], tmp_path: Path
) -> None:
    cache, manifest = staged
    files = cache / "models" / manifest.digest.removeprefix("sha256:") / "files"
    got = obtain(settings_for(cache, manifest.digest, tmp_path), files)
    tensors = {k: v.clone() for k, v in got.tensors.items()}
    tensors["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(LoadFailure) as refused:
        list(checked_tensors(tensors, got.manifest))
    assert refused.value.reason == "ChecksumMismatch" and "lm_head.weight" in refused.value.message
    extra = {**got.tensors, "extra.weight": torch.zeros(2)}
    with pytest.raises(LoadFailure, match="not in the manifest"):
        list(checked_tensors(extra, got.manifest))


def test_bit_rot_in_the_cache_is_refused(staged: tuple[Path, Manifest], tmp_path: Path) -> None:
    cache, manifest = staged
    rotten = tmp_path / "cache"
    shutil.copytree(cache, rotten)
    files = rotten / "models" / manifest.digest.removeprefix("sha256:") / "files"
    shard = files / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(LoadFailure) as refused:
        obtain(settings_for(rotten, manifest.digest, tmp_path), files)
    assert refused.value.reason == "ChecksumMismatch"
    assert "model.safetensors" in refused.value.message
    assert json.loads(termination_message(LoadReport(state="Failed", reason="x")))
