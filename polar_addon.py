"""Load with: mitmdump -s polar_addon.py --set polar_db=rollouts.duckdb --set polar_backend=http://127.0.0.1:8000"""
from polar_mitm.addons.gateway import addons  # noqa: F401
