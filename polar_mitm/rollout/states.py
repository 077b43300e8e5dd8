"""The states of the rollout server's sessions, tasks and callbacks: one enum each, in one
place. They are str enums, so a state is its name wherever it goes (JSON, DuckDB, logs), and
a name read back (the database, a node's report) turns into its member with Session(name)."""

from __future__ import annotations

from enum import StrEnum

from ..store.rollout_journal import STOPPING


class Session(StrEnum):
    """A session (one attempt at one sample of a task), in the order it goes through them."""
    PENDING = "pending"          # waiting for a node
    ASSIGNED = "assigned"        # given to a node in its heartbeat
    INIT = "init"                # the node sets it up (workspace, HOME)
    READY = "ready"              # set up, waiting for a RUN slot
    RUN = "run"                  # the harness runs
    POST_RUN = "post_run"        # the evaluator runs
    DONE = "done"                # scored
    TIMED_OUT = "timed_out"      # the harness ran past its timeout
    FAILED = "failed"            # set-up, harness or evaluator failed; max_attempts lost; max_releases
    CANCELLED = "cancelled"      # by request, or early_stop
    # The attempt ended without an outcome and the sample runs again under a new name
    # (TASK~i.rN): "lost" when its node failed it (a lost node, a node that no longer holds
    # it; max_attempts of those fail the sample), "released" when its node handed it back
    # (the node was stopped, or its model backend went down): that never counts as failed.
    LOST = "lost"
    RELEASED = "released"


NODE_STATES = (Session.ASSIGNED, Session.INIT, Session.READY, Session.RUN, Session.POST_RUN)
"""Held by a node."""
NOT_STARTED = frozenset({Session.ASSIGNED, Session.INIT, Session.READY})
"""Held by a node, no harness run yet: handed back, it runs again under the same name."""
TERMINAL = frozenset({Session.DONE, Session.TIMED_OUT, Session.FAILED, Session.CANCELLED, Session.LOST,
                      Session.RELEASED})
"""Final: a session in one of these never changes again (a retry is a new session)."""
FINISHED = frozenset({Session.DONE, Session.TIMED_OUT})
"""What early_stop counts."""
OUTCOMES = frozenset({Session.DONE, Session.TIMED_OUT, Session.FAILED})
"""A node's outcome of a run: it stores the reward once the server settles it as its sample's."""
ORDER = tuple(Session)
"""Every session state, in the order of a session's life (for counts and progress lines)."""


class ReleaseCause(StrEnum):
    """Why a node handed a session back (its RELEASED event's stats["release_cause"]). None
    is the policy's doing: the session runs again, unscored. Releases for the first two
    causes count towards the server's max_releases; a stopped node's never do."""
    BACKEND_UNAVAILABLE = "backend_unavailable"   # its model calls failed on the backend
    VERSION_UNKNOWN = "version_unknown"           # calls whose policy version is unknown
    NODE_STOPPED = "node_stopped"                 # its node (or `rollout`) was stopped

    @property
    def label(self) -> str:
        return {"backend_unavailable": "backend unavailable", "version_unknown": "policy version unknown",
                "node_stopped": "node stopped"}[self.value]


RELEASE_CAUSE = "release_cause"
"""The key of a released session's stats that holds its ReleaseCause."""
UNSCORED = "unscored"
"""The key of a failed session's stats that says why it has no reward, not even on_failure
"zero"'s 0.0: its sample was released max_releases times (the backend's failures, not the
policy's)."""


class Task(StrEnum):
    QUEUED = "queued"            # none of its sessions is on a node yet
    RUNNING = "running"
    DONE = "done"                # every sample settled
    CANCELLED = "cancelled"      # by request (early_stop ends "done")


TASK_SETTLED = frozenset({Task.DONE, Task.CANCELLED})


class Callback(StrEnum):
    """The scored group posted to a task's callback_url."""
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"            # every try failed


class ServerEvent(StrEnum):
    """rollout_events of the server itself (no session); a task's own events are Task states."""
    NODE_REGISTERED = "node_registered"
    NODE_RETURNED = "node_returned"
    NODE_LOST = "node_lost"
    CALLBACK_SENT = "callback_sent"
    CALLBACK_FAILED = "callback_failed"
    # a task's unfinished sessions are stopped (detail: why: a cancel request, an early stop);
    # the journal reads it back as the task's cancel_reason after a restart
    STOPPING = STOPPING
