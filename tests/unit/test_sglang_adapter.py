"""The SGLang adapter (weightship.integrations.sglang) over real HTTP on loopback, in
front of a stand-in for SGLang's server.

SGLang itself does not run on these machines (README, "SGLang"; docs/integrations.md):
the stand-in implements the request and response shapes of the SGLang routes the adapter
calls, as sglang 0.5.23 defines them (``sglang.srt.entrypoints.http_server``,
``sglang.srt.managers.io_struct``): ``/pause_generation {mode}``,
``/continue_generation``, ``/update_weights_from_disk {model_path, load_format,
weight_version, flush_cache, abort_all_requests}`` -> ``{success, message,
num_paused_requests}`` (400 on failure), ``/flush_cache``, ``/model_info``
(``weight_version``, ``model_path``) and ``/weights_checker {action: checksum}`` ->
``{success, message, ranks, per_engine_checksum}``. It "loads" by reading the safetensors
files of the folder it is given, so its checksum follows the bytes it read. Everything
else is real: the tiny Llama checkpoints and their manifests, a node cache laid out as the
agent stages it, the loader's per-chunk verification, the seeding-key tokens, the HTTP
servers and the proxied requests.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from weightship.api.inference import FailureReason
from weightship.core.inplace import INTACT_REASONS
from weightship.core.seedtoken import join_token
from weightship.httpserver import QuietHandler, Server
from weightship.integrations.serving import SwapAuth, Weights
from weightship.integrations.sglang.__main__ import parse_args, upstream_of
from weightship.integrations.sglang.adapter import Adapter
from weightship.integrations.sglang.client import SGLangClient
from weightship.integrations.sglang.gate import Gate, Ticket
from weightship.integrations.sglang.server import serve
from weightship.integrations.sglang.verify import VerifiedModel
from weightship_dev.vllmlocal import stage
from weightship_testing.tinyvllm.build import BuiltModel, Shape, build

KEY = bytes(range(32))
UID = "rollout-uid-1"
POD = "llm-abc-1"
CHUNK = 64 * 1024


# -- a stand-in for SGLang's HTTP server ----------------------------------------------------


@dataclass
class StandIn:
    """SGLang's state as its routes show it."""

    model_path: str
    weight_version: str = "default"
    checksum: str = ""
    paused: bool = False
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    # Faults, one at a time: the next update fails, or "succeeds" without reading.
    fail_update: str | None = None
    stale_update: bool = False
    ignore_version: bool = False
    # A completion waits on this while set (an in-flight request during a swap).
    hold: threading.Event | None = None
    held: threading.Event = field(default_factory=threading.Event)
    aborted: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.checksum = files_checksum(Path(self.model_path))

    def names(self) -> list[str]:
        return [path for _, path, _ in self.calls]


