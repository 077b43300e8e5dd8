"""Tasks in, scored sessions of real harness CLIs out: the rollout server, gateway nodes and
harness runners."""

from .node import GatewayNode, NodeConfig
from .server import RolloutServer
from .spec import TaskError, TaskRequest, parse_task

__all__ = ["GatewayNode", "NodeConfig", "RolloutServer", "TaskError", "TaskRequest", "parse_task"]
