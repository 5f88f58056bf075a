"""SGLang's own HTTP API, the calls an in-place swap makes, over loopback (stdlib only).

The routes and bodies are SGLang's (``sglang.srt.entrypoints.http_server`` and the request
types of ``sglang.srt.managers.io_struct``, read from sglang 0.5.23):

    POST /pause_generation          {"mode": "abort" | "retract" | "in_place"}
    POST /continue_generation       {}            (``/resume_generation`` tried on a 404)
    POST /update_weights_from_disk  {"model_path", "load_format", "weight_version",
                                     "flush_cache", "abort_all_requests"}
                                    -> {"success", "message", "num_paused_requests"},
                                       400 with the same document when it failed
    POST /flush_cache               200 when flushed, 400 when requests still run
    GET  /model_info                {"model_path", "weight_version", "load_format", ...}
                                    (``/get_model_info`` tried on a 404)
    POST /weights_checker           {"action": "checksum"} -> {"success", "message",
                                     "ranks": [...], "per_engine_checksum"}

These are SGLang's admin routes: the adapter calls them on SGLang's loopback port and
never forwards them from its own port. ``admin_key`` is SGLang's ``--admin-api-key`` (or
``--api-key``), when it was started with one.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from weightship.api.inference import AUTHORIZATION_HEADER, bearer

MAX_ANSWER_BYTES = 1024 * 1024
# weights_checker answers a checksum per tensor per rank: larger for large models.
MAX_CHECKSUM_BYTES = 64 * 1024 * 1024
# Text of SGLang's answer when the weights changed but the radix cache was not flushed
# (scheduler_components.weight_updater.flush_cache_after_weight_update).
NOT_FLUSHED_TEXT = "cache was not flushed"


class SGLangError(Exception):
    """SGLang did not answer, or answered with an error (``status`` 0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ModelInfo:
    """What GET /model_info says SGLang serves."""

    model_path: str | None
    weight_version: str | None
    load_format: str | None = None

    @classmethod
    def from_json(cls, doc: object) -> ModelInfo:
        if not isinstance(doc, dict):
            raise SGLangError(200, "model_info is not a JSON object")
        return cls(
            model_path=_opt_str(doc.get("model_path")),
            weight_version=_opt_str(doc.get("weight_version")),
            load_format=_opt_str(doc.get("load_format")),
        )


@dataclass(frozen=True)
class WeightsChecksum:
    """SGLang's checksum of the weights it holds (POST /weights_checker, action checksum):
    a sha256 over every rank's per-GPU checksum, each a sha256 over that rank's per-tensor
    hashes of its loaded (sharded, fused) parameters."""

    engine: str
    ranks: int


@dataclass(frozen=True)
class UpdateResult:
    success: bool
    message: str


class SGLangClient:
    def __init__(self, base_url: str, *, admin_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout: float,
        limit: int = MAX_ANSWER_BYTES,
    ) -> tuple[int, Any]:
        """(status, the answer as JSON, or as text when it is not JSON). SGLangError(0)
        when SGLang does not answer within ``timeout``."""
        headers = {"Content-Type": "application/json"}
        if self.admin_key:
            headers[AUTHORIZATION_HEADER] = bearer(self.admin_key)
        request = urllib.request.Request(  # noqa: S310 (http: checked by the caller)
            self.base_url + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers=headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=max(timeout, 0.001)) as response:  # noqa: S310
                return response.status, _decode(response.read(limit + 1), limit)
        except urllib.error.HTTPError as err:
            with err:
                return err.code, _decode(err.read(limit + 1), limit)
        except (OSError, ValueError) as err:
            raise SGLangError(0, f"{method} {path}: {type(err).__name__}: {err}"[:300]) from None

    def _ok(
        self, method: str, path: str, body: dict[str, Any] | None, timeout: float
    ) -> tuple[int, Any]:
        status, answer = self._call(method, path, body, timeout)
        if status != 200:
            raise SGLangError(status, f"{method} {path}: HTTP {status}: {_brief(answer)}")
        return status, answer

    def pause(self, mode: str, timeout: float) -> None:
        self._ok("POST", "/pause_generation", {"mode": mode}, timeout)

    def resume(self, timeout: float) -> None:
        status, answer = self._call("POST", "/continue_generation", {}, timeout)
        if status == 404:  # some releases name it resume_generation
            status, answer = self._call("POST", "/resume_generation", {}, timeout)
        if status != 200:
            raise SGLangError(status, f"continue_generation: HTTP {status}: {_brief(answer)}")

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str,
        timeout: float,
        load_format: str | None = None,
        *,
        abort_all_requests: bool = False,
    ) -> UpdateResult:
        body: dict[str, Any] = {
            "model_path": model_path,
            "weight_version": weight_version,
            "flush_cache": True,
            "abort_all_requests": abort_all_requests,
        }
        if load_format:
            body["load_format"] = load_format
        status, answer = self._call("POST", "/update_weights_from_disk", body, timeout)
        if isinstance(answer, dict) and isinstance(answer.get("success"), bool):
            return UpdateResult(answer["success"], str(answer.get("message") or "")[:1000])
        raise SGLangError(status, f"update_weights_from_disk: HTTP {status}: {_brief(answer)}")

    def flush_cache(self, timeout: float) -> bool:
        status, _ = self._call("POST", "/flush_cache", None, timeout)
        return status == 200

    def model_info(self, timeout: float) -> ModelInfo:
        status, answer = self._call("GET", "/model_info", None, timeout)
        if status == 404:  # releases before /model_info
            status, answer = self._call("GET", "/get_model_info", None, timeout)
        if status != 200:
            raise SGLangError(status, f"model_info: HTTP {status}: {_brief(answer)}")
        return ModelInfo.from_json(answer)

    def weights_checksum(self, timeout: float) -> WeightsChecksum | None:
        """None when this SGLang has no weights checker (404) or it computed no checksum;
        SGLangError when it failed."""
        status, answer = self._call(
            "POST", "/weights_checker", {"action": "checksum"}, timeout, MAX_CHECKSUM_BYTES
        )
        if status in (404, 405):
            return None
        if status != 200 or not isinstance(answer, dict) or answer.get("success") is not True:
            raise SGLangError(status, f"weights_checker: HTTP {status}: {_brief(answer)}")
        engine = answer.get("per_engine_checksum")
        if not isinstance(engine, str) or not engine:
            return None
        ranks = answer.get("ranks")
        return WeightsChecksum(engine, len(ranks) if isinstance(ranks, list) else 0)


def _decode(data: bytes, limit: int) -> Any:
    if len(data) > limit:
        raise ValueError(f"the answer is over {limit} bytes")
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def _brief(answer: Any) -> str:
    if isinstance(answer, dict):
        for key in ("message", "detail", "error"):
            if answer.get(key):
                return str(answer[key])[:300]
    return str(answer)[:300]


def _opt_str(value: object) -> str | None:
    return str(value) if value not in (None, "") else None