def files_checksum(folder: Path) -> str:
    """What the stand-in 'holds': a sha256 of the safetensors bytes it read."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


def standin_handler(state: StandIn) -> type[QuietHandler]:
    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self._route("GET", None)

        def do_POST(self) -> None:
            body = self.read_body()
            self._route("POST", json.loads(body) if body else None)

        def _route(self, method: str, body: Any) -> None:
            path = self.path.split("?")[0]
            state.calls.append((method, path, body))
            if path == "/model_info":
                self.send_json(
                    200,
                    {
                        "model_path": state.model_path,
                        "weight_version": state.weight_version,
                        "load_format": "auto",
                        "is_generation": True,
                    },
                )
            elif path == "/pause_generation":
                with state.cond:
                    state.paused = True
                    if body and body.get("mode") == "abort":
                        state.aborted.set()
                    state.cond.notify_all()
                self.send_json(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif path == "/continue_generation":
                with state.cond:
                    state.paused = False
                    state.cond.notify_all()
                self.send_json(
                    200, {"message": "Generation continued successfully.", "status": "ok"}
                )
            elif path == "/update_weights_from_disk":
                self._update(body)
            elif path == "/flush_cache":
                self.send_bytes(200, b"Cache flushed.\n", "text/plain")
            elif path == "/weights_checker":
                rank = {
                    "checksums": {"model.embed_tokens.weight": "0" * 16},
                    "per_gpu_checksum": state.checksum,
                    "parallelism_info": {"role": "target", "tp_rank": 0, "tp_size": 1},
                }
                engine = hashlib.sha256(state.checksum.encode()).hexdigest()
                self.send_json(
                    200,
                    {
                        "success": True,
                        "message": "Success.",
                        "ranks": [rank],
                        "per_engine_checksum": engine,
                    },
                )
            elif path in ("/health", "/v1/models"):
                self.send_json(200, {"object": "list", "data": []})
            elif path == "/v1/completions":
                self._complete(body or {})
            else:
                self.send_json(404, {"detail": "Not Found"})

        def _update(self, body: dict[str, Any]) -> None:
            folder = Path(body["model_path"])
            if state.fail_update is not None:
                message, state.fail_update = state.fail_update, None
                self.send_json(
                    400, {"success": False, "message": message, "num_paused_requests": 0}
                )
                return
            if not state.stale_update:
                state.checksum = files_checksum(folder)
            state.model_path = str(folder)
            if body.get("weight_version") is not None and not state.ignore_version:
                state.weight_version = body["weight_version"]
            self.send_json(
                200,
                {
                    "success": True,
                    "message": "Succeeded to update model weights.",
                    "num_paused_requests": 0,
                },
            )

        def _complete(self, body: dict[str, Any]) -> None:
            if state.hold is not None and body.get("prompt") == "hold":
                state.held.set()
                state.hold.wait(30)
            with state.cond:  # SGLang holds requests while paused
                state.cond.wait_for(lambda: not state.paused, 30)
                answer = f"made by {state.weight_version} {state.checksum[:8]}"
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for piece in (answer, "[DONE]"):
                    self.wfile.write(f"data: {json.dumps(piece)}\n\n".encode())
                    self.wfile.flush()
                return
            self.send_json(200, {"choices": [{"text": answer, "index": 0}]})

    return Handler


def run_standin(port: int, model_path: str, version: str) -> None:
    """The stand-in as SGLang's process, for the command-line test: serves until SIGTERM,
    then exits 7 (so the test can tell the adapter passed its status on)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
    Server(("127.0.0.1", port), standin_handler(StandIn(model_path, version))).serve_forever()


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BuiltModel]:
    root = tmp_path_factory.mktemp("sglang-models")
    return {
        "v1": build(root / "v1", "good", seed=0, chunk_size=CHUNK),
        "v2": build(root / "v2", "good", seed=1, chunk_size=CHUNK),
        "bad": build(root / "bad", "subtly-bad", seed=0, chunk_size=CHUNK),
        # Another shape: another config.json and other tensors.
        "wide": build(root / "wide", "good", seed=0, shape=Shape(hidden_size=96), chunk_size=CHUNK),
    }


@dataclass
class Rig:
    cache: Path
    models: dict[str, BuiltModel]
    files: dict[str, Path]
    sglang: StandIn
    adapter: Adapter
    port: int

    def digest(self, name: str) -> str:
        return self.models[name].manifest.digest

    def token(self, name: str, pod: str = POD, key: bytes = KEY) -> str:
        return join_token(key, UID, self.digest(name), f"swap/{pod}", int(time.time()) + 60)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = (
                raw
                if raw is not None
                else (json.dumps(body).encode() if body is not None else None)
            )
            conn.request(method, path, body=data, headers=headers or {})
            response = conn.getresponse()
            return (
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            conn.close()

    def swap(self, name: str, revision: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"manifestDigest": self.digest(name), "revision": revision, **extra}
        status, _, data = self.request(
            "POST",
            "/weightship/v1/swap",
            body,
            {"Authorization": f"Bearer {self.token(name)}", "Content-Type": "application/json"},
        )
        return status, json.loads(data)

    def swapped(self, name: str, revision: str, **extra: Any) -> dict[str, Any]:
        """The swap's final state document."""
        status, answer = self.swap(name, revision, **extra)
        assert status == 202, answer
        self.adapter.wait(60)
        return self.get("/weightship/v1/swap")

    def get(self, path: str) -> dict[str, Any]:
        status, _, data = self.request("GET", path)
        assert status == 200, data
        doc: dict[str, Any] = json.loads(data)
        return doc

    def complete(self, prompt: str = "hi", **extra: Any) -> tuple[int, dict[str, str], bytes]:
        return self.request(
            "POST",
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 4, **extra},
            {"Content-Type": "application/json"},
        )


