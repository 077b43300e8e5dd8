import base64

from polar_mitm.addons import sessions


def attr(headers=None, query="", user=None, scheme="auto"):
    return sessions.attribute(headers=headers or {}, query=query, proxy_auth_user=user,
                              client_host="127.0.0.1", salt="salt", scheme=scheme)


def test_proxy_user_names_the_session():
    s = attr({"x-api-key": "sk-ant-real"}, user="fix-bug-12~3")
    assert (s.session_id, s.task_id, s.source) == ("fix-bug-12~3", "fix-bug-12", "proxy_user")


def test_marked_key_is_the_session_and_real_keys_are_hashed():
    assert attr({"x-api-key": "polar-t~1"}).session_id == "t~1"
    assert attr({"authorization": "Bearer polar-t~2"}).session_id == "t~2"
    assert attr({"x-goog-api-key": "polar-t~3"}).session_id == "t~3"
    assert attr(query="alt=sse&key=polar-t~4").session_id == "t~4"
    hashed = attr({"x-api-key": "sk-ant-real-secret"})
    assert hashed.source == "key_hash" and hashed.session_id.startswith("key-")
    assert "secret" not in hashed.session_id
    assert hashed == attr({"x-api-key": "sk-ant-real-secret"})  # stable for one salt
    other_salt = sessions.attribute(headers={"x-api-key": "sk-ant-real-secret"}, query="",
                                    proxy_auth_user=None, client_host="h", salt="s2")
    assert other_salt.session_id != hashed.session_id


def test_default_session_per_client():
    s = attr({"user-agent": "claude-cli/2.1.197 (external, sdk-cli)"})
    assert (s.session_id, s.source, s.task_id) == ("default-127.0.0.1-claude-cli", "default", None)


def test_schemes():
    assert attr({"x-api-key": "polar-k"}, user="u", scheme="api-key").session_id == "k"
    assert attr({"x-api-key": "polar-k"}, scheme="proxy-user").source == "default"
    assert attr({"x-api-key": "polar-k"}, user="u", scheme="client").source == "default"


def test_proxy_authorization_parsing_ignores_the_password():
    header = "Basic " + base64.b64encode(b"run~7:secret-pass").decode()
    assert sessions.proxy_user(header) == "run~7"
    assert sessions.proxy_user("Basic !!!") is None and sessions.proxy_user(None) is None


def test_query_key_is_redacted():
    assert sessions.redact_query("/v1beta/models/m:generateContent?key=AIza123&alt=sse") == \
        "/v1beta/models/m:generateContent?alt=sse"
    assert sessions.redact_query("/x?key=1") == "/x"


def test_a_loop_task_id_parses_back_into_its_parts():
    from polar_mitm.session_ids import RunTask, parse_run_task, run_task_id
    for task, run, it, held in (("fix", "de58bd", 0, False), ("add-1-5", "a45f39", 12, True),
                                ("a@b", "r1", 3, False)):   # the run's "@" is the last one
        assert parse_run_task(run_task_id(task, run, it, held)) == RunTask(task, run, it, held)
    for plain in ("fix", "fix~0", "fix@run", "fix@run.x", "fix@.3", "fix@run.3.evals"):
        assert parse_run_task(plain) is None, plain
