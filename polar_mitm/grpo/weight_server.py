"""The trainer's side of a sync without the disk: its weights, served once over HTTP.

publish(state_dict) frames the tensors as one safetensors file in one buffer and serves it at
http://HOST:PORT/<secret path> until the next publish; it gives (url, sha256), which a sync
hands to vLLM's worker extension (vllm_ext/weight_pull.py: `polar-mitm sync --from URL
--sha256 HEX`, or the gateway's `{"pull": {"url", "sha256"}}`). The buffer is the one copy:
each tensor is copied into it straight from where it lives (GPU or CPU, cast to `dtype` on
the way), so the trainer may step its optimizer as soon as publish returns. For the 135M
default model in fp32 that is 538 MB of memory while served (two blobs at most, while a pull
of the previous one is still running) and one pass of memcpy plus SHA-256 over it.

Names are the state dict's: those of a model's own state_dict() are the checkpoint names
that save_pretrained writes and vLLM's load_weights expects (pass the unwrapped model's:
no "module." or "_orig_mod." prefixes). Tensors that share memory (tied embeddings) are sent
once, under their first name, as save_pretrained does.

The path is the secret (secrets.token_urlsafe): anyone who can reach the port and guesses it
gets the weights, so the server binds loopback unless told otherwise, and each publish makes
a new path. It logs nothing (a request line would carry the path)."""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Mapping

import torch

# torch dtype -> safetensors' name (https://github.com/huggingface/safetensors, format.md)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Published:
    """One publish: where the weights are, their digest, and what framing them cost."""
    url: str
    sha256: str
    bytes: int
    tensors: int
    frame_s: float       # copying the tensors into the blob and hashing it


def unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state without the tensors that share memory with an earlier one (tied weights: vLLM
    ties them itself, as from a save_pretrained checkpoint)."""
    seen: set[tuple[int, torch.device, tuple[int, ...], torch.dtype]] = set()
    out = {}
    for name, t in state.items():
        key = (t.data_ptr(), t.device, tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def frame(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> bytearray:
    """The tensors as one safetensors file (the header, then each tensor's bytes), written
    into one buffer: the only copy. dtype: cast floating tensors to it on the way."""
    tensors = unique_tensors(state)
    target = {name: (dtype if dtype is not None and t.is_floating_point() else t.dtype)
              for name, t in tensors.items()}
    # widest dtypes first: every tensor then starts at a multiple of its own item size
    order = sorted(tensors, key=lambda n: -target[n].itemsize)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        size = tensors[name].numel() * target[name].itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[target[name]], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                      # the data starts 8-aligned
    base = 8 + len(text)
    blob = bytearray(base + offset)
    blob[:8] = len(text).to_bytes(8, "little")
    blob[8:base] = text
    for name in order:
        begin, end = header[name]["data_offsets"]        # type: ignore[index]
        if end > begin:
            dest = torch.frombuffer(blob, dtype=target[name], count=tensors[name].numel(),
                                    offset=base + begin)
            dest.copy_(tensors[name].detach().reshape(-1))
    return blob


class WeightServer:
    """Serves the latest published weights at a secret path on host:port (0: any free port),
    from a daemon thread; close() (or leaving its `with`) stops it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._lock = threading.Lock()
        self._path: str | None = None
        self._blob: bytearray | None = None
        self._http = ThreadingHTTPServer((host, port), self._handler())
        self._http.daemon_threads = True
        self.host, self.port = host, self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="weight-server", daemon=True)
        self._thread.start()

    def __enter__(self) -> "WeightServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> Published:
        """Serve state from now on (the previous publish's URL answers 404 from now on)."""
        began = time.perf_counter()
        blob = frame(state, dtype)
        digest = hashlib.sha256(blob).hexdigest()
        path = "/" + secrets.token_urlsafe(24)
        with self._lock:
            self._path, self._blob = path, blob
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return Published(url=f"http://{shown}:{self.port}{path}", sha256=digest, bytes=len(blob),
                         tensors=len(unique_tensors(state)),
                         frame_s=round(time.perf_counter() - began, 4))

    def publish_checkpoint(self, directory: str | Path, dtype: torch.dtype | None = None) -> Published:
        """Serve the tensors of a checkpoint folder's *.safetensors files."""
        from safetensors.torch import load_file

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {directory}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        return self.publish(state, dtype)

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        with self._lock:
            self._path = self._blob = None

    def _current(self, path: str) -> bytearray | None:
        with self._lock:
            if self._path is not None and secrets.compare_digest(path.encode(), self._path.encode()):
                return self._blob
            return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                blob = server._current(self.path)
                if blob is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(blob)))
                self.end_headers()
                try:
                    self.wfile.write(memoryview(blob))
                except (BrokenPipeError, ConnectionResetError):
                    pass           # the puller gave up: its digest check fails on its side

            def log_message(self, format: str, *args: object) -> None:
                pass               # a request line carries the secret path

        return Handler