class QuietServer(Server):
    def handle_error(self, request: Any, client_address: Any) -> None:
        return  # a held answer written to a connection the adapter cut


@pytest.fixture
def rig(tmp_path: Path, models: dict[str, BuiltModel]) -> Iterator[Rig]:
    cache = tmp_path / "cache"
    files = {name: stage(cache, model) for name, model in models.items() if name != "wide"}
    sglang = StandIn(model_path=str(files["v1"]), weight_version="v1")
    upstream = QuietServer(("127.0.0.1", 0), standin_handler(sglang))
    upstream.start("sglang-standin", poll_interval_s=0.05)
    env = {
        "WEIGHTSHIP_SEED_KEY": KEY.hex(),
        "WEIGHTSHIP_ROLLOUT_UID": UID,
        "WEIGHTSHIP_POD_NAME": POD,
        "WEIGHTSHIP_MODEL_REVISION": "v1",
        "WEIGHTSHIP_MANIFEST_DIGEST": models["v1"].manifest.digest,
    }
    adapter = Adapter(
        client=SGLangClient(f"http://127.0.0.1:{upstream.server_port}"),
        auth=SwapAuth.from_env(env),
        cache_dir=cache,
        start=Weights.from_env(env),
    )
    front = serve(adapter, "127.0.0.1", 0, ("127.0.0.1", upstream.server_port))
    front.start("sglang-adapter", poll_interval_s=0.05)
    rig = Rig(cache, models, files, sglang, adapter, front.server_port)
    try:
        yield rig
    finally:
        if sglang.hold is not None:
            sglang.hold.set()
        adapter.wait(60)
        front.stop()
        upstream.stop()


@pytest.fixture
def up(rig: Rig) -> Rig:
    """The rig with the start weights verified and SGLang found serving them."""
    model = rig.adapter.verify_start()
    assert model is not None
    assert rig.adapter.await_server(model, timeout=10)
    rig.sglang.calls.clear()
    return rig


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def damage(files: Path, name: str = "model.safetensors", at: int = CHUNK + 10) -> None:
    path = files / name
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def stamped(headers: dict[str, str]) -> tuple[str | None, str | None]:
    return headers.get("x-weightship-revision"), headers.get("x-weightship-manifest-digest")


# -- start -------------------------------------------------------------------------------------


def test_loaded_reports_the_verified_start_weights_and_sglangs_word(up: Rig) -> None:
    doc = up.get("/weightship/v1/loaded")
    assert doc["state"] == "Loaded"
    assert doc["manifestDigest"] == up.digest("v1")
    assert doc["verified"] is True
    assert doc["source"] == "cache"
    assert doc["mode"] == "sglang"
    assert doc["sglang"]["weightVersion"] == "v1"
    assert Path(doc["sglang"]["modelPath"]) == up.files["v1"]
    engine = hashlib.sha256(files_checksum(up.files["v1"]).encode()).hexdigest()
    assert doc["sglang"]["weightsChecksum"] == engine
    assert doc["files"]["count"] == len(up.models["v1"].manifest.files)
    assert doc["files"]["algorithm"] == "blake3"
    assert "checked every chunk" in doc["message"]


def test_loading_until_sglang_serves_the_start_weights(rig: Rig) -> None:
    assert rig.get("/weightship/v1/loaded")["state"] == "Loading"


def test_damaged_start_weights_are_refused_before_sglang_reads_them(rig: Rig) -> None:
    damage(rig.files["v1"])
    assert rig.adapter.verify_start() is None
    doc = rig.get("/weightship/v1/loaded")
    assert doc["state"] == "Failed"
    assert doc["reason"] == "ChecksumMismatch"
    assert "chunk 1" in doc["message"]
    assert rig.sglang.calls == []


def test_sglang_serving_another_folder_or_version_fails_the_report(rig: Rig) -> None:
    rig.sglang.weight_version = "default"  # started without --weight-version
    model = rig.adapter.verify_start()
    assert model is not None
    assert not rig.adapter.await_server(model, timeout=10)
    doc = rig.get("/weightship/v1/loaded")
    assert (doc["state"], doc["reason"]) == ("Failed", FailureReason.READBACK_MISMATCH)
    assert "--weight-version" in doc["message"]


