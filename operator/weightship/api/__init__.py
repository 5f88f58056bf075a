"""weightship.io/v1alpha1 API: pydantic models that are the single source of truth for the
CRDs (`models`, `spec`, `status`, `weightcache`), and the names everyone agrees on
(`names`, `env`).

Nothing is imported here: `weightship.api.names` and `weightship.api.env` are read by the
vLLM plugin, installed without the operator's dependencies (pydantic's models need
google-re2), so importing this package must not load the models.
"""
