"""A small test kubelet that runs the pods bound to a "process node" as local processes.

Each pod gets its own network namespace and IP on the host bridge, its own /etc/hosts
and resolv.conf, and its own mount namespace in which hostPath, emptyDir, configMap,
secret and projected volumes appear at their mountPaths. Readiness follows Kubernetes:
Ready = every readiness probe passes AND every readiness gate condition is True.
See docs/process-nodes.md for what is supported and how images map to commands.
"""