def test_sglang_changing_under_the_adapter_is_seen_at_the_next_report(up: Rig) -> None:
    up.sglang.model_path = str(up.files["v2"])  # e.g. someone reached its admin port
    doc = up.get("/weightship/v1/loaded")
    assert (doc["state"], doc["reason"]) == ("Failed", FailureReason.READBACK_MISMATCH)
    assert "model_path" in doc["message"]


# -- the swap ------------------------------------------------------------------------------------


def test_swap_verifies_then_pauses_updates_reads_back_and_resumes(up: Rig) -> None:
    state = up.swapped("v2", "v2", drainTimeoutSeconds=5, swapTimeoutSeconds=60)
    assert state["state"] == "Swapped", state
    assert state["manifestDigest"] == up.digest("v2")
    assert state["fromManifestDigest"] == up.digest("v1")
    assert set(state["steps"]) == {"verify", "drain", "pause", "update", "readback", "resume"}
    assert up.sglang.names() == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/model_info",
        "/weights_checker",
        "/continue_generation",
    ]
    # Nothing was running (the drain saw to it), and nothing SGLang holds is aborted.
    _, _, pause = up.sglang.calls[0]
    assert pause == {"mode": "retract"}
    _, _, update = up.sglang.calls[1]
    assert update == {
        "model_path": str(up.files["v2"]),
        "weight_version": "v2",
        "flush_cache": True,
        "abort_all_requests": False,
    }
    doc = up.get("/weightship/v1/loaded")
    assert (doc["state"], doc["manifestDigest"], doc["source"]) == (
        "Loaded",
        up.digest("v2"),
        "swap",
    )
    status, headers, body = up.complete()
    assert status == 200
    assert stamped(headers) == ("v2", up.digest("v2"))
    assert json.loads(body)["choices"][0]["text"].startswith("made by v2")


def test_swap_back_must_give_the_checksum_the_digest_had_before(up: Rig) -> None:
    assert up.swapped("v2", "v2")["state"] == "Swapped"
    up.sglang.calls.clear()
    assert up.swapped("v1", "v1")["state"] == "Swapped"
    assert up.get("/weightship/v1/loaded")["manifestDigest"] == up.digest("v1")
    # The same digest again, but SGLang now holds other bytes: refused, mixed.
    assert up.swapped("v2", "v2")["state"] == "Swapped"
    up.adapter.checksums[up.digest("v1")] = "0" * 64
    state = up.swapped("v1", "v1")
    assert (state["state"], state["reason"]) == ("Failed", "MixedWeights")
    assert FailureReason.READBACK_MISMATCH in state["message"]


def test_a_reload_that_kept_the_old_weights_is_caught_by_the_checksum(up: Rig) -> None:
    up.sglang.stale_update = True  # says success, version and path set, bytes not read
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "MixedWeights")
    assert "did not change" in state["message"]
    assert "/continue_generation" not in up.sglang.names()
    status, _, body = up.complete()
    assert status == 503
    assert json.loads(body)["reason"] == "MixedWeights"
    assert up.get("/weightship/v1/loaded")["reason"] == "MixedWeights"


def test_sglang_not_taking_the_weight_version_fails_the_swap(up: Rig) -> None:
    up.sglang.ignore_version = True
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "MixedWeights")
    assert "weight_version" in state["message"]


def test_a_failed_update_leaves_the_pod_refusing_until_a_swap_succeeds(up: Rig) -> None:
    up.sglang.fail_update = "Failed to update weights: boom.\nRolling back to original weights."
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "MixedWeights")
    assert "Rolling back" in state["message"]
    assert up.sglang.names() == ["/pause_generation", "/update_weights_from_disk"]
    assert up.complete()[0] == 503
    assert up.get("/weightship/v1/loaded")["state"] == "Failed"
    # The operator swaps the pod back: that clears it.
    state = up.swapped("v1", "v1")
    assert state["state"] == "Swapped", state
    status, headers, _ = up.complete()
    assert status == 200
    assert stamped(headers) == ("v1", up.digest("v1"))
    assert up.get("/weightship/v1/loaded")["state"] == "Loaded"


