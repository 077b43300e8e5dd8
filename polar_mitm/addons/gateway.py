"""The polar-mitm gateway: one-job mitmproxy addons, in the order their hooks run.

    Backstop       forces passthrough off, refuses relaying modes, raw relays and server
                   connections (first, so it configures before any option can fail)
    Control        the control token (read from a file, never a command line) and the
                   session credentials made under it (polar_session_auth)
    ProxyUsers     the HTTPS_PROXY user and password on CONNECT (they name the session)
    BackendClient  the vLLM client, built in configure from --set options, closed in done
    Recorder       the call writer (polar_db): every call is durable before it is answered
    WeightSync     /_polar/sync: hold calls, drain, reload vLLM's weights, next version;
                   the version watch (vLLM's tag read back) and /_polar/verify
    ModelCalls     model calls: to vLLM and back in the harness's format, recorded first;
                   long streaming calls go through the loopback StreamRelay for keepalives;
                   at most polar_session_max_inflight of a session's at the backend
                   (session_slots.py); whose failure an error the backend answered is
                   (request_failures.py)
    Health         /_polar/health: loaded and answering, and how recording goes
    LocalAnswers   everything else (telemetry, model lists, token counts)
    Unanswered     a 500 for whatever no addon answered: nothing goes upstream

Everything is answered here (connection_strategy=lazy, upstream_cert=false), so nothing a
harness sends ever reaches the outside."""

from __future__ import annotations

from .backend_client import BackendClient, BackendTimeout, BackendUnavailable  # noqa: F401
from .backstop import Backstop, Unanswered
from .bodies import BodyTooLarge  # noqa: F401
from .control import Control
from .health import HEALTH_PATH, Health  # noqa: F401
from .local_answers import LocalAnswers
from .model_calls import ModelCalls, parse_overrides  # noqa: F401
from .proxy_users import ProxyUsers
from .recorder import Recorder
from .relay import StreamRelay
from .weight_sync import SYNC_PATH, WeightSync  # noqa: F401


class PolarGateway:
    """The addons wired together; mitmproxy loads the nested `addons` in this order."""

    def __init__(self) -> None:
        self.relay = StreamRelay()
        self.backstop = Backstop(self.relay.addresses)
        self.control = Control()
        self.users = ProxyUsers()
        self.backend = BackendClient()
        self.recorder = Recorder()
        self.sync = WeightSync(self.backend, self.control)
        self.model_calls = ModelCalls(self.backend, self.users, self.relay, self.recorder, self.sync.gate,
                                      self.control)
        self.health = Health(self.recorder, self.model_calls, self.relay, self.sync.gate, self.control,
                             self.sync.watch)
        self.local = LocalAnswers(self.backend, self.model_calls)
        self.addons = [self.backstop, self.control, self.users, self.backend, self.recorder, self.sync,
                       self.model_calls, self.health, self.local, Unanswered(self.relay.addresses)]


addons = [PolarGateway()]
