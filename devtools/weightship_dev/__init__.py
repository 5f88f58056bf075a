"""Developer tooling: a real local Kubernetes control plane with KWOK and process nodes.

Nothing in here runs in production; it exists so that tests and the demo talk to a real
kube-apiserver, with pods that really run, on a machine without Docker.
"""