def test_weights_updated_but_cache_not_flushed_is_flushed_then_swapped(up: Rig) -> None:
    up.sglang.fail_update = (
        "Weights were updated, but the cache was not flushed because requests are still "
        "running or queued. Retract or finish them, then call /flush_cache."
    )
    up.sglang.stale_update = False
    # The stand-in's failed update reads nothing: make it read, as SGLang's did.
    up.sglang.checksum = files_checksum(up.files["v2"])
    up.sglang.model_path, up.sglang.weight_version = str(up.files["v2"]), "v2"
    state = up.swapped("v2", "v2")
    assert state["state"] == "Swapped", state
    assert "/flush_cache" in up.sglang.names()


def test_an_unexpected_error_mid_swap_is_mixed_and_the_next_swap_runs(
    up: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the engine went away")

    with monkeypatch.context() as patch:
        patch.setattr(up.adapter.client, "update_weights_from_disk", broken)
        state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "MixedWeights")
    assert "the engine went away" in state["message"]
    assert up.swapped("v1", "v1")["state"] == "Swapped"
    assert up.complete()[0] == 200


def test_an_unexpected_error_while_verifying_changes_nothing(up: Rig) -> None:
    def broken(cache: Path | None, digest: str) -> VerifiedModel:
        raise PermissionError("cannot read the view")

    up.adapter.verify = broken
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "LoadError")
    assert up.sglang.calls == []
    assert stamped(up.complete()[1]) == ("v1", up.digest("v1"))


def test_no_swap_before_sglang_serves_verified_weights(rig: Rig) -> None:
    status, answer = rig.swap("v2", "v2")
    assert (status, answer["reason"]) == (503, "NotReady")


# -- refused before anything pauses ----------------------------------------------------------------


def test_damaged_target_bytes_are_refused_and_nothing_pauses(up: Rig) -> None:
    damage(up.files["v2"])
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "ChecksumMismatch")
    assert "chunk 1" in state["message"]
    assert state["pausedSeconds"] == 0.0
    assert up.sglang.calls == []
    status, headers, _ = up.complete()
    assert status == 200
    assert stamped(headers) == ("v1", up.digest("v1"))
    assert up.get("/weightship/v1/loaded")["manifestDigest"] == up.digest("v1")


def test_a_file_the_manifest_does_not_list_is_refused(up: Rig) -> None:
    folder = up.files["v2"]
    folder.chmod(0o755)
    shutil.copy(folder / "model.safetensors", folder / "extra.safetensors")
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "ChecksumMismatch")
    assert "extra.safetensors" in state["message"]
    assert up.sglang.calls == []


def test_not_staged_is_refused(up: Rig) -> None:
    (up.files["v2"].parent / "STAGED").unlink()
    state = up.swapped("v2", "v2")
    assert (state["state"], state["reason"]) == ("Failed", "NotStaged")


def test_another_config_is_refused(up: Rig) -> None:
    stage(up.cache, up.models["wide"])
    state = up.swapped("wide", "wide")
    assert (state["state"], state["reason"]) == ("Failed", "ConfigChanged")
    assert "config.json differs" in state["message"]
    assert up.sglang.calls == []


def test_a_subtly_bad_revision_swaps_in_and_is_reported_as_it_is(up: Rig) -> None:
    """Its bytes match its manifest: the adapter swaps it; the golden prompts catch it."""
    state = up.swapped("bad", "v3")
    assert state["state"] == "Swapped"
    assert up.get("/weightship/v1/loaded")["manifestDigest"] == up.digest("bad")


# -- requests across a swap ------------------------------------------------------------------------


Answers = list[tuple[int, dict[str, str], bytes]]


def held_request(up: Rig) -> tuple[threading.Thread, Answers]:
    """A request that runs in SGLang until ``up.sglang.hold`` is set; its answer lands in
    the list once it ends."""
    up.sglang.hold = threading.Event()
    answers: Answers = []
    running = threading.Thread(target=lambda: answers.append(up.complete("hold")))
    running.start()
    assert up.sglang.held.wait(10)
    return running, answers


