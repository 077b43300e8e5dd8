"""How a call is stored once: its request text and prompt token ids as a delta against an
earlier call of the same session. Pure functions and a bounded cache; no SQL here.

A harness re-sends the whole conversation on every turn, and vLLM's prompt for turn k
extends turn k-1's prompt + sampled tokens. So against the right base call:
    request text = base[:prefix] + middle + base[len(base) - suffix:]
    prompt ids   = (base prompt ids + base token ids)[:shared] + suffix ids
The calls view (schema.py) applies these rules recursively; `apply_ids` here is the same
rule in Python, for the trainer's reader, which rebuilds whole sessions at once. (The exact,
unblocked reference algorithms the tests check these against are tests/support/delta_oracles.py.)"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import orjson

_CHUNK = 4096


def common_prefix(a, b) -> int:
    """Length of the common prefix of two str (or two bytes): compared a chunk at a time,
    then bisected inside the first chunk that differs, so it runs at memcmp speed."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:
        i += _CHUNK
    if i >= n:
        return n
    lo, hi = i, min(i + _CHUNK, n)   # a[:lo] == b[:lo], and they differ before hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def apply_ids(base_prompt: Sequence[int], base_tokens: Sequence[int], shared: int,
              suffix: Sequence[int]) -> list[int]:
    head = list(base_prompt[:shared])
    if shared > len(base_prompt):
        head += base_tokens[:shared - len(base_prompt)]
    return head + list(suffix)


def apply_prompt(known: Mapping[str, tuple[list[int] | None, Sequence[int]]], base: str | None,
                 shared: int | None, suffix: Sequence[int]) -> list[int] | None:
    """A call's prompt ids from its stored delta (prompt_shared, prompt_suffix): the suffix
    alone when it has no base, else the first `shared` of its base's prompt + sampled ids, then
    the suffix. known: the session's earlier calls, call_id -> (prompt ids, sampled ids).
    None when its base is not known (a broken chain)."""
    if base is None:
        return list(suffix)
    if base not in known:
        return None
    base_prompt, base_tokens = known[base]
    return apply_ids(base_prompt or [], base_tokens, shared or 0, suffix)


def apply_text(base_text: str, prefix: int | None, suffix: int | None, middle: str | None) -> str:
    """A request text from its stored delta against its base's: the calls view's rule,
    left(base, prefix) || middle || right(base, suffix)."""
    return (base_text[:prefix or 0] + (middle or "")
            + (base_text[max(len(base_text) - suffix, 0):] if suffix else ""))


def ids_json(ids) -> bytes | None:
    """Token ids as JSON text (b"[1,2,3]"): how the proxy carries them from vLLM's answer
    to DuckDB without making a Python int of each one."""
    if ids is None:
        return None
    if isinstance(ids, (bytes, bytearray)):
        return bytes(ids)
    return orjson.dumps(list(ids))


def count_ids(text: bytes) -> int:
    return 0 if len(text) <= 2 else text.count(b",") + 1


def join_ids(prompt: bytes, tokens: bytes | None) -> bytes:
    """JSON of prompt + tokens."""
    if not tokens or len(tokens) <= 2:
        return prompt
    if len(prompt) <= 2:
        return tokens
    return prompt[:-1] + b"," + tokens[1:]


TEXT_BLOCK = 1024   # characters of request text per fingerprint block
TAIL_BLOCKS = 64    # a common suffix (the tools after the messages) is looked for in the last 64 KB
IDS_BLOCK = 2048    # bytes of id JSON per fingerprint block


def block_hashes(data, block: int, *, from_end: bool = False, limit: int | None = None) -> bytes:
    """hash() of each whole block of a str or bytes, packed as int64: from the start, or
    aligned to the end (for common suffixes), `limit` blocks at most."""
    n = len(data)
    count = n // block if limit is None else min(n // block, limit)
    if from_end:
        blocks = (data[n - (k + 1) * block:n - k * block] for k in range(count))
    else:
        blocks = (data[k:k + block] for k in range(0, count * block, block))
    return array("q", map(hash, blocks)).tobytes()


def block_commas(ids: bytes, blocks: int, known: array) -> array:
    """Commas in ids up to the end of each of its first `blocks` IDS_BLOCKs; those of
    `known` (counted in a base call with the same leading bytes) are taken as they are."""
    out = array("i", known[:blocks])
    total = out[-1] if out else 0
    for k in range(len(out), blocks):
        total += ids.count(b",", k * IDS_BLOCK, (k + 1) * IDS_BLOCK)
        out.append(total)
    return out


def shared_blocks(a: bytes, b: bytes) -> int:
    """How many leading fingerprint blocks two packed hash lists share."""
    return common_prefix(a, b) // 8


@dataclass
class _Entry:
    """A remembered call: fingerprints, not its text, so a cache entry costs a few KB
    where the call's request and prompt are hundreds. Blocks with equal hashes are taken
    as equal (64-bit hashes: a false match is about as likely as a disk's silent error)."""
    call_id: str
    text_len: int
    text_head: bytes    # block hashes of the request text, from the start
    text_tail: bytes    # ... aligned to its end
    ids_head: bytes     # block hashes of prompt + sampled ids, as JSON text
    ids_commas: array   # commas in that JSON up to the end of each of those blocks

    @property
    def size(self) -> int:
        return len(self.text_head) + len(self.text_tail) + len(self.ids_head) + 4 * len(self.ids_commas) + 300


