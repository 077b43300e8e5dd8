"""Files shipped with a task (issue 43: no shared filesystem): a rollout server with
ship_files packs every local path a task names (its workspace, a local git repository, a local
image, each prepare copy) into content-addressed blobs; a node fetches each blob once from
GET /files/{sha256} into its own cache, refuses a tampered or unsafe one, and runs the
session on its cached copies. The proof that the node never read the submitter's folder: the
folder is deleted after submission, before the node starts."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import tarfile
import threading
from pathlib import Path

import httpx
import pytest

from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer, TaskError, parse_task
from polar_mitm.rollout.files_cache import FilesError, check_members, unpack
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.shipped_files import CONTENT, BlobStore, ShipError, localized
from polar_mitm.rollout.spec import TaskExists, task_from_json
from support import oci
from support.git_repo import commit


def _counting(server: RolloutServer) -> list[str]:
    """The blobs the server's GET /files/{sha256} served, in order (the route calls file_blob)."""
    served: list[str] = []
    real = server.file_blob
    lock = threading.Lock()

    def counted(sha256: str) -> str | None:
        with lock:
            served.append(sha256)
        return real(sha256)

    server.file_blob = counted      # type: ignore[method-assign]
    return served


def _node(server: RolloutServer, tmp_path: Path, runtime: LocalRuntime, **cfg) -> GatewayNode:
    return GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", heartbeat_s=0.1,
                                  files_cache=str(tmp_path / "node" / "cache"), server_token=server.token, **cfg),
                       runtime=runtime).start()


def _submitter(tmp_path: Path) -> Path:
    """The submitting machine's folder: a workspace (a link inside it), a file a prepare
    action copies in, and a busybox image (an OCI layout)."""
    folder = tmp_path / "submitter"
    ws = folder / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "data.txt").write_text("from the workspace\n")
    (ws / "sub" / "again").symlink_to("../data.txt")
    (folder / "extra.txt").write_text("from the copy action\n")
    oci.busybox_image(folder / "image")
    return folder


def test_a_node_runs_a_task_from_shipped_files_alone_each_blob_fetched_once(tmp_path, monkeypatch):
    monkeypatch.setenv("POLAR_IMAGE_CACHE", str(tmp_path / "node" / "images"))
    folder = _submitter(tmp_path)
    server = RolloutServer(str(tmp_path / "server" / "r.duckdb"), ship_files=True, token="t0k3n" * 8).start()
    served = _counting(server)
    node = None
    try:
        task = {"task_id": "shipped", "instruction": "x", "harness": "command", "num_samples": 2,
                "workspace": str(folder / "ws"), "command": "cat data.txt sub/again extra.txt",
                "evaluator": "grep -q 'from the copy action' extra.txt",
                "runtime": {"image": str(folder / "image"), "network": "none",
                            "prepare": [{"copy": str(folder / "extra.txt"), "to": "extra.txt"}]}}
        server.submit(task)
        spec = server.task_views(["shipped"])["shipped"].spec
        assert set(spec.files) == {str(folder / "ws"), str(folder / "extra.txt"), str(folder / "image")}
        assert spec.workspace.path == str(folder / "ws")     # the task keeps its paths; files maps them
        blobs = Path(f"{server.db}.files")
        assert sorted(p.name for p in blobs.iterdir()) == sorted(f"{sha}.tar" for sha in spec.files.values())
        # the submitter's folder is gone before the node starts: nothing of it can be read
        shutil.rmtree(folder)
        node = _node(server, tmp_path, LocalRuntime(tmp_path / "node" / "sessions", sandbox="bwrap"),
                     init_workers=2, run_workers=2)
        assert server.wait(["shipped"], timeout=120)
        sessions = server.group("shipped")["sessions"]
    finally:
        if node is not None:
            node.stop()
        server.stop()
    for s in sessions:
        assert s["state"] == "done" and s["reward"] == 1.0, s
        out = s["stats"]["harness_output"]
        assert out.count("from the workspace") == 2 and "from the copy action" in out, out
        assert s["stats"]["files_s"] >= 0
    # two sessions, three blobs: each fetched once, into the node's cache
    assert sorted(served) == sorted(spec.files.values()) and node.files.fetches == 3
    cache = tmp_path / "node" / "cache"
    assert {p.name for p in cache.iterdir() if not p.name.startswith(".")} == set(spec.files.values())
    ws_copy = cache / spec.files[str(tmp_path / "submitter" / "ws")] / CONTENT
    assert (ws_copy / "data.txt").read_text() == "from the workspace\n"
    assert os.readlink(ws_copy / "sub" / "again") == "../data.txt"       # a link stays a link
    assert not folder.exists()


