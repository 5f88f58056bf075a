"""The node agent (`weightship agent`): stages the weights that rollouts targeting this
node want, serves chunks to peer agents, and reports its cache in a WeightCache.

Pure parts: `desired` (what to stage and pin) and `status` (WeightCache status and write
rate). Adapters: `kube`. The loop: `main`. See docs/agent.md.
"""
