"""What the tests share: stand-ins for vLLM and the providers, fake harnesses, probes run
inside sandboxes, process helpers. Imported as `support.<module>` (tests/ is on sys.path
through tests/conftest.py); the scripts that run as files are found through SUPPORT."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
