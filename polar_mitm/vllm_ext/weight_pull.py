"""New weights from the trainer's memory, no disk: a vLLM worker extension.

vLLM mixes WeightPull into its worker (`--worker-extension-cls weight_pull.WeightPull`), and
dev mode's `POST /collective_rpc {"method": "polar_pull_weights", "kwargs": {"url": URL,
"sha256": HEX}}` calls it in every worker. It GETs URL (the trainer's tensors, framed as one
safetensors file: grpo/weight_server.py serves them), checks the SHA-256 of what came, and
reloads the model in place from an iterator over those tensors (vLLM's reload_weights with
weights_iterator, the same path as a reload from a checkpoint folder). A digest that does not
match, a cut transfer or a malformed header raises before the first tensor is loaded: the
weights in service stay as they were, and /collective_rpc answers 500.

The tensors are views into the one downloaded buffer (torch.frombuffer): no copy between the
socket and vLLM's load_weights, which copies each into its parameter (casting to vLLM's dtype).

The fetch need not be in the pause. `polar_prefetch_weights` (same kwargs) starts it on a
thread of the worker and answers at once with its state ("fetching", "ready", or "failed" and
the error); called again with the same URL and digest it only reports, so a sync polls it until
"ready", then pauses and pulls: polar_pull_weights takes the staged, checked blob, and the
engine is paused for the load alone. (A collective_rpc runs between engine steps, so a fetch
inside one would stop generation as much as a pause.) One blob is staged at a time.

Runs under vLLM's Python, where polar_mitm is not installed: standard library and torch only.
vLLM refuses an extension with an attribute its worker already has, so WeightPull has only
its polar_-prefixed RPC methods; the work is in the module's functions."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

import torch

# safetensors' dtype names (https://github.com/huggingface/safetensors, format.md)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    **({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
       if hasattr(torch, "float8_e5m2") else {}),
}
CHUNK = 8 << 20                   # bytes read (and hashed) at a time
MAX_HEADER = 100 << 20            # safetensors' own limit on the JSON header


class PullError(ValueError):
    """The blob is not what was promised (digest, length, framing): nothing was loaded."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int                    # byte offset in the blob
    end: int