@dataclass(frozen=True)
class CallDelta:
    base_call: str | None     # None: stored whole
    request_prefix: int
    request_suffix: int
    request_middle: str
    prompt_shared: int
    prompt_suffix: bytes | None   # JSON text of the ids after the shared ones


@dataclass
class CallPrint:
    """A call's fingerprints, made once: to find its delta, and to remember it by."""
    text: str
    prompt: bytes | None
    text_head: bytes
    text_tail: bytes
    prompt_head: bytes
    # commas up to the end of each leading id block, as its delta's base has them (the same
    # bytes): counting a 300 KB prompt's ids costs ~0.2 ms a call, its new blocks a few us
    known_commas: array = field(default_factory=lambda: array("i"))


def fingerprint(text: str, prompt) -> CallPrint:
    prompt = ids_json(prompt)
    return CallPrint(text, prompt, block_hashes(text, TEXT_BLOCK),
                     block_hashes(text, TEXT_BLOCK, from_end=True, limit=TAIL_BLOCKS),
                     block_hashes(prompt, IDS_BLOCK) if prompt else b"")


class DeltaCache:
    """The last few calls of each session, to compute deltas against; least recently used
    sessions are forgotten past `budget` bytes (their next call is then stored whole).

    Shared parts are found a block at a time (TEXT_BLOCK, IDS_BLOCK), so a delta may
    carry up to a block more than the exact minimum on each side; it is always exact."""

    # 8 MB holds ~260 sessions of 200 KB requests (8 calls each, ~30 KB): more than run at
    # once on one node. Finished sessions only leave by age, so the cache sits at its budget.
    # 8 calls, not 3: parallel sub-agents under one session key interleave their turns,
    # and each needs its own previous call as a base (with 3, half the calls of 4-8
    # sub-agents were stored whole: 147 KB log lines instead of 30).
    def __init__(self, budget: int = 8 << 20, per_session: int = 8):
        self.budget = budget
        self.per_session = per_session
        self._sessions: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._size = 0

    def delta(self, session_id: str, text: str, prompt, fp: CallPrint | None = None) -> CallDelta:
        """The cheapest description of a call against one cached call of its session.
        The base is the call whose prompt+response shares the longest token prefix with
        this prompt (so a title or side call in between does not break the chain).
        prompt: ids as a list or as JSON text."""
        fp = fp or fingerprint(text, prompt)
        prompt = fp.prompt
        entries = self._sessions.get(session_id) or []
        whole = CallDelta(None, 0, 0, text, 0, prompt)
        if not entries:
            return whole
        best, best_blocks = entries[-1], -1
        for e in reversed(entries):   # newest first: ties go to the most recent call
            blocks = shared_blocks(e.ids_head, fp.prompt_head) if prompt else 0
            if blocks > best_blocks:
                best, best_blocks = e, blocks
        if not prompt:   # no prompt ids (a failed call): the text decides
            best = max(reversed(entries), key=lambda e: shared_blocks(e.text_head, fp.text_head))
        prefix = shared_blocks(best.text_head, fp.text_head) * TEXT_BLOCK
        room = (min(best.text_len, len(text)) - prefix) // TEXT_BLOCK   # never overlap the prefix
        suffix = min(shared_blocks(best.text_tail, fp.text_tail), room) * TEXT_BLOCK
        shared, cut = 0, 0
        if prompt and best_blocks > 0:
            # The first best_blocks blocks are the base's bytes: their ids are counted there.
            fp.known_commas = best.ids_commas[:best_blocks]
            cut = prompt.rfind(b",", 0, best_blocks * IDS_BLOCK)
            # every id before the last comma in those blocks: as many as the commas in them
            shared, cut = (fp.known_commas[-1], cut) if cut > 0 else (0, 0)
        if prefix + suffix + shared * 4 < 256:   # unrelated: a reference would cost more than it saves
            return whole
        suffix_ids = None
        if prompt is not None:
            suffix_ids = b"[" + prompt[cut + 1:] if shared else prompt
        return CallDelta(best.call_id, prefix, suffix, text[prefix:len(text) - suffix],
                         shared, suffix_ids)

    def add(self, session_id: str, call_id: str, text: str, prompt, tokens,
            fp: CallPrint | None = None) -> None:
        fp = fp or fingerprint(text, prompt)
        prompt, tokens = fp.prompt or b"[]", ids_json(tokens)
        ids_head, joined = fp.prompt_head, prompt
        if tokens and len(tokens) > 2:
            # prompt + tokens: the blocks wholly before the prompt's closing bracket are
            # the prompt's own; only the rest is hashed
            keep = (len(prompt) - 1) // IDS_BLOCK
            joined = join_ids(prompt, tokens)
            ids_head = ids_head[:keep * 8] + block_hashes(joined[keep * IDS_BLOCK:], IDS_BLOCK)
        entry = _Entry(call_id, len(text), fp.text_head, fp.text_tail, ids_head,
                       block_commas(joined, len(ids_head) // 8, fp.known_commas))
        entries = self._sessions.pop(session_id, [])
        entries.append(entry)
        self._size += entry.size
        while len(entries) > self.per_session:
            self._size -= entries.pop(0).size
        self._sessions[session_id] = entries
        while self._size > self.budget and self._sessions:
            _, dropped = self._sessions.popitem(last=False)
            self._size -= sum(e.size for e in dropped)

    @property
    def size(self) -> int:
        return self._size
