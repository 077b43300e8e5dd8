"""Reproducible harnesses: each CLI installs from the lockfile shipped for it, so two
installs of one pinned version hold the same packages; a same-named CLI on PATH is never
taken for the pinned one."""

from __future__ import annotations

import json
import os
import stat

import pytest

from polar_mitm.rollout import harnesses


def test_every_pinned_harness_has_a_lockfile_of_its_pinned_version():
    for name, pkg in harnesses.PACKAGES.items():
        lock = json.loads((harnesses.LOCKS / name / "package-lock.json").read_text())
        assert lock["packages"][""]["dependencies"] == {pkg.npm: pkg.version}
        assert lock["packages"][f"node_modules/{pkg.npm}"]["version"] == pkg.version
        assert harnesses.install_dir(name).name == f"{name}-{pkg.version}-{harnesses.lock_id(name)}"


def test_pi_installs_exactly_its_lockfile():
    exe = harnesses.install("pi")     # cached after the first install (scripts/install.sh does it)
    installed = json.loads((exe.parents[1] / ".package-lock.json").read_text())["packages"]
    locked = json.loads((harnesses.LOCKS / "pi" / "package-lock.json").read_text())["packages"]
    wanted = {k: v["version"] for k, v in locked.items() if k and not v.get("optional")}
    assert len(wanted) > 100          # pi's whole tree, not only its top level
    assert {k: installed[k]["version"] for k in wanted} == wanted


def test_a_cli_on_path_is_not_taken_for_the_pinned_one(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "pi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 0.0.1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("POLAR_HARNESS_DIR", str(tmp_path / "empty"))
    with pytest.raises(harnesses.HarnessMissing, match="is not used: not the pinned 0.73.1"):
        harnesses.executable("pi")


def test_the_registry_is_what_tasks_and_the_cli_accept():
    """One entry per harness: the task spec, the HTTP API and `polar-mitm rollout --harness`
    take its names; each CLI has its lockfile folder and speaks an API style the gateway has."""
    from polar_mitm.adapters import STYLES
    from polar_mitm.rollout.http_api import TaskIn
    from polar_mitm.rollout.spec import HARNESSES

    assert HARNESSES == tuple(harnesses.HARNESSES)
    assert set(TaskIn.model_fields["harness"].annotation.__args__) == set(harnesses.HARNESSES)
    for name, h in harnesses.HARNESSES.items():
        assert h.name == name
        if h.package:
            assert (h.lock_dir / "package.json").is_file() and harnesses.PACKAGES[name] == h.package
            assert h.api_style in STYLES
        else:
            assert h.lock_dir is None and name not in harnesses.PACKAGES
    assert sorted(p.name for p in harnesses.LOCKS.iterdir() if p.is_dir()) == sorted(harnesses.PACKAGES)
