"""The pure decision core: no kopf, kubernetes, boto3, torch or I/O.

Entry point: `weightship.core.decide.decide(rollout, observed, now) -> Decision`.
Submodules are imported directly (no re-exports here). The core imports `weightship.api`
(the models it decides on, and the grammars the spec validates: `api.durations`,
`api.promql`); `weightship.api` imports nothing from here.
"""