def test_a_request_still_running_at_the_drain_timeout_refuses_the_swap_and_finishes(
    up: Rig,
) -> None:
    """By default nothing is ever aborted: the swap is refused before anything changed,
    the request is answered by the weights it started on, and a later swap goes on."""
    running, answers = held_request(up)
    state = up.swapped("v2", "v2", drainTimeoutSeconds=0)
    assert state["state"] == "Failed" and state["reason"] == FailureReason.DRAIN_TIMEOUT, state
    assert "1 request(s) still ran" in state["message"]
    assert FailureReason.DRAIN_TIMEOUT in INTACT_REASONS  # the pod holds what it had
    assert up.adapter.gate.mode == "open" and up.adapter.gate.weights.revision == "v1"
    up.sglang.hold.set()
    running.join(30)
    [(status, headers, body)] = answers
    assert status == 200
    assert stamped(headers) == ("v1", up.digest("v1"))
    assert json.loads(body)["choices"][0]["text"].startswith("made by v1")
    assert not {"/pause_generation", "/update_weights_from_disk"} & set(up.sglang.names())
    assert not up.sglang.aborted.is_set()
    assert up.swapped("v2", "v2", drainTimeoutSeconds=0)["state"] == "Swapped"


def test_with_abort_on_drain_timeout_a_running_request_is_cut_not_mixed(up: Rig) -> None:
    up.adapter.abort_on_drain_timeout = True
    running, answers = held_request(up)
    state = up.swapped("v2", "v2", drainTimeoutSeconds=0)
    up.sglang.hold.set()
    running.join(30)
    assert state["state"] == "Swapped", state
    [(status, headers, body)] = answers
    assert status == 503
    assert json.loads(body)["reason"] == "WeightsChanged"
    assert stamped(headers) == ("v1", up.digest("v1"))
    assert up.sglang.aborted.is_set()
    update = next(body for _, path, body in up.sglang.calls if path == "/update_weights_from_disk")
    assert update["abort_all_requests"] is True


def test_requests_finishing_within_the_drain_are_answered_by_the_old_weights(up: Rig) -> None:
    running, answers = held_request(up)
    status, _ = up.swap("v2", "v2", drainTimeoutSeconds=60)
    assert status == 202
    assert wait_for(lambda: up.adapter.gate.mode == "closed")
    # While it drains, new requests wait at the closed gate; the running one finishes.
    later: list[tuple[int, dict[str, str], bytes]] = []
    waiting = threading.Thread(target=lambda: later.append(up.complete()))
    waiting.start()
    up.sglang.hold.set()
    running.join(30)
    up.adapter.wait(60)
    waiting.join(30)
    [(status, headers, body)] = answers
    assert status == 200
    assert stamped(headers) == ("v1", up.digest("v1"))
    assert json.loads(body)["choices"][0]["text"].startswith("made by v1")
    [(status, headers, body)] = later
    assert status == 200
    assert stamped(headers) == ("v2", up.digest("v2"))
    assert json.loads(body)["choices"][0]["text"].startswith("made by v2")


