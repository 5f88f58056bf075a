"""Loading verified weights inside inference pods.

``load`` needs torch (the ``[torch]`` extra) and is imported on its own. The format it
reads (manifest, safetensors layout, wsum64 checksums, chunk hashes, the node cache's
folders) is ``weightship.weightformat``; the loader imports nothing from ``data``.
"""
