"""A stdio MCP server on the official `mcp` SDK, for the harness tests (test_mcp_tools.py): one
tool with a name no CLI has, so its presence in a recorded request proves the CLI loaded it.

The tool answers PROBE_MARKER and its argument, so a tool result that carries the marker
proves the CLI called this server (started inside the session's sandbox) and sent its
answer back to the model.

    python tests/support/mcp_echo_server.py        # speaks MCP on stdin/stdout

$POLAR_PROBE_DELAY (seconds) holds its start back: a slow server, which the CLI must wait for.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any

TOOL = "polar_probe_tool"
PROBE_MARKER = "polar-mcp-ok"


def make_server() -> Any:
    """The server: the SDK's MCPServer (mcp 2.x), or FastMCP, its name in mcp 1.x."""
    try:
        server_class = importlib.import_module("mcp.server.mcpserver").MCPServer
    except ImportError:     # mcp 1.x
        server_class = importlib.import_module("mcp.server.fastmcp").FastMCP
    server = server_class("polar-probe")

    @server.tool(name=TOOL, description="Echo a word back, marked by the polar probe MCP server.")
    def probe(word: str) -> str:
        return f"{PROBE_MARKER}:{word}"

    return server


if __name__ == "__main__":
    time.sleep(float(os.environ.get("POLAR_PROBE_DELAY") or 0))
    make_server().run()    # stdio: the transport a CLI starts a command-line server on
