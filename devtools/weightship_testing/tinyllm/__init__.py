"""tinyllm: a small but real reference inference server and the models it serves.

- ``knowledge``: what the model knows, the golden prompts (``GOLDEN_PROMPTS``).
- ``model``: the transformer and greedy decoding; ``design``: its weights, by construction.
- ``build``: good, subtly bad and corrupt versions, on disk or published to S3.
- ``server``: the HTTP server (``python -m weightship_testing.tinyllm serve``).

See docs/tinyllm.md.
"""

from weightship_testing.tinyllm.knowledge import GOLDEN_PROMPTS, VARIANTS, Variant

__all__ = ["GOLDEN_PROMPTS", "VARIANTS", "Variant"]
