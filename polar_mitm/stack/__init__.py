"""What runs on this machine: vLLM, the proxies, the rollout server and its nodes."""
