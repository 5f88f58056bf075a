"""The data plane: the node chunk cache, peer-to-peer exchange, S3 and staging.

The node agent calls `stage()`; `weightship manifest` and `weightship publish` use
`weightformat.build.build_manifest()` and `publish()`. The weight format itself
(manifests, chunk hashes, safetensors layout) is `weightship.weightformat`; nothing here
imports `weightship.loader`. See docs/data-plane.md.
"""
