"""The weight format: what a model's weights look like at rest, shared by every package
that writes, moves or loads them.

- ``manifest``: the manifest (files, chunks, tensors; its digest is the model's identity),
  parsed and written canonically; ``entries`` its file, chunk and tensor entries;
  ``bounds`` what one manifest may claim; ``paths`` the names inside a model folder.
- ``build``: building a manifest from a folder or any ``ByteSource``.
- ``chunkhash``: chunk digests (sha256 or BLAKE3) and the piece layer.
- ``layout``: safetensors headers (where each tensor's bytes lie).
- ``checksum``: wsum64, the per-tensor checksum a GPU computes as cheaply as a CPU.
- ``cachedir``: where a staged model lies in the node cache (what the agent writes and
  the loader reads).

It needs the standard library, pydantic, blake3 and numpy (torch only inside
``checksum``'s torch functions), and imports nothing else from weightship: ``data`` (the
data plane), ``loader``, ``seeding`` and the engine integrations build on it.
"""
