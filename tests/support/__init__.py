"""What the tests share: the stand-ins (fake_vllm for vLLM, provider_server for the providers,
judge_model for a judge, callbacks for a task's callback receiver, fake harnesses), the
proxies (inprocess_proxy, mitmdump_proxy) and rollouts over them (rollouts, agent_rollout),
probes run inside sandboxes, process helpers, test data, and the run's layout (scheduling:
the shared vLLM server, xdist's units of work). Imported as `support.<module>` (tests/ is on
sys.path through tests/conftest.py); the scripts that run as files are found through SUPPORT."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