def test_swapped_weights_held_until_verified_serve_the_verifier_alone_until_they_pass(
    up: Rig,
) -> None:
    """holdUntilVerified: after the swap a request (a stale router's) waits, the verifier's
    golden prompt (the swap token in X-Weightship-Verify) is served by the new weights,
    and once told they passed the waiting one gets them too."""
    state = up.swapped("v2", "v2", holdUntilVerified=True)
    assert state["state"] == "Swapped" and up.adapter.gate.mode == "verifying", state
    later: list[tuple[int, dict[str, str], bytes]] = []
    waiting = threading.Thread(target=lambda: later.append(up.complete()))
    waiting.start()
    golden = up.request(
        "POST",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4},
        {"Content-Type": "application/json", "X-Weightship-Verify": f"Bearer {up.token('v2')}"},
    )
    assert golden[0] == 200 and stamped(golden[1]) == ("v2", up.digest("v2"))
    waiting.join(0.5)
    assert waiting.is_alive() and not later  # held: the weights have not passed yet

    def tell(name: str, token: str) -> tuple[int, dict[str, Any]]:
        status, _, data = up.request(
            "POST",
            "/weightship/v1/swap/verified",
            {"manifestDigest": up.digest(name)},
            {"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        return status, json.loads(data)

    assert tell("v2", up.token("v1"))[0] == 403  # a token for other weights
    assert tell("v1", up.token("v1"))[0] == 409  # not the weights it verifies
    assert tell("v2", up.token("v2")) == (200, {"accepted": True, "gate": "open"})
    waiting.join(30)
    [(status, headers, body)] = later
    assert status == 200 and stamped(headers) == ("v2", up.digest("v2"))
    assert json.loads(body)["choices"][0]["text"].startswith("made by v2")


def test_the_verifiers_request_held_through_the_swap_goes_through_once_it_verifies() -> None:
    """A golden prompt that came while the gate was closed is asked, once the swap leaves
    it verifying, whether it is the verifier's for the new weights; another request waits."""
    v1, v2 = Weights("v1", "sha256:" + "1" * 64), Weights("v2", "sha256:" + "2" * 64)
    gate = Gate(v1)
    gate.close(60)
    got: dict[str, Ticket | object] = {}
    golden = threading.Thread(
        target=lambda: got.update(golden=gate.admit(lambda: gate.weights == v2))
    )
    other = threading.Thread(target=lambda: got.update(other=gate.admit()))
    golden.start()
    other.start()
    golden.join(0.2)
    assert golden.is_alive()
    gate.verifying(v2, 60)
    golden.join(5)
    ticket = got["golden"]
    assert isinstance(ticket, Ticket) and ticket.weights == v2
    other.join(0.2)
    assert other.is_alive() and "other" not in got
    assert gate.verified(v2.manifest_digest or "")
    other.join(5)
    assert isinstance(got["other"], Ticket)


def test_streamed_answers_are_forwarded_chunked_and_stamped(up: Rig) -> None:
    status, headers, body = up.complete(stream=True)
    assert status == 200
    assert headers["transfer-encoding"] == "chunked"
    assert stamped(headers) == ("v1", up.digest("v1"))
    assert body.decode().endswith('data: "[DONE]"\n\n')


# -- what the port exposes, and who may swap -------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/update_weights_from_disk"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/flush_cache"),
        ("POST", "/weights_checker"),
        ("GET", "/model_info"),
        ("POST", "/update_weights_from_tensor"),
        ("GET", "/server_info"),
        ("POST", "/v1/completions/../../update_weights_from_disk"),
    ],
)
def test_sglang_admin_routes_are_not_exposed(up: Rig, method: str, path: str) -> None:
    status, _, body = up.request(method, path, {"model_path": "/"})
    assert status == 404
    assert json.loads(body)["reason"] == "NotExposed"
    assert up.sglang.calls == []


def test_serving_routes_are_forwarded(up: Rig) -> None:
    assert up.request("GET", "/health")[0] == 200
    assert up.request("GET", "/v1/models")[0] == 200
    assert up.sglang.names() == ["/health", "/v1/models"]


def test_swap_needs_the_pods_token_for_that_digest(up: Rig) -> None:
    def post(token: str | None, name: str = "v2") -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        body = {"manifestDigest": up.digest(name), "revision": "v2"}
        status, _, data = up.request("POST", "/weightship/v1/swap", body, headers)
        return status, json.loads(data)["reason"]

    assert post(None) == (401, "TokenMissing")
    assert post(up.token("v2", pod="llm-other"))[0] == 403  # another pod's swap
    assert post(up.token("v1"))[0] == 403  # a token for another model
    assert post(up.token("v2", key=bytes(32)))[0] == 403  # another rollout's key
    assert up.sglang.calls == []
    assert up.get("/weightship/v1/swap")["state"] == "Idle"


def test_no_key_no_swap(up: Rig) -> None:
    up.adapter.auth = SwapAuth.from_env({"WEIGHTSHIP_POD_NAME": POD})
    status, answer = up.swap("v2", "v2")
    assert (status, answer["reason"]) == (403, "NoSwapKey")


def test_bad_bodies_are_refused(up: Rig) -> None:
    headers = {"Authorization": f"Bearer {up.token('v2')}"}
    status, _, data = up.request("POST", "/weightship/v1/swap", raw=b"{", headers=headers)
    assert (status, json.loads(data)["reason"]) == (400, "BadRequest")
    body = {"manifestDigest": up.digest("v2"), "revision": "v2", "drainTimeoutSeconds": -1}
    status, _, data = up.request("POST", "/weightship/v1/swap", body, headers)
    assert status == 400
    huge = {"Content-Length": str(10**9), **headers}
    status, _, _ = up.request("POST", "/weightship/v1/swap", raw=b"", headers=huge)
    assert status == 413


