"""Code that runs inside vLLM's worker processes (under vLLM's own Python, where polar_mitm is
not installed): the stack puts this directory on vLLM's PYTHONPATH and names the extension
with --worker-extension-cls (stack/vllm.py). Its modules import only the standard library,
torch and vLLM."""
