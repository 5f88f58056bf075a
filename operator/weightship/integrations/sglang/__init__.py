"""weightship in front of an SGLang server: the same interface as the vLLM plugin, for a
server that has no plugin hooks (``python -m weightship.integrations.sglang``).

SGLang has no loader registry, but it can change its weights while it runs
(``update_weights_from_disk``), say which it holds (``weight_version`` in ``model_info``)
and checksum them (``weights_checker``). The adapter, in SGLang's own container, serves the
pod's port: ``GET /weightship/v1/loaded`` and ``POST|GET /weightship/v1/swap`` itself
(``adapter``), SGLang's serving routes forwarded and stamped with the weights that made
each answer (``server``, ``gate``), its admin routes never. Before SGLang reads a model
from the node cache, the adapter checks every chunk of it against the manifest
(``verify``). See docs/integrations.md, "SGLang".
"""
