"""In-place swaps, the pure parts: the request and its token, the state machine and its
document, the config comparison, the ranks' outcome files, and how /loaded names the
rank a failure came from (the real vLLM runs in e2e/test_vllm_swap_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightship.api.inference import (
    MAX_SWAP_BODY,
    FailureReason,
    LoadReport,
    SwapRequest,
    SwapRequestError,
    SwapState,
    bearer_token,
    parse_verified,
    rfc3339,
)
from weightship.core.seedtoken import join_token
from weightship.integrations.serving import (
    StepTimes,
    SwapAuth,
    SwapTracker,
    config_changes,
    refused,
)
from weightship.integrations.vllm.reports import RankReport, merge
from weightship.integrations.vllm.swap import (
    RankOutcome,
    first_failure,
    ranked,
    read_outcomes,
    write_outcome,
)
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_testing.tinyvllm.build import build

DIGEST = "sha256:" + "b" * 64
OTHER = "sha256:" + "c" * 64
KEY = bytes(range(32))
NOW = 1_800_000_000.0


def body(**fields: object) -> bytes:
    return json.dumps({"manifestDigest": DIGEST, "revision": "v2", **fields}).encode()


# -- the request ---------------------------------------------------------------------------


def test_a_request_has_a_digest_a_revision_and_bounded_timeouts() -> None:
    req = SwapRequest.parse(body(drainTimeoutSeconds=0, swapTimeoutSeconds=3600))
    assert req == SwapRequest(DIGEST, "v2", 0, 3600)
    assert SwapRequest.parse(body()) == SwapRequest(DIGEST, "v2", 30, 300)


def test_a_swap_may_ask_to_hold_its_weights_until_verified() -> None:
    assert SwapRequest.parse(body(holdUntilVerified=True)).hold_until_verified
    assert not SwapRequest.parse(body()).hold_until_verified  # an older operator's request
    with pytest.raises(SwapRequestError):
        SwapRequest.parse(body(holdUntilVerified="yes"))


def test_a_swap_may_bound_how_long_one_request_is_held() -> None:
    req = SwapRequest.parse(body(maxHoldSeconds=45))
    assert req.max_hold_s == 45 and req.to_json()["maxHoldSeconds"] == 45
    assert SwapRequest.parse(json.dumps(req.to_json()).encode()) == req
    older = SwapRequest.parse(body())  # an older operator's request: the swap's bounds only
    assert older.max_hold_s is None and "maxHoldSeconds" not in older.to_json()
    for bad in (0, 3601, "60", True):
        with pytest.raises(SwapRequestError, match="maxHoldSeconds"):
            SwapRequest.parse(body(maxHoldSeconds=bad))


def test_the_verifiers_word_names_one_digest() -> None:
    assert parse_verified(json.dumps({"manifestDigest": DIGEST}).encode()) == DIGEST
    for bad in (b"{}", b"[]", b"nope", json.dumps({"manifestDigest": DIGEST, "x": 1}).encode()):
        with pytest.raises(SwapRequestError):
            parse_verified(bad)
    with pytest.raises(SwapRequestError) as big:
        parse_verified(b" " * (MAX_SWAP_BODY + 1))
    assert big.value.status == 413


def test_the_swap_token_is_what_lets_the_verifier_reach_the_swapped_weights() -> None:
    assert auth().check(bearer(), DIGEST, NOW) is None
    refusal = auth().check(bearer(OTHER), DIGEST, NOW)
    assert refusal is not None and refusal.status == 403


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        body(manifestDigest="sha256:abc"),
        body(manifestDigest="SHA256:" + "b" * 64),
        body(manifestDigest=None),
        body(revision=""),
        body(revision="v2\r\nX-Injected: 1"),
        body(revision="-v2"),
        body(revision="x" * 64),
        body(drainTimeoutSeconds=-1),
        body(drainTimeoutSeconds=3601),
        body(swapTimeoutSeconds=9),
        body(swapTimeoutSeconds="300"),
        body(swapTimeoutSeconds=True),
        body(path="/etc/passwd"),  # the request never names a path
    ],
)
def test_a_bad_body_is_a_400(raw: bytes) -> None:
    with pytest.raises(SwapRequestError) as err:
        SwapRequest.parse(raw)
    assert err.value.status == 400


def test_an_oversized_body_is_a_413() -> None:
    with pytest.raises(SwapRequestError) as err:
        SwapRequest.parse(b" " * (MAX_SWAP_BODY + 1))
    assert err.value.status == 413


def test_bearer_token_reads_the_authorization_header() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


# -- the token -----------------------------------------------------------------------------


def auth() -> SwapAuth:
    return SwapAuth(KEY, "uid-1", "pod-a")


def bearer(digest: str = DIGEST, *, key: bytes = KEY, group: str = "swap/pod-a") -> str:
    return f"Bearer {join_token(key, 'uid-1', digest, group, int(NOW) + 60)}"


def test_the_token_opens_this_pods_swap_to_that_digest() -> None:
    req = SwapRequest(DIGEST, "v2")
    assert auth().check(bearer(), req, NOW) is None


@pytest.mark.parametrize(
    ("authorization", "status", "reason"),
    [
        (None, 401, "TokenMissing"),
        ("Bearer ", 401, "TokenMissing"),
        ("Basic dXNlcjpwYXNz", 401, "TokenMissing"),
        (bearer(OTHER), 403, "TokenInvalid"),  # another model
        (bearer(group="swap/pod-b"), 403, "TokenInvalid"),  # another pod
        (bearer(group="seed/pod-a"), 403, "TokenInvalid"),  # a seeding group
        (bearer(key=bytes(32)), 403, "TokenInvalid"),  # another rollout's key
        ("Bearer v1.1.deadbeef", 403, "TokenInvalid"),
    ],
)
def test_a_swap_without_the_right_token_is_refused(
    authorization: str | None, status: int, reason: str
) -> None:
    refusal = auth().check(authorization, SwapRequest(DIGEST, "v2"), NOW)
    assert refusal is not None and (refusal.status, refusal.reason) == (status, reason)
    doc = refused(refusal)[1].to_json()
    assert doc["accepted"] is False
    if authorization:
        assert authorization.split(" ", 1)[-1] not in json.dumps(doc) or status == 401


def test_an_expired_token_is_refused() -> None:
    refusal = auth().check(bearer(), SwapRequest(DIGEST, "v2"), NOW + 3600)
    assert refusal is not None and refusal.reason == "TokenExpired"


def test_a_server_without_a_key_accepts_no_swap() -> None:
    refusal = SwapAuth(None, "uid-1", "pod-a").check(bearer(), SwapRequest(DIGEST, "v2"), NOW)
    assert refusal is not None and (refusal.status, refusal.reason) == (403, "NoSwapKey")


def test_auth_comes_from_the_pods_env() -> None:
    env = {
        "WEIGHTSHIP_SEED_KEY": KEY.hex(),
        "WEIGHTSHIP_ROLLOUT_UID": "uid-1",
        "WEIGHTSHIP_POD_NAME": "pod-a",
    }
    got = SwapAuth.from_env(env)
    assert (got.key, got.rollout_uid, got.group) == (KEY, "uid-1", "swap/pod-a")
    assert "key" not in repr(got) or KEY.hex() not in repr(got)
    assert SwapAuth.from_env({**env, "WEIGHTSHIP_SEED_KEY": "zz"}).key is None


# -- the state machine ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_a_swap_goes_draining_loading_swapped() -> None:
    clock = Clock()
    tracker = SwapTracker(clock)
    assert tracker.current.to_json()["state"] == "Idle"
    state = tracker.begin(SwapRequest(DIGEST, "v2"), OTHER)
    assert state.running and state.state == "Draining"
    assert tracker.loading(0.25).drain_seconds == 0.25
    clock.now += 1.5
    done = tracker.swapped(1.2, 0.3, {"drain": 0.25, "stage": 0.3})
    assert not done.running
    doc = done.to_json()
    assert doc["state"] == "Swapped" and doc["manifestDigest"] == DIGEST
    assert doc["fromManifestDigest"] == OTHER and doc["revision"] == "v2"
    assert doc["seconds"] == 1.5 and doc["pausedSeconds"] == 1.2
    assert doc["startedAt"] == "2027-01-15T08:00:00.000Z"
    assert doc["finishedAt"] == "2027-01-15T08:00:01.500Z"
    assert doc["steps"] == {"drain": 0.25, "stage": 0.3}
    assert "rank" not in doc and doc["reason"] is None


def test_each_step_is_timed_from_the_end_of_the_one_before() -> None:
    clock = Clock()
    steps = StepTimes(clock)
    clock.now += 0.25
    steps.done("drain")
    clock.now += 1.0
    steps.done("stage")
    steps.done("resume")
    assert steps.seconds == {"drain": 0.25, "stage": 1.0, "resume": 0.0}
    assert list(steps.seconds) == ["drain", "stage", "resume"]  # the order they ended
    assert str(steps) == "drain 0.250 s, stage 1.000 s, resume 0.000 s"


def test_a_failure_names_its_reason_and_rank() -> None:
    tracker = SwapTracker(Clock())
    tracker.begin(SwapRequest(DIGEST, "v2"), OTHER)
    doc = tracker.failed("NotStaged", "not staged", paused_seconds=0.0).to_json()
    assert doc["state"] == "Failed" and doc["reason"] == "NotStaged" and doc["pausedSeconds"] == 0
    tracker.begin(SwapRequest(DIGEST, "v2"), OTHER)
    tracker.loading(0.1)
    doc = tracker.failed("ChecksumMismatch", "rank 1: bad", rank=1).to_json()
    assert doc["rank"] == 1 and doc["message"] == "rank 1: bad"


def test_only_one_swap_runs_at_a_time() -> None:
    tracker = SwapTracker(Clock())
    tracker.begin(SwapRequest(DIGEST, "v2"), OTHER)
    with pytest.raises(RuntimeError):
        tracker.begin(SwapRequest(OTHER, "v3"), DIGEST)
    with pytest.raises(RuntimeError):
        tracker.swapped(0.1, None)  # not before Loading
    tracker.loading(0.1)
    tracker.swapped(0.1, None)
    tracker.begin(SwapRequest(OTHER, "v3"), DIGEST)  # a finished swap makes room


def test_rfc3339_is_utc() -> None:
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(None) is None
    assert SwapState().to_json()["startedAt"] is None


# -- what must not change ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Manifest, Manifest]:
    root = tmp_path_factory.mktemp("builds")
    a = build(root / "a", "good", seed=0).manifest
    b = build(root / "b", "subtly-bad", seed=1).manifest
    return a, b


def test_other_weights_with_the_same_config_fit(
    two_builds: tuple[Manifest, Manifest],
) -> None:
    a, b = two_builds
    assert a.digest != b.digest
    assert config_changes(a, b) == []


def test_a_changed_tokenizer_or_config_does_not_fit(
    two_builds: tuple[Manifest, Manifest], tmp_path: Path
) -> None:
    a, _ = two_builds
    other = tmp_path / "c"
    build(other, "good", seed=2)
    (other / "tokenizer_config.json").write_text('{"changed": true}')
    (other / "extra.txt").write_text("new")
    (other / "config.json").unlink()
    (other / MANIFEST_NAME).unlink()
    c = build_manifest(LocalFolder(other), chunk_size=1 << 20)
    assert config_changes(a, c) == [
        "config.json is gone",
        "extra.txt is new",
        "tokenizer_config.json differs",
    ]


def test_other_tensors_do_not_fit(tmp_path: Path) -> None:
    from weightship_testing.tinyvllm.build import Shape

    a = build(tmp_path / "a", "good", seed=0).manifest
    wider = build(tmp_path / "b", "good", seed=0, shape=Shape(intermediate_size=192)).manifest
    changes = config_changes(a, wider)
    assert "config.json differs" in changes
    assert any(c.startswith("the tensors differ (model.layers.0.mlp.down_proj") for c in changes)


# -- the ranks' answers --------------------------------------------------------------------


def test_outcomes_round_trip_and_silence_is_a_failure(tmp_path: Path) -> None:
    write_outcome(tmp_path, RankOutcome("s1", "stage", 0, True, seconds=0.5))
    write_outcome(tmp_path, RankOutcome("s0", "stage", 1, True))  # an older swap's
    got = read_outcomes(tmp_path, "s1", "stage", 3)
    assert got[0] == RankOutcome("s1", "stage", 0, True, seconds=0.5)
    assert (
        not got[1].ok and got[1].reason == FailureReason.ENGINE_ERROR
    )  # rank 1 answered another swap
    assert not got[2].ok and got[2].reason == FailureReason.ENGINE_ERROR  # rank 2 wrote nothing
    assert first_failure(got) == got[1]
    (tmp_path / "swap-rank-0.json").write_text("{not json")
    assert not read_outcomes(tmp_path, "s1", "stage", 1)[0].ok


def test_a_ranks_own_failure_comes_before_one_that_did_not_answer() -> None:
    outcomes = [
        RankOutcome("s", "stage", 0, False, FailureReason.ENGINE_ERROR, "no answer"),
        RankOutcome("s", "stage", 1, False, "ChecksumMismatch", "lm_head.weight: checksum"),
        RankOutcome("s", "stage", 2, True),
    ]
    failure = first_failure(outcomes)
    assert failure is not None and failure.rank == 1
    assert ranked(failure) == "rank 1: lm_head.weight: checksum"
    assert first_failure([RankOutcome("s", "stage", 0, True)]) is None


def test_loaded_names_the_rank_a_mixed_weights_failure_came_from() -> None:
    """Every rank reports a failed apply with the failing rank's message; /loaded keeps it
    as it is rather than prefixing rank 0."""
    message = "rank 1: applying sha256:... failed after parameters changed: boom"
    reports = [
        RankReport(r, 2, LoadReport("Failed", DIGEST, reason="MixedWeights", message=message))
        for r in range(2)
    ]
    merged = merge(reports)
    assert merged.state == "Failed" and merged.reason == "MixedWeights"
    assert merged.message == message
    own = merge([RankReport(1, 2, LoadReport("Failed", DIGEST, reason="X", message="bad"))])
    assert own.message == "rank 1: bad"


def test_a_swapped_rank_reports_source_swap() -> None:
    report = LoadReport("Loaded", DIGEST, verified=True, source="swap")
    assert LoadReport.from_json(report.to_json()).source == "swap"


# -- which servers can swap ----------------------------------------------------------------


def vllm_like(
    backend: str | None = "weightship", load_format: str = "weightship", dp: int = 1
) -> object:
    from types import SimpleNamespace as NS

    transfer = NS(backend=backend) if backend else None
    return NS(
        vllm_config=NS(
            weight_transfer_config=transfer,
            load_config=NS(load_format=load_format),
            parallel_config=NS(data_parallel_size=dp),
        )
    )


def test_only_a_weightship_loaded_engine_with_the_weightship_transfer_engine_swaps() -> None:
    from types import SimpleNamespace as NS

    from weightship.integrations.vllm.swap import not_swappable

    one = NS(api_server_count=1)
    assert not_swappable(vllm_like(), one) is None
    assert "--weight-transfer-config" in str(not_swappable(vllm_like(backend=None), one))
    assert "--weight-transfer-config" in str(not_swappable(vllm_like(backend="nccl"), one))
    assert "--load-format" in str(not_swappable(vllm_like(load_format="safetensors"), one))
    assert "data parallel" in str(not_swappable(vllm_like(dp=2), one))
    assert "API server" in str(not_swappable(vllm_like(), NS(api_server_count=2)))
    assert not_swappable(None, one) == "this server has no engine"


def test_the_first_stamp_is_the_pods_env() -> None:
    from weightship.integrations.serving import Weights

    env = {"WEIGHTSHIP_MODEL_REVISION": "v1", "WEIGHTSHIP_MANIFEST_DIGEST": DIGEST}
    assert Weights.from_env(env) == Weights("v1", DIGEST)
    assert Weights.from_env({}) == Weights("unknown", None)