def test_a_local_git_workspace_is_shipped_and_a_resubmission_or_restart_keeps_the_files(tmp_path):
    repo = tmp_path / "submitter" / "repo"
    first = commit(repo, {"a.txt": "old\n"})
    commit(repo, {"a.txt": "new\n"})
    db = str(tmp_path / "server" / "r.duckdb")
    task = {"task_id": "git", "instruction": "x", "harness": "command", "command": "cat a.txt",
            "workspace": {"git": str(repo), "commit": first}, "evaluator": "grep -q old a.txt"}
    server = RolloutServer(db, ship_files=True).start()
    try:
        server.submit(task)
        files = server.task_views(["git"])["git"].spec.files
        assert list(files) == [str(repo)]
        with pytest.raises(TaskExists):          # the same task again: files do not make it another
            server.submit(task)
        assert server.blobs is not None and server.blobs.packed == 1
    finally:
        server.stop()
    shutil.rmtree(repo)
    server = RolloutServer(db, ship_files=True).start()      # restored from the journal, files too
    node = None
    try:
        assert server.task_views(["git"])["git"].spec.files == files
        node = _node(server, tmp_path, LocalRuntime(tmp_path / "node" / "sessions"))
        assert server.wait(["git"], timeout=60)
        (s,) = server.group("git")["sessions"]
    finally:
        if node is not None:
            node.stop()
        server.stop()
    assert s["state"] == "done" and s["reward"] == 1.0 and "old" in s["stats"]["harness_output"], s


def test_a_tampered_blob_is_refused_and_the_session_fails_unscored(tmp_path):
    ws = tmp_path / "submitter" / "ws"
    ws.mkdir(parents=True)
    (ws / "data.txt").write_text("the real content\n")
    server = RolloutServer(str(tmp_path / "server" / "r.duckdb"), ship_files=True).start()
    served = _counting(server)
    node = None
    try:
        server.submit({"task_id": "tampered", "instruction": "x", "harness": "command", "command": "cat data.txt",
                       "workspace": str(ws), "evaluator": "echo 1"})
        (sha,) = server.task_views(["tampered"])["tampered"].spec.files.values()
        blob = Path(f"{server.db}.files") / f"{sha}.tar"
        data = bytearray(blob.read_bytes())
        at = data.index(b"the real content")
        data[at:at + 8] = b"EVILEVIL"                   # a tar still, of other content
        blob.write_bytes(bytes(data))
        node = _node(server, tmp_path, LocalRuntime(tmp_path / "node" / "sessions"))
        node.files.backoff = 0.01
        assert server.wait(["tampered"], timeout=60)
        (s,) = server.group("tampered")["sessions"]
    finally:
        if node is not None:
            node.stop()
        server.stop()
    assert s["state"] == "failed" and s["reward"] is None and s["stats"]["unscored"] == "task_files", s
    assert "sha256" in s["reason"] and "not the one the task names" in s["reason"], s["reason"]
    assert served == [sha] * 3 and node.files.fetches == 3          # retried, then given up
    assert not (tmp_path / "node" / "cache" / sha).exists()
    assert "harness_output" not in s["stats"]                       # no harness ran


