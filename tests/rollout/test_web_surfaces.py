"""The operator's web surfaces (issue 41, item 7): the rollout server's API and the dashboard
answer only their own Host names (DNS rebinding), change no state without a JSON content type
(a cross-site form or no-cors fetch), and the rollout server asks for its bearer token once it
has one (always beyond loopback); its nodes and client send it."""

from __future__ import annotations

import os
import stat

import httpx
import pytest

from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer
from polar_mitm.rollout.client import ServerClient, ServerError
from polar_mitm.rollout.http_api import ThreadedUvicorn
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import parse_task
from polar_mitm.rollout.web_guard import TokenError, guarded, load_token

TASK = {"task_id": "t", "instruction": "x", "harness": "command", "command": "true", "num_samples": 1}
JSON = {"content-type": "application/json"}


def _message(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]["message"]


def test_the_rollout_server_answers_only_its_own_names_and_json(tmp_path):
    server = RolloutServer(str(tmp_path / "r.duckdb"), allowed_hosts=["rollouts.internal"]).start()
    try:
        u, port = server.url, server.url.rsplit(":", 1)[1]
        with httpx.Client(trust_env=False) as c:
            # DNS rebinding: the attacker's name pointed at 127.0.0.1 is not one of the server's
            for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}",
                         "localhost:1", f"rollouts.internal.evil:{port}"):
                message = _message(c.get(f"{u}/status", headers={"host": host}), 421)
                assert "is not a name of this server" in message and "--allowed-host" in message
            # nothing of a refused request reaches the app
            assert _message(c.post(f"{u}/tasks", json=TASK, headers={"host": "evil.example"}), 421)
            assert server.task_list() == []
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"rollouts.internal:{port}",
                         f"ROLLOUTS.INTERNAL:{port}"):
                assert c.get(f"{u}/status", headers={"host": host}).status_code == 200, host
            # no state change without application/json: a form, text/plain, or no body at all
            assert c.post(f"{u}/tasks", json=TASK).status_code == 202
            for headers, body in (({}, None), ({"content-type": "text/plain"}, b'{"reason": "x"}'),
                                  ({"content-type": "application/x-www-form-urlencoded"}, b"reason=x"),
                                  ({"content-type": "multipart/form-data; boundary=b"}, b"--b--")):
                message = _message(c.post(f"{u}/tasks/t/cancel", headers=headers, content=body), 415)
                assert "content-type: application/json" in message
            assert server.task_status("t")["state"] == "queued"
            assert _message(c.post(f"{u}/nodes/heartbeat", content=b'{"node_id": "n"}',
                                   headers={"content-type": "text/plain"}), 415)
            assert "n" not in server.status()["nodes"]
            # with JSON it goes through (a body is optional for cancel)
            assert c.post(f"{u}/tasks/t/cancel", headers=JSON).json() == {"task_id": "t", "cancelled": True}
            # no token set (loopback): one sent is taken as it is
            assert c.get(f"{u}/status", headers={"authorization": "Bearer whatever"}).status_code == 200
    finally:
        server.stop()


