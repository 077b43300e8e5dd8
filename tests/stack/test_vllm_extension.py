"""vLLM starts with polar-mitm's worker extension: the stack passes its class, the scale-out
routes and its folder on PYTHONPATH, and the module imports there without polar_mitm (vLLM's
Python does not have it)."""

from __future__ import annotations

import os
import subprocess
import sys

from polar_mitm.stack import launch
from polar_mitm.stack.vllm import RL_ARGS, WORKER_EXTENSION, WORKER_EXTENSION_DIR


def test_start_vllm_passes_the_extension_and_its_path(tmp_path, monkeypatch):
    started = {}

    class Recorded:
        def __init__(self, name, argv, env, log_path):
            started.update(argv=argv, env=env)

        def stop(self):
            pass

    monkeypatch.setattr(launch, "Service", Recorded)
    monkeypatch.setattr(launch, "wait_http", lambda url, service, timeout: None)
    monkeypatch.setattr(launch, "vllm_python", lambda: "python-with-vllm")
    monkeypatch.setenv("PYTHONPATH", "/theirs")
    launch.start_vllm(tmp_path, port=1234, served_name="m", log_path=tmp_path / "log")
    argv = started["argv"]
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION == "weight_pull.WeightPull"
    assert "--enable-scale-out" in argv and set(RL_ARGS) <= set(argv)
    assert started["env"]["PYTHONPATH"].split(os.pathsep) == [str(WORKER_EXTENSION_DIR), "/theirs"]
    assert started["env"]["VLLM_SERVER_DEV_MODE"] == "1"      # /collective_rpc


def test_the_extension_imports_from_its_folder_without_polar_mitm(tmp_path):
    module, cls = WORKER_EXTENSION.split(".")
    probe = (f"import sys; import {module}; assert callable({module}.{cls}.polar_pull_weights); "
             "print(sorted(m for m in sys.modules if m.startswith('polar_mitm')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(WORKER_EXTENSION_DIR)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
