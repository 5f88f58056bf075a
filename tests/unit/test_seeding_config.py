"""Seeding's small pure parts: env config, fault knobs, backend choice, HTTP glue."""

from __future__ import annotations

import json

import pytest
import torch

from weightship.seeding import Faults, SeedConfig, SeedingError, handle_join, handle_status
from weightship.seeding.transport import resolve_backend

FULL_ENV = {
    "WEIGHTSHIP_SEED_ROOT": "http://10.0.0.7:8000",
    "WEIGHTSHIP_SEED_GROUP": "rollout-a-v2",
    "WEIGHTSHIP_SEED_WORLD_SIZE": "3",
    "WEIGHTSHIP_SEED_BACKEND": "gloo",
    "WEIGHTSHIP_SEED_TIMEOUT_SECONDS": "45",
    "POD_NAME": "tiny-v2-abc",
}


def test_config_is_none_without_a_root() -> None:
    assert SeedConfig.from_env({}) is None
    assert SeedConfig.from_env({**FULL_ENV, "WEIGHTSHIP_SEED_ROOT": " "}) is None


def test_config_reads_every_variable() -> None:
    assert SeedConfig.from_env(FULL_ENV) == SeedConfig(
        root_url="http://10.0.0.7:8000",
        group="rollout-a-v2",
        world_size=3,
        member="tiny-v2-abc",
        backend="gloo",
        timeout_s=45.0,
    )


def test_config_defaults() -> None:
    env = {"WEIGHTSHIP_SEED_ROOT": "http://r:1", "WEIGHTSHIP_SEED_GROUP": "g"}
    config = SeedConfig.from_env(env)
    assert config is not None
    assert (config.world_size, config.backend, config.timeout_s) == (2, "auto", 300.0)
    assert config.member  # the host name stands in for POD_NAME


@pytest.mark.parametrize(
    "override",
    [
        {"WEIGHTSHIP_SEED_GROUP": ""},
        {"WEIGHTSHIP_SEED_WORLD_SIZE": "three"},
        {"WEIGHTSHIP_SEED_WORLD_SIZE": "1"},
        {"WEIGHTSHIP_SEED_TIMEOUT_SECONDS": "0"},
        {"WEIGHTSHIP_SEED_BACKEND": "mpi"},
    ],
)
def test_config_rejects_malformed_values(override: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        SeedConfig.from_env({**FULL_ENV, **override})


def test_faults_are_off_by_default_and_parse_both_knobs() -> None:
    assert Faults.from_env({}) == Faults()
    assert Faults.parse("tamper") == Faults(tamper=True)
    assert Faults.parse("root-exit-after-buckets=3, tamper") == Faults(True, 3)
    for bad in ("tamper=1", "root-exit-after-buckets=x", "explode"):
        with pytest.raises(ValueError):
            Faults.parse(bad)


def test_backend_auto_follows_the_device() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ValueError):
        resolve_backend("nccl", torch.device("cpu"))


def test_only_checksum_mismatch_forbids_falling_back() -> None:
    assert not SeedingError("ChecksumMismatch", "x").fall_back
    assert all(
        SeedingError(r, "x").fall_back
        for r in ("RootUnavailable", "Timeout", "RootDied", "NoTensorChecksums")
    )


def test_join_on_a_server_that_is_no_root_says_fall_back() -> None:
    status, doc = handle_join(None, json.dumps({"group": "g", "worldSize": 2}).encode())
    assert status == 409 and doc["accepted"] is False
    assert handle_status(None) == (200, {"root": None, "active": [], "history": []})
