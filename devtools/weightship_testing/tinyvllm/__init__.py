"""tinyvllm: a tiny real Llama that real vLLM serves, in a good and a subtly bad version.

- ``build``: the checkpoint (config.json, model.safetensors, a byte-level BPE tokenizer
  trained locally with a chat template), built deterministically, by construction.
- ``deploy``: the pod template of a vLLM ModelRollout and its golden prompts.

See docs/integrations.md.
"""
