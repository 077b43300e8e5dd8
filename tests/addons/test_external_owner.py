"""polar_weights_owner=external (a Ray replica shared by several gateways, issue 43): the
replica's owner swaps and tags its weights (cluster/replica.py swap()); the gateways never
pause or reload it, a sync only adopts the version number, every token carries the engine's
own tag, and a restarted (untagged) replica loses the version until its owner loads one."""

from __future__ import annotations

import threading
import time

import httpx

from polar_mitm.cluster.replica import swap
from polar_mitm.store import query
from support.fake_vllm import FakeVLLM

from test_inflight_sync import ask, control, health, _until

TOKEN = "inflight-token"


def test_gateways_sharing_a_replica_never_touch_its_weights_and_record_its_tags(start_proxy, tmp_path):
    with FakeVLLM("scripted", delay=2.0) as fake:
        sets = [f"polar_control_token={TOKEN}", "polar_weights_owner=external", "polar_version_check=0.2"]
        a, b = start_proxy(fake.url, sets), start_proxy(fake.url, sets, root=tmp_path / "b")
        swap(fake.url, 0, None)                       # the owner tags what it serves at start
        assert fake.weight_version == "polar-v0"
        across = threading.Thread(target=ask, args=(a, "across~0"))
        across.start()
        assert _until(lambda: len(fake.bodies) >= 1)
        time.sleep(0.7)
        figures = swap(fake.url, 1, None)             # the owner moves it to v1 mid-call (a tag: no pull)
        for proxy in (a, b):                          # then the gateways adopt v1: nothing is held or loaded
            report = control(proxy, "/_polar/sync", {"checkpoint": "/ckpt/1", "version": 1}).json()
            assert report["version"] == 1 and report["mode"] == "inflight" and report["drained"] == 0, report
        ask(b, "after~0")
        across.join(60)
        assert health(a)["policy"]["verified"] and health(b)["policy"]["verified"]
    # only the owner's swap reached the engine: no pause, reload or tag from a gateway
    assert fake.control == ["/update_weight_version", "/update_weight_version"], fake.control
    assert figures["version"] == 1 and figures["stall_s"] >= 0
    rows = dict(query(a.db, "SELECT session_id, token_versions FROM calls")[1])
    versions = rows["across~0"]
    assert versions[0] == 0 and versions[-1] == 1, versions       # exact at the token, the engine's tags
    assert set(dict(query(b.db, "SELECT session_id, token_versions FROM calls")[1])["after~0"]) == {1}


def test_a_restarted_replica_is_no_version_until_its_owner_loads_one(start_proxy):
    with FakeVLLM(delay=0.05) as fake:
        proxy = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_weights_owner=external",
                                       "polar_version_check=0.2"])
        swap(fake.url, 3, None)
        control(proxy, "/_polar/sync", {"checkpoint": "/ckpt/3", "version": 3})
        ask(proxy, "before~0")
        fake.restart()                                # back untagged ("default"), on its base weights
        assert _until(lambda: not health(proxy)["policy"]["verified"])
        ask(proxy, "between~0")
        assert "/collective_rpc" not in fake.control and fake.weight_version == "default"   # never reloaded
        swap(fake.url, 3, None)                       # its owner loads and tags it
        assert _until(lambda: health(proxy)["policy"]["verified"])
        ask(proxy, "after~0")
        verify = httpx.post(proxy.base_url + "/_polar/verify", headers={"authorization": f"Bearer {TOKEN}"},
                            timeout=10, trust_env=False).json()
    assert verify["state"] == "ok" and verify["epoch"] >= 1, verify
    rows = dict(query(proxy.db, "SELECT session_id, token_versions FROM calls")[1])
    assert set(rows["before~0"]) == {3} and set(rows["after~0"]) == {3}, rows
    assert set(rows["between~0"]) == {None}, rows     # sampled by weights nobody loaded: never trained


def test_a_gateway_pinned_to_an_engine_rank_sends_every_call_there(start_proxy, tmp_path):
    """vLLM's own data parallelism: a gateway per engine rank (cluster/node_host.py) pins each
    of its sessions' calls to that engine (X-data-parallel-rank), for its prefix cache."""
    with FakeVLLM(delay=0.01) as fake:
        pinned = start_proxy(fake.url, [f"polar_control_token={TOKEN}", "polar_dp_rank=1"])
        free = start_proxy(fake.url, [f"polar_control_token={TOKEN}"], root=tmp_path / "free")
        ask(pinned, "pinned~0")
        ask(pinned, "pinned~0", stream=True)
        pinned_ranks = list(fake.ranks)
        ask(free, "free~0")
    paths = {p for p, _ in pinned_ranks}
    assert {"/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"} <= paths
    assert {r for _, r in pinned_ranks} == {"1"}
    assert fake.ranks == pinned_ranks            # the other gateway named no rank: vLLM balances its calls
