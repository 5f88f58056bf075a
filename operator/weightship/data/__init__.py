"""The data plane: manifests, the node chunk cache, peer-to-peer exchange and staging.

The node agent calls `stage()`; `weightship manifest` and `weightship publish` use
`build_manifest()` and `publish()`. See docs/data-plane.md.
"""
