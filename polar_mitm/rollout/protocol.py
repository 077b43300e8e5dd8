"""The rollout server's messages, typed once: what a node sends in its heartbeat and hears
back (its leases, cancels, settled outcomes, the policy to serve), and the scored groups and
states the server answers with. node.py builds and reads them, server.py takes and makes them,
client.py (the loop's) reads them, and http_api.py validates them on the wire.

They are TypedDicts, so a message is the JSON object it is on the wire (a node's report,
a server's answer), and pydantic (FastAPI) validates them as they come in: the annotations
here (Strict, Field) are the wire's rules. Inputs refuse unknown fields or ignore them as
said; answers let fields the server adds pass through.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, with_config
from typing_extensions import NotRequired, TypedDict

from .states import Callback, Session, Task

Number = Annotated[float, Strict()]       # an int or a float (not a bool, not a string)

_ANSWER = ConfigDict(extra="allow")       # the server may add fields: they pass through


# -- a node's heartbeat ---------------------------------------------------------------------
class EventDetail(TypedDict, total=False):
    """What a session's state change may carry. reward present: the outcome's reward
    (None: no reward, e.g. no evaluator)."""
    reward: Number | None
    reason: StrictStr | None
    stats: dict[str, Any] | None


@with_config(ConfigDict(extra="ignore"))
class SessionEvent(EventDetail):
    """One state change of a session, as its node reports it."""
    session_id: StrictStr
    state: Session
    at: NotRequired[Number | None]        # unix seconds, on the node


@with_config(ConfigDict(extra="allow"))
class NodeLoad(TypedDict, total=False):
    """free: how many more sessions the node takes now (0 while paused or stopping)."""
    free: Annotated[StrictInt, Field(ge=0)]
    slots: StrictInt | None
    running: StrictInt | None
    ready: StrictInt | None
    post_run: StrictInt | None
    paused: StrictStr | None              # why it takes no work (its model backend is down)


@with_config(ConfigDict(extra="allow"))
class PolicyReport(TypedDict, total=False):
    """What a node serves, as it reports it: the target it last synced to (its id), what it
    serves now, and the error of that sync (None: it serves the target)."""
    target: str | None
    version: int | None
    checkpoint: str | None
    asleep: bool | None
    error: str | None
    detail: Any                           # the gateway's account of the sync (drain, reload, ...)


@with_config(ConfigDict(extra="ignore"))
class Heartbeat(TypedDict):
    node_id: Annotated[StrictStr, Field(min_length=1)]
    load: NotRequired[NodeLoad]
    active: NotRequired[Annotated[list[StrictStr], Field(description="the sessions the node holds")]]
    events: NotRequired[list[SessionEvent]]
    policy: NotRequired[PolicyReport | None]
    db: NotRequired[Annotated[StrictStr | None, Field(description="the node's proxy database")]]


# -- the server's answer --------------------------------------------------------------------
@with_config(_ANSWER)
class Assignment(TypedDict):
    """A lease: one session for the node to run, under this name, of this task (its spec)."""
    session_id: str
    task: dict[str, Any]
    attempt: int


@with_config(_ANSWER)
class PolicyTarget(TypedDict):
    """The policy every node should serve; a new id for each setting (a retry included)."""
    id: str
    version: int
    checkpoint: str
    asleep: bool
    pull: NotRequired[WeightPull | None]


@with_config(_ANSWER)
class HeartbeatReply(TypedDict):
    assign: list[Assignment]
    cancel: list[str]
    settled: Annotated[list[str], Field(description="final outcomes the server holds as their sample's")]
    policy: PolicyTarget | None


# -- results ---------------------------------------------------------------------------------
@with_config(_ANSWER)
class SessionResult(TypedDict):
    session_id: str
    sample: int
    attempt: int
    state: Session
    node_id: str | None
    reward: float | None
    reason: str | None
    stats: dict[str, Any] | None


@with_config(_ANSWER)
class Group(TypedDict):
    """A scored group, as posted to callback_url: the current attempt of each sample, and the
    attempts before them."""
    task_id: str
    state: Task
    metadata: dict[str, Any]
    sessions: list[SessionResult]
    attempts: list[SessionResult]


class RewardRecord(TypedDict):
    """A session's reward as stored (store.training.set_rewards, a rewards file's line)."""
    session_id: str
    reward: float
    info: dict[str, Any]


@with_config(_ANSWER)
class TaskStatus(TypedDict):
    task_id: str
    state: Task
    callback_state: Callback | None
    sessions: list[SessionResult]


@with_config(_ANSWER)
class TaskBrief(TypedDict):
    task_id: str
    state: Task


@with_config(_ANSWER)
class TaskList(TypedDict):
    tasks: list[TaskBrief]


@with_config(_ANSWER)
class Submitted(TypedDict):
    task_id: str
    sessions: list[str]


@with_config(_ANSWER)
class SubmitReply(TypedDict):
    tasks: list[Submitted]


@with_config(ConfigDict(extra="forbid"))
class GroupsRequest(TypedDict, total=False):
    task_ids: list[StrictStr]


@with_config(_ANSWER)
class GroupsReply(TypedDict):
    groups: list[Group]


@with_config(ConfigDict(extra="forbid"))
class CancelRequest(TypedDict, total=False):
    reason: StrictStr | None


@with_config(_ANSWER)
class CancelReply(TypedDict):
    task_id: str
    cancelled: bool


@with_config(_ANSWER)
class Status(TypedDict):
    tasks: dict[str, int]
    sessions: dict[str, int]
    rewards: dict[str, Any]
    nodes: dict[str, dict[str, Any]]


# -- the policy --------------------------------------------------------------------------------
@with_config(ConfigDict(extra="forbid"))
class WeightPull(TypedDict):
    """The version's weights in the trainer's memory: one safetensors blob at url (its
    sha256), which each node's vLLM pulls (polar_mitm/vllm_ext/weight_pull.py)."""
    url: StrictStr
    sha256: StrictStr


@with_config(ConfigDict(extra="forbid"))
class PolicyRequest(TypedDict):
    version: StrictInt
    checkpoint: StrictStr
    asleep: NotRequired[StrictBool]
    pull: NotRequired[WeightPull | None]    # else each node's vLLM reads checkpoint


@with_config(_ANSWER)
class NodePolicy(TypedDict):
    lost: bool
    policy: PolicyReport | None
    db: str | None


@with_config(_ANSWER)
class PolicyStatus(TypedDict):
    target: PolicyTarget | None
    nodes: dict[str, NodePolicy]