def fetch_checked(url: str, sha256: str, timeout: float = 600.0) -> bytearray:
    """The body at url, whole, once its SHA-256 is sha256 (PullError otherwise). Hashed as it
    arrives; read straight into one buffer of the announced length. Direct, never through
    $http_proxy: the trainer's address is meant as given."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    digest = hashlib.sha256()
    with opener.open(url, timeout=timeout) as response:
        length = response.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise PullError(f"{_safe(url)} gave no Content-Length")
        blob = bytearray(int(length))
        view, got = memoryview(blob), 0
        while got < len(blob):
            n = response.readinto(view[got:got + CHUNK])
            if not n:
                raise PullError(f"{_safe(url)} ended after {got} of {len(blob)} bytes")
            digest.update(view[got:got + n])
            got += n
        view.release()
    if digest.hexdigest() != sha256.strip().lower():
        raise PullError(f"sha256 of the {len(blob)} bytes from {_safe(url)} is {digest.hexdigest()}, "
                        f"not {sha256}: nothing loaded")
    return blob


def parse_header(blob: bytes | bytearray) -> list[TensorEntry]:
    """The tensors a safetensors blob holds, every entry checked against the blob's bounds
    (PullError otherwise), in the blob's order."""
    if len(blob) < 8:
        raise PullError("not safetensors: shorter than its 8-byte header length")
    (size,) = struct.unpack_from("<Q", blob, 0)
    if size > MAX_HEADER or 8 + size > len(blob):
        raise PullError(f"not safetensors: a header of {size} bytes in a blob of {len(blob)}")
    try:
        header = json.loads(bytes(blob[8:8 + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PullError(f"not safetensors: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise PullError("not safetensors: its header is not an object")
    base, entries = 8 + size, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise PullError(f"tensor {name!r}: unknown dtype or a malformed entry {info!r}") from None
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end or base + end > len(blob) or end - begin != count * dtype.itemsize:
            raise PullError(f"tensor {name!r}: bytes [{begin}, {end}) do not hold {shape} {info['dtype']}")
        entries.append(TensorEntry(name, dtype, shape, base + begin, base + end))
    return sorted(entries, key=lambda e: e.start)


def tensors(blob: bytearray, entries: list[TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each entry, each a view into blob (no copy)."""
    for e in entries:
        if e.end == e.start:
            yield e.name, torch.empty(e.shape, dtype=e.dtype)
            continue
        count = (e.end - e.start) // e.dtype.itemsize
        flat = torch.frombuffer(blob, dtype=e.dtype, count=count, offset=e.start)
        yield e.name, flat.view(e.shape)


def _safe(url: str) -> str:
    """url without its path: the path is the trainer's secret, and errors end up in logs."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}/…"


class Staged:
    """A fetch on a thread of its own (prefetch): its checked blob, or why it failed."""

    def __init__(self, url: str, sha256: str, timeout: float):
        self.url, self.sha256 = url, sha256.strip().lower()
        self.blob: bytearray | None = None
        self.error: BaseException | None = None
        self.fetch_s: float | None = None
        self.thread = threading.Thread(target=self._fetch, args=(timeout,), name="polar-prefetch",
                                       daemon=True)
        self.thread.start()

    def _fetch(self, timeout: float) -> None:
        began = time.perf_counter()
        try:
            blob = fetch_checked(self.url, self.sha256, timeout)
            parse_header(blob)
            self.blob = blob
        except BaseException as e:   # noqa: BLE001 - reported by the next call
            self.error = e
        self.fetch_s = round(time.perf_counter() - began, 4)

    def same(self, url: str, sha256: str) -> bool:
        return self.url == url and self.sha256 == sha256.strip().lower()

    def state(self) -> dict[str, Any]:
        if self.thread.is_alive():
            return {"state": "fetching"}
        if self.error is not None:
            return {"state": "failed", "error": str(self.error)}
        return {"state": "ready", "bytes": len(self.blob or b""), "fetch_s": self.fetch_s}


_staged: Staged | None = None      # this worker process's one prefetch
_staging = threading.Lock()


class WeightPull:
    """Mixed into vLLM's worker: `self` is the worker (its reload_weights wraps the model
    runner's in the worker's vLLM config)."""

    def polar_prefetch_weights(self, url: str, sha256: str, timeout: float | str = 600) -> dict[str, Any]:
        """Start fetching url on a thread (or, for the URL and digest already staged, say
        how it goes): {"state": "fetching" | "ready" | "failed", ...}. Loads nothing."""
        global _staged
        with _staging:
            if _staged is None or not _staged.same(url, sha256):
                _staged = Staged(url, sha256, float(timeout))    # the older one is dropped
            return _staged.state()

    def polar_pull_weights(self, url: str, sha256: str, timeout: float | str = 600) -> dict[str, Any]:
        """Fetch url (or take its prefetched blob), check its sha256, reload the model in
        place from its tensors. Returns {"bytes", "tensors", "fetch_s", "load_s",
        "prefetched"} (JSON: /collective_rpc answers it); fetch_s is the time spent here."""
        global _staged
        began = time.perf_counter()
        with _staging:
            staged, _staged = _staged, None
        if staged is not None and staged.same(url, sha256):
            staged.thread.join(float(timeout))
            if staged.blob is None:      # failed, or still fetching: nothing loaded
                raise staged.error or PullError(f"the prefetch of {_safe(url)} did not finish")
            blob = staged.blob
        else:
            blob = fetch_checked(url, sha256, float(timeout))
        entries = parse_header(blob)
        fetched = time.perf_counter()
        self.reload_weights(weights_iterator=tensors(blob, entries))  # type: ignore[attr-defined]
        loaded = time.perf_counter()
        return {"bytes": len(blob), "tensors": len(entries), "fetch_s": round(fetched - began, 4),
                "load_s": round(loaded - fetched, 4),
                "prefetched": staged is not None and staged.blob is blob}