def test_a_token_is_asked_of_every_request_and_nodes_and_clients_send_it(tmp_path):
    token_file = tmp_path / "server.token"
    token = load_token(token_file, create=True)
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600 and len(token) >= 40
    assert load_token(token_file, create=True) == token          # an existing file is kept
    server = RolloutServer(str(tmp_path / "r.duckdb"), token=token).start()
    node = None
    try:
        u = server.url
        with httpx.Client(trust_env=False) as c:
            for path, method, body in (("/status", "GET", None), ("/tasks", "POST", TASK),
                                       ("/tasks/t/cancel", "POST", {}), ("/policy", "POST", {"version": 1,
                                                                                           "checkpoint": "/c"}),
                                       ("/nodes/heartbeat", "POST", {"node_id": "intruder", "events": []})):
                for auth in ({}, {"authorization": "Bearer " + token[:-1] + "x"}, {"authorization": token},
                             {"authorization": "Basic " + token}):
                    r = c.request(method, u + path, json=body, headers=auth)
                    assert r.status_code == 401 and "bearer token" in r.json()["error"]["message"].lower(), \
                        (path, auth, r.text)
                    assert r.headers["www-authenticate"].startswith("Bearer")
            assert server.task_list() == [] and "intruder" not in server.status()["nodes"] and server.policy is None
            assert c.get(f"{u}/status", headers={"authorization": f"Bearer {token}"}).status_code == 200
        # the loop's client and a node send it
        client = ServerClient(u, token_file=str(token_file))
        assert client.submit(parse_task(TASK))
        with pytest.raises(ServerError, match="Bearer"):
            ServerClient(u, token_file=None).submit(parse_task({**TASK, "task_id": "u"}))
        node = GatewayNode(NodeConfig(server_url=u, proxy_port=1, ca_path="", heartbeat_s=0.1, init_workers=1,
                                      run_workers=1, server_token=token),
                           runtime=LocalRuntime(tmp_path / "s")).start()
        assert server.wait(["t"], timeout=60)
        assert server.group("t")["sessions"][0]["state"] == "done"
        assert node.cfg.node_id in server.status()["nodes"]
        client.close()
    finally:
        if node is not None:
            node.stop()
        server.stop()


def test_beyond_loopback_a_token_is_always_asked_and_token_files_are_checked(tmp_path):
    server = RolloutServer(str(tmp_path / "r.duckdb"), host="0.0.0.0", port=0).start()
    try:
        assert server.token and len(server.token) >= 40           # made, as none was given
        local = f"http://127.0.0.1:{server.url.rsplit(':', 1)[1]}"
        assert httpx.get(f"{local}/status", trust_env=False).status_code == 401
        auth = {"authorization": f"Bearer {server.token}"}
        assert httpx.get(f"{local}/status", trust_env=False, headers=auth).status_code == 200
        # on a wildcard address: any IP address is a way in (none is a rebinding), names are not
        port = server.url.rsplit(":", 1)[1]
        for host, status in ((f"10.1.2.3:{port}", 200), (f"0.0.0.0:{port}", 200), (f"[fe80::1]:{port}", 200),
                             (f"10.1.2.3:{int(port) + 1}", 421), (f"evil.example:{port}", 421)):
            r = httpx.get(f"{local}/status", trust_env=False, headers={**auth, "host": host})
            assert r.status_code == status, (host, r.text)
    finally:
        server.stop()
    with pytest.raises(ValueError, match="beyond loopback"):
        guarded(object(), "0.0.0.0")
    with pytest.raises(ValueError, match="allowed host"):
        guarded(object(), "127.0.0.1", ["bad host:x"])
    loose = tmp_path / "loose.token"
    loose.write_text("secret\n")
    loose.chmod(0o644)
    with pytest.raises(TokenError, match="readable by others"):
        load_token(loose)
    with pytest.raises(TokenError, match="no token file"):
        load_token(tmp_path / "missing.token")
    link = tmp_path / "link.token"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TokenError, match="cannot (read|write)"):   # never through a link
        load_token(link, create=True)
    assert not (tmp_path / "elsewhere").exists()


def test_the_dashboard_answers_only_its_own_names(tmp_path):
    from polar_mitm.dashboard import make_app
    from polar_mitm.store import init_db

    db = tmp_path / "d.duckdb"
    init_db(str(db))
    app = make_app([str(db)])
    http = ThreadedUvicorn(guarded(app, "127.0.0.1", ["dash.lan"], token_beyond_loopback=False), "127.0.0.1", 0,
                           name="dashboard-test")
    http.start()
    try:
        u = f"http://127.0.0.1:{http.port}"
        with httpx.Client(trust_env=False) as c:
            assert c.get(f"{u}/api/info").status_code == 200
            assert c.get(f"{u}/api/info", headers={"host": f"dash.lan:{http.port}"}).status_code == 200
            assert "is not a name of this server" in _message(
                c.get(f"{u}/api/groups", headers={"host": f"rebind.evil:{http.port}"}), 421)
            assert _message(c.get(f"{u}/", headers={"host": "rebind.evil"}), 421)
            assert _message(c.post(f"{u}/api/info", content=b"x", headers={"content-type": "text/plain"}), 415)
    finally:
        http.stop()