# -- what the node unpacks -------------------------------------------------------------------------
def _tar(path: Path, members: list[tuple[str, str, str | bytes]]) -> Path:
    """A tar of (name, kind, data or link target) members, as a hostile server could send."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "file":
                raw = data if isinstance(data, bytes) else data.encode()
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
            else:
                info.type = {"link": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "char": tarfile.CHRTYPE,
                             "fifo": tarfile.FIFOTYPE}[kind]
                info.linkname = data if isinstance(data, str) else ""
                tar.addfile(info)
    return path


TOP = (CONTENT, "dir", "")


@pytest.mark.parametrize("members, why", [
    ([TOP, ("content/../escaped", "file", "x")], "'..'"),
    ([TOP, ("/tmp/escaped", "file", "x")], "absolute path"),
    ([TOP, ("elsewhere", "file", "x")], "outside content/"),
    ([TOP, ("content/l", "link", "../../../etc")], "points out of it"),
    ([TOP, ("content/l", "link", "/etc")], "points out of it"),
    # each link alone stays inside; through one another they leave: a -> ., b -> a/..
    ([TOP, ("content/a", "link", "."), ("content/b", "link", "a/..")], "points out of it"),
    ([TOP, ("content/l", "link", "sub"), ("content/sub", "dir", ""), ("content/l/x", "file", "x")], "not one of its"),
    ([TOP, ("content/h", "hard", "/etc/passwd")], "hard link"),
    ([TOP, ("content/tty", "char", "")], "character device"),
    ([TOP, ("content/f", "fifo", "")], "fifo"),
    ([TOP, ("content/x", "file", "one"), ("content/x", "file", "two")], "twice"),
    ([("content", "link", ".")], "no content"),
])
def test_an_unsafe_blob_is_refused_before_anything_is_unpacked(tmp_path, members, why):
    blob = _tar(tmp_path / "b.tar", members)
    dest = tmp_path / "out"
    with pytest.raises(FilesError, match=why):
        unpack(blob, dest)
    assert not dest.exists() and not (tmp_path / "escaped").exists() and not Path("/tmp/escaped").exists()


def test_a_safe_blob_unpacks_with_its_links_inside_and_no_setuid_bit(tmp_path):
    blob = _tar(tmp_path / "b.tar", [TOP, ("content/d", "dir", ""), ("content/d/run", "file", "#!/bin/sh\n"),
                                     ("content/d/up", "link", "../d/run")])
    with tarfile.open(blob) as tar:
        check_members(tar.getmembers())
    blob2 = tmp_path / "b2.tar"
    with tarfile.open(blob) as src, tarfile.open(blob2, "w") as out:
        for m in src.getmembers():
            if m.name == "content/d/run":
                m.mode = 0o4755
            out.addfile(m, src.extractfile(m) if m.isfile() else None)
    unpack(blob2, tmp_path / "out")
    run = tmp_path / "out" / CONTENT / "d" / "run"
    assert run.read_text() == "#!/bin/sh\n" and (run.stat().st_mode & 0o7777) == 0o755
    assert os.readlink(tmp_path / "out" / CONTENT / "d" / "up") == "../d/run"


# -- what the server packs ---------------------------------------------------------------------------
def test_packing_is_deterministic_cached_and_keeps_links_inside(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "s").mkdir(parents=True)
        (d / "s" / "f.txt").write_text("same\n")
        (d / "l").symlink_to("s/f.txt")
    os.utime(b / "s" / "f.txt", (1, 1))       # mtimes and owners are not in a blob
    store = BlobStore(tmp_path / "blobs")
    sha = store.pack(str(a))
    assert store.pack(str(b)) == sha and store.pack(str(a)) == sha
    assert store.packed == 2          # a again: known by its stat fingerprint, not packed again
    assert BlobStore(tmp_path / "other").pack(str(a)) == sha     # another store: the same bytes
    (a / "s" / "f.txt").write_text("changed\n")
    assert store.pack(str(a)) != sha
    (a / "out").symlink_to("../b")
    with pytest.raises(ShipError, match="the link out -> ../b points out of it"):
        store.pack(str(a))
    assert store.path_of("../blobs") is None and store.path_of("A" * 64) is None
    assert store.path_of(sha) == tmp_path / "blobs" / f"{sha}.tar"


def test_a_link_out_of_a_workspace_refuses_the_task_and_clients_cannot_name_files(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "python").symlink_to("/usr/bin/python3")
    server = RolloutServer(str(tmp_path / "r.duckdb"), ship_files=True).start()
    try:
        with pytest.raises(TaskError, match=r"python -> /usr/bin/python3 points out of it"):
            server.submit({"task_id": "t", "instruction": "x", "harness": "command", "command": "true",
                           "workspace": str(ws)})
        assert server.task_list() == []
        forged = {"task_id": "f", "instruction": "x", "harness": "command", "command": "true",
                  "files": {"/etc": "0" * 64}}
        with pytest.raises(TaskError, match="rollout server's own"):
            parse_task(forged)
        r = httpx.post(f"{server.url}/tasks", json=forged, trust_env=False)
        assert r.status_code == 400 and "files" in r.text
    finally:
        server.stop()
    # a stored spec brings its files back (the journal), and one without keeps none
    spec = task_from_json({"task_id": "s", "instruction": "x", "harness": "command", "command": "true",
                           "files": {"/w": "a" * 64}})
    assert spec.files == {"/w": "a" * 64} and spec.to_json()["files"] == {"/w": "a" * 64}
    assert "files" not in dataclasses.replace(spec, files={}).to_json()


def test_files_are_served_with_the_token_and_only_blobs_the_server_packed(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "f").write_text("x")
    token = "s3cret" * 8
    server = RolloutServer(str(tmp_path / "r.duckdb"), ship_files=True, token=token).start()
    (tmp_path / "r.duckdb.files" / ("b" * 64)).write_text("not a blob: no .tar")
    try:
        server.submit({"task_id": "t", "instruction": "x", "harness": "command", "command": "true",
                       "workspace": str(ws)})
        (sha,) = server.task_views(["t"])["t"].spec.files.values()
        auth = {"authorization": f"Bearer {token}"}
        with httpx.Client(trust_env=False) as c:
            assert c.get(f"{server.url}/files/{sha}").status_code == 401
            r = c.get(f"{server.url}/files/{sha}", headers=auth)
            assert r.status_code == 200 and r.content == (tmp_path / "r.duckdb.files" / f"{sha}.tar").read_bytes()
            for bad in ("b" * 64, sha.upper(), "..%2Fr.duckdb", "%2E%2E", sha[:-1], "r.duckdb"):
                assert c.get(f"{server.url}/files/{bad}", headers=auth).status_code == 404, bad
    finally:
        server.stop()
    plain = RolloutServer(str(tmp_path / "p.duckdb")).start()     # no ship_files: nothing served
    try:
        assert plain.blobs is None and httpx.get(f"{plain.url}/files/{sha}", trust_env=False).status_code == 404
    finally:
        plain.stop()


def test_localized_rewrites_only_the_paths_the_task_ships():
    task = parse_task({"task_id": "t", "instruction": "x", "harness": "command", "command": "true",
                       "workspace": {"git": "file:///src/repo", "commit": "abc"},
                       "runtime": {"image": "oci-archive:/src/img.tar:v1", "network": "none",
                                   "prepare": [{"copy": "/src/a", "to": "a"}, "echo hi"],
                                   "eval_prepare": [{"copy": "/src/b", "to": "b"}]}})
    out = localized(task, {"file:///src/repo": "/c/1/content", "/src/img.tar": "/c/2/content", "/src/a": "/c/3/content"})
    assert out.workspace.git == "/c/1/content" and out.workspace.commit == "abc"
    assert out.runtime is not None and out.runtime.image == "oci-archive:/c/2/content:v1"
    assert [a.copy for a in out.runtime.prepare] == ["/c/3/content", None]
    assert out.runtime.eval_prepare[0].copy == "/src/b"          # not shipped: as it was
    assert localized(task, {}) == task
