"""dualpath inside vLLM: the KV connector, the cache geometry and the model preparation.

Every module here runs in the vLLM venv (``make vllm-env``, ``.venv-vllm``) and may import
vllm and torch; nothing outside ``integrations`` imports this package (docs/vllm.md).
"""