def test_already_loaded_and_in_progress(up: Rig) -> None:
    status, answer = up.swap("v1", "v1")
    assert status == 200
    assert answer["accepted"] is True
    up.sglang.hold = threading.Event()
    running = threading.Thread(target=lambda: up.complete("hold"))
    running.start()
    assert up.sglang.held.wait(10)
    status, _ = up.swap("v2", "v2", drainTimeoutSeconds=60)
    assert status == 202
    status, answer = up.swap("v2", "v2")
    assert (status, answer["reason"]) == (409, "SwapInProgress")
    assert up.get("/weightship/v1/loaded")["state"] == "Loading"
    up.sglang.hold.set()
    running.join(30)
    up.adapter.wait(60)
    assert up.get("/weightship/v1/swap")["state"] == "Swapped"


# -- the command line ----------------------------------------------------------------------------


def test_command_line() -> None:
    args, command = parse_args(
        ["--port", "8000", "--", "python", "-m", "sglang.launch_server", "--port", "30000"]
    )
    assert args.port == 8000 and not args.abort_on_drain_timeout
    assert command == ["python", "-m", "sglang.launch_server", "--port", "30000"]
    assert parse_args(["--abort-on-drain-timeout"])[0].abort_on_drain_timeout
    assert upstream_of("http://127.0.0.1:30000") == ("127.0.0.1", 30000)
    with pytest.raises(SystemExit, match="loopback"):
        upstream_of("http://10.0.0.5:30000")
    assert Weights.from_env({}) == Weights("unknown", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def adapter_process(
    cache: Path, model: BuiltModel, port: int, sglang_port: int, child: list[str]
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(["operator", "devtools", "tests/unit"]),
        "WEIGHTSHIP_CACHE_DIR": str(cache),
        "WEIGHTSHIP_MANIFEST_DIGEST": model.manifest.digest,
        "WEIGHTSHIP_MODEL_REVISION": "v1",
        "WEIGHTSHIP_SEED_KEY": KEY.hex(),
        "WEIGHTSHIP_ROLLOUT_UID": UID,
        "WEIGHTSHIP_POD_NAME": POD,
        "WEIGHTSHIP_TERMINATION_LOG": str(cache.parent / "termination-log"),
    }
    command = [sys.executable, "-m", "weightship.integrations.sglang", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--sglang-url", f"http://127.0.0.1:{sglang_port}"]
    return subprocess.Popen([*command, "--", *child], env=env)


def loaded_over_http(port: int, want: str, timeout: float = 120.0) -> dict[str, Any]:
    """/weightship/v1/loaded once its state is ``want`` (the processes start meanwhile)."""
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/weightship/v1/loaded")
            doc = json.loads(conn.getresponse().read())
            conn.close()
            if doc.get("state") == want:
                return doc
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    raise AssertionError(f"/weightship/v1/loaded never became {want}: {doc}")


def test_the_command_verifies_then_starts_sglang_and_exits_with_it(
    tmp_path: Path, models: dict[str, BuiltModel]
) -> None:
    files = stage(tmp_path / "cache", models["v1"])
    port, sglang_port = free_port(), free_port()
    child = [sys.executable, "-c"]
    child += [
        f"import test_sglang_adapter as t; t.run_standin({sglang_port}, {str(files)!r}, 'v1')"
    ]
    proc = adapter_process(tmp_path / "cache", models["v1"], port, sglang_port, child)
    try:
        doc = loaded_over_http(port, "Loaded")
        assert doc["manifestDigest"] == models["v1"].manifest.digest
        assert doc["sglang"]["weightVersion"] == "v1"
        proc.send_signal(signal.SIGTERM)  # passed on to SGLang, which exits 7
        assert proc.wait(60) == 7
    finally:
        proc.kill()
        proc.wait(30)


def test_the_command_never_starts_sglang_on_damaged_weights(
    tmp_path: Path, models: dict[str, BuiltModel]
) -> None:
    files = stage(tmp_path / "cache", models["v1"])
    damage(files)
    marker = tmp_path / "sglang-started"
    port = free_port()
    child = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    proc = adapter_process(tmp_path / "cache", models["v1"], port, free_port(), child)
    try:
        doc = loaded_over_http(port, "Failed")
        assert doc["reason"] == "ChecksumMismatch"
        assert proc.poll() is None  # it stays up to say why
        assert not marker.exists()
        log = tmp_path / "termination-log"
        assert wait_for(log.exists)  # written right after the report turned Failed
        message = json.loads(log.read_text())
        assert message["weightshipLoadReport"]["reason"] == "ChecksumMismatch"
    finally:
        proc.kill()
        proc.wait(30)
