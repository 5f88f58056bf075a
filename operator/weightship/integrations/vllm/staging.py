"""The worker's side of an in-place swap (one ``SwapSession`` per vLLM worker, driven by
the ``weightship`` weight-transfer engine). No vLLM imports: vLLM's layerwise reload comes
in as two callables.

The API server drives every rank through the same steps, each a collective
``update_weights({"op": ...})``, and reads each rank's answer from its outcome file:

- ``stage``: read the target from the node cache into host memory, every chunk and every
  tensor checked against its manifest, and check that it fits the running server
  (config and tokenizer unchanged). No parameter is touched; a failure here changes
  nothing.
- ``apply``: only once every rank staged: ``model.load_weights`` of the staged tensors,
  inside vLLM's layerwise reload (which re-runs ``process_weights_after_loading``: on CPU
  the linear layers keep their weights repacked, not in ``.weight``). A failure here
  leaves mixed weights.
- ``commit``: only once every rank applied: each rank reports the new digest (source
  "swap"); rank 0 of a one-rank replica seeds the new revision.
- ``discard`` drops what was staged; ``poison`` makes every rank report MixedWeights.

The module also remembers what the worker loaded at startup (``remember_loaded``): the
manifest a swap is compared with.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightship.api.inference import FailureReason, LoadReport
from weightship.integrations.serving import config_changes
from weightship.weightformat.manifest import Manifest

from . import roots
from .reports import RankReport, write_rank_report
from .settings import PluginSettings
from .swap import RankOutcome, write_outcome
from .weights import LoadFailure, checked_tensors, read_verified, staged_model

log = logging.getLogger("vllm.weightship")

FAULT_ENV = "WEIGHTSHIP_VLLM_SWAP_FAULT"  # tests only; see SwapFaults
MAX_FAULT_BYTES = 1024


@dataclass
class _Loaded:
    manifest: Manifest
    revision: str | None = None


_LOADED: list[_Loaded] = []  # what this worker serves (its startup load, then each swap)


def remember_loaded(manifest: Manifest, revision: str | None = None) -> None:
    _LOADED[:] = [_Loaded(manifest, revision)]


def loaded_manifest() -> Manifest | None:
    return _LOADED[0].manifest if _LOADED else None


@dataclass(frozen=True)
class SwapFaults:
    """Fault injection for tests only, off unless ``WEIGHTSHIP_VLLM_SWAP_FAULT`` is set:
    comma-separated items, or ``@<path>`` to read them from a file at each swap.

    - ``stage-delay-s=<s>``: staging takes that much longer (a slow read);
    - ``damage-rank=<r>``: rank r flips a byte of a staged tensor after the read (a damaged
      read on that rank only; its tensor checksum catches it);
    - ``apply-fail-rank=<r>``: rank r raises halfway through ``load_weights``.
    """

    stage_delay_s: float = 0.0
    damage_rank: int | None = None
    apply_fail_rank: int | None = None

    @classmethod
    def parse(cls, value: str) -> SwapFaults:
        delay, damage, fail = 0.0, None, None
        for item in filter(None, (part.strip() for part in value.split(","))):
            key, _, arg = item.partition("=")
            if key == "stage-delay-s":
                delay = float(arg)
            elif key == "damage-rank" and arg.isdigit():
                damage = int(arg)
            elif key == "apply-fail-rank" and arg.isdigit():
                fail = int(arg)
            else:
                raise ValueError(f"unknown {FAULT_ENV} item {item!r}")
        return cls(delay, damage, fail)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SwapFaults:
        value = env.get(FAULT_ENV, "").strip()
        if value.startswith("@"):
            try:
                with open(value[1:], encoding="utf-8") as f:
                    value = f.read(MAX_FAULT_BYTES)
            except OSError:
                value = ""
        return cls.parse(value)


class InjectedFault(RuntimeError):
    pass


@dataclass
class Reload:
    """vLLM's layerwise reload (``initialize_layerwise_reload(model)``,
    ``finalize_layerwise_reload(model, model_config)``); no-ops outside vLLM."""

    initialize: Callable[[Any], None] = lambda model: None
    finalize: Callable[[Any, Any], None] = lambda model, config: None


@dataclass
class _Staged:
    swap_id: str
    manifest: Manifest
    revision: str
    tensors: list[tuple[str, torch.Tensor]]
    seconds: float
    from_digest: str | None
    applied: bool = False


@dataclass
class SwapSession:
    settings: Callable[[], PluginSettings]
    rank: int
    world: int
    reload: Reload = field(default_factory=Reload)
    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    _staged: _Staged | None = None

    def start(self) -> None:
        self._staged = None

    def finish(self) -> None:
        self._staged = None

    def handle(self, info: Mapping[str, Any], model: Any, model_config: Any) -> None:
        """One step; never raises (vLLM's collective RPC must see every rank answer the
        same way): the outcome goes to this rank's outcome file."""
        started = time.monotonic()
        swap_id, op = str(info.get("swapId", "")), str(info.get("op", ""))
        try:
            settings = self.settings()
            outcome = self._step(op, swap_id, info, settings, model, model_config)
        except Exception as exc:  # anything unforeseen: a failed step, not a dead worker
            log.exception("rank %d: swap step %s failed", self.rank, op)
            outcome = RankOutcome(
                swap_id, op, self.rank, False, FailureReason.ENGINE_ERROR, str(exc)[:500]
            )
            settings = None
        outcome = RankOutcome(
            outcome.swap_id,
            outcome.op,
            outcome.rank,
            outcome.ok,
            outcome.reason,
            outcome.message,
            outcome.seconds if outcome.seconds is not None else time.monotonic() - started,
        )
        try:
            run_dir = settings.run_dir if settings is not None else self.settings().run_dir
            write_outcome(run_dir, outcome)
        except Exception:
            log.exception("rank %d: cannot write the outcome of swap step %s", self.rank, op)

    def _step(
        self,
        op: str,
        swap_id: str,
        info: Mapping[str, Any],
        settings: PluginSettings,
        model: Any,
        model_config: Any,
    ) -> RankOutcome:
        def ok(message: str | None = None, seconds: float | None = None) -> RankOutcome:
            return RankOutcome(swap_id, op, self.rank, True, None, message, seconds)

        def fail(reason: str, message: str) -> RankOutcome:
            return RankOutcome(swap_id, op, self.rank, False, reason, message[:1000])

        if op == "stage":
            try:
                self._staged = self._stage(swap_id, info, settings)
            except LoadFailure as exc:
                self._staged = None
                return fail(exc.reason, exc.message)
            return ok(f"{len(self._staged.tensors)} tensors verified", self._staged.seconds)
        if op == "discard":
            self._staged = None
            return ok()
        if op == "poison":
            message = str(info.get("message") or "a rank failed while the weights changed")
            self._report_failed(settings, str(info.get("manifestDigest") or ""), message)
            self._staged = None
            return ok()
        staged = self._staged
        if staged is None or staged.swap_id != swap_id:
            return fail(FailureReason.ENGINE_ERROR, f"{op}: nothing staged for swap {swap_id}")
        if op == "apply":
            try:
                self._apply(staged, model, model_config, settings)
            except Exception as exc:
                digest = staged.manifest.digest
                log.exception("rank %d: applying %s failed", self.rank, digest)
                message = f"applying {digest} failed after parameters changed: {exc}"
                self._report_failed(settings, digest, f"rank {self.rank}: {message}")
                return fail(FailureReason.MIXED_WEIGHTS, message)
            return ok()
        if op == "commit":
            if not staged.applied:
                return fail(FailureReason.ENGINE_ERROR, "commit before apply")
            self._commit(staged, settings)
            self._staged = None
            return ok()
        return fail(FailureReason.ENGINE_ERROR, f"unknown step {op!r}")

    # -- the steps -------------------------------------------------------------------------

    def _stage(self, swap_id: str, info: Mapping[str, Any], settings: PluginSettings) -> _Staged:
        started = time.monotonic()
        digest = str(info.get("manifestDigest") or "")
        revision = str(info.get("revision") or "")
        deadline = float(info.get("deadline") or 0.0)
        current = loaded_manifest()
        if current is None:
            raise LoadFailure(
                FailureReason.NOT_SWAPPABLE,
                "this worker did not load its weights with --load-format weightship: "
                "there is nothing to compare a swap with",
            )
        files, manifest = staged_model(settings, digest)  # NotStaged, ManifestMismatch
        changes = config_changes(current, manifest)
        if changes:
            raise LoadFailure(
                FailureReason.CONFIG_CHANGED,
                f"{digest} cannot be swapped in: {'; '.join(changes[:5])} "
                "(vLLM read those at startup; roll it out by replacing pods)",
                digest,
            )
        faults = SwapFaults.from_env(self.env)
        if faults.stage_delay_s:
            time.sleep(min(faults.stage_delay_s, max(0.0, deadline - time.time())))
        _check_deadline(deadline, "before reading the weights")
        loaded = read_verified(files, manifest)  # ChecksumMismatch, LoadError
        if faults.damage_rank == self.rank and loaded.tensors:
            first = next(iter(loaded.tensors.values()))
            first.view(-1).view(torch.uint8)[0] ^= 0xFF
        tensors = list(checked_tensors(loaded.tensors, manifest))  # ChecksumMismatch
        _check_deadline(deadline, "after reading the weights")
        return _Staged(
            swap_id,
            manifest,
            revision,
            tensors,
            time.monotonic() - started,
            current.digest,
        )

    def _apply(
        self, staged: _Staged, model: Any, model_config: Any, settings: PluginSettings
    ) -> None:
        if self.rank == 0:
            roots.stop_roots(settings.run_dir)  # it seeds what is about to change
        faults = SwapFaults.from_env(self.env)
        fail_halfway = faults.apply_fail_rank == self.rank
        t0 = time.monotonic()
        self.reload.initialize(model)
        t1 = time.monotonic()
        try:
            loaded = model.load_weights(_feed(staged.tensors, fail_halfway))
        except BaseException:
            try:  # put back what has a kernel tensor: still mixed, but no layer left empty
                self.reload.finalize(model, model_config)
            except Exception:
                log.exception("rank %d: finalizing a failed reload", self.rank)
            raise
        t2 = time.monotonic()
        self.reload.finalize(model, model_config)
        t3 = time.monotonic()
        if isinstance(loaded, set) and not loaded:
            raise RuntimeError("vLLM took none of the tensors")
        staged.applied = True
        log.info(
            "rank %d: applied %s (reload setup %.3f s, load_weights %.3f s, finalize %.3f s)",
            self.rank,
            staged.manifest.digest,
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )

    def _commit(self, staged: _Staged, settings: PluginSettings) -> None:
        manifest = staged.manifest
        report = LoadReport(
            state="Loaded",
            manifest_digest=manifest.digest,
            verified=True,
            source="swap",
            load_seconds=staged.seconds,
            message=(
                f"{manifest.total_size} bytes verified, swapped in place from the node cache "
                f"(was {staged.from_digest})"
            ),
        )
        write_rank_report(settings.run_dir, RankReport(self.rank, self.world, report))
        remember_loaded(manifest, staged.revision)
        if self.rank == 0 and self.world == 1:
            roots.become_root(settings, dict(staged.tensors), manifest)
        log.info("rank %d/%d: swapped in %s", self.rank, self.world, manifest.digest)

    def _report_failed(self, settings: PluginSettings, digest: str, message: str) -> None:
        report = LoadReport(
            state="Failed",
            manifest_digest=digest or None,
            reason=FailureReason.MIXED_WEIGHTS,
            message=message,
        )
        write_rank_report(settings.run_dir, RankReport(self.rank, self.world, report))


def _check_deadline(deadline: float, when: str) -> None:
    if deadline and time.time() > deadline:
        raise LoadFailure(FailureReason.SWAP_TIMEOUT, f"the swap timed out {when}")


def _feed(
    tensors: list[tuple[str, torch.Tensor]], fail_halfway: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(tensors):
        if fail_halfway and i == len(tensors) // 2:
            raise InjectedFault("injected fault (apply-fail-rank): halfway through load_weights")
        yield item
