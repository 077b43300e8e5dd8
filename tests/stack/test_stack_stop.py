"""Stack.stop stops every part whatever fails: a server whose final fold fails (or an
interrupt inside it) must not leave the proxy running, holding the database from the next run."""

from __future__ import annotations

import pytest

from polar_mitm.stack.local import Stack


class Part:
    def __init__(self, name: str, seen: list[str], fail: bool = False):
        self.name, self.seen, self.fail = name, seen, fail

    def stop(self) -> None:
        self.seen.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed to stop")


def test_every_part_stops_and_the_first_failure_is_raised():
    seen: list[str] = []
    stack = Stack()
    stack.nodes[:] = [Part("node-a", seen), Part("node-b", seen, fail=True)]
    stack.server = Part("server", seen, fail=True)      # type: ignore[assignment]
    stack.services[:] = [Part("vllm", seen), Part("proxy", seen, fail=True)]
    with pytest.raises(RuntimeError, match="node-b failed to stop"):
        stack.stop()
    assert seen == ["node-b", "node-a", "server", "proxy", "vllm"]
    assert not stack.nodes and stack.server is None and not stack.services
    stack.stop()    # again: nothing left, nothing raised
