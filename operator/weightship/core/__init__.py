"""The pure decision core: no kopf, kubernetes, boto3, torch or I/O.

Entry point: `weightship.core.decide.decide(rollout, observed, now) -> Decision`.
Submodules are imported directly (no re-exports here), so that `weightship.api` can use
small helpers such as `weightship.core.durations` without an import cycle.
"""
