"""The phase shown to users and Argo CD, computed from what the rollout is doing.

Phase → Argo CD health (shipped as health.lua):
  Pending, Prefetching, Progressing → Progressing
  Paused                            → Suspended (blocks sync waves, as a paused Rollout does)
  Healthy                           → Healthy
  Degraded (aborted, InvalidSpec)   → Degraded
"""

from __future__ import annotations

from weightship.api.status import Phase

ARGOCD_HEALTH: dict[Phase, str] = {
    "Pending": "Progressing",
    "Prefetching": "Progressing",
    "Progressing": "Progressing",
    "Paused": "Suspended",
    "Healthy": "Healthy",
    "Degraded": "Degraded",
}


def argocd_health(phase: Phase, *, generation: int, observed_generation: int) -> str:
    """Health as Argo CD should report it; an unobserved generation is still Progressing."""
    if observed_generation != generation:
        return "Progressing"
    return ARGOCD_HEALTH[phase]


def compute_phase(
    *, invalid: bool, aborted: bool, paused: bool, prefetching: bool, settled: bool
) -> Phase:
    """Precedence: a broken spec or an abort beats everything, then pauses, then progress."""
    if invalid or aborted:
        return "Degraded"
    if paused:
        return "Paused"
    if prefetching:
        return "Prefetching"
    if settled:
        return "Healthy"
    return "Progressing"
