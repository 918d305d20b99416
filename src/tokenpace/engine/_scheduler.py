"""vLLM scheduler subclasses that pace each user's output tokens.

The subclasses reuse vLLM's ``schedule()`` unchanged and steer it through three seams
(named in ``_vllm``):

1. Before the call, every running request is classified by the ``StepPlanner``: it runs
   (charged one token if this step may sample), is throttled (its user has no quota), or
   is deferred (no active slot left). Throttled and deferred requests are skipped for one
   step with ``next_decode_eligible_step``; they stay in ``running`` with their KV.
   Throttled ones move to the tail of ``running`` (and, under the priority policy, to the
   end of their priority level) so that they are the first preemption victims.
2. Waiting admission is capped by ``max_num_active_reqs``, raised for this call by the
   number of throttled requests: throttled requests do not count as active. A waiting
   request whose user has no quota is deferred by ``_handle_blocked_waiting_request``
   and keeps its place in the queue; one that is admitted is charged in
   ``_reserve_prefill_lookahead`` only if its chunk reaches the sampling position. That
   hook is bound on the instance only for a ``schedule()`` call that starts with
   requests waiting: vLLM calls it for every scheduled request, and a wrapper there
   cost about 0.15 us per running request per step for nothing (admission takes only
   from the waiting queues, and not at all in a step that preempted).
3. After the call, the single refund point returns the token of every charged request
   that was not dispatched to sample (not scheduled, scheduled short of its last prompt
   position, or preempted).

Throttling a request whose next chunk may be its last prefill chunk waits for quota
(it is skipped whole); chunks that cannot be the last run without quota.

A throttled request costs a step about 1.5 us of CPU (at 1,024 running, all throttled:
0.10 of a stock step that runs them, ``tokenpace bench scheduler``): its stream's
preparation (as any running request's), the planner's decision (``pacing._planner``:
about 0.7 us), the skip around ``schedule()`` (a dict lookup, two attribute reads and
two writes, a set insert and test for the move to the tail) and vLLM's own skip. None of
it makes an object per request, so an all-throttled step never sets off the garbage
collector.

Pacing on or off, the subclasses also keep the book of ended requests for the gateway
(``_aborted``): ``add_request`` notes each new request, ``_free_request`` (which every
request that ends passes once) keeps its prompt and output counts, its pacing user and
when it ended (listed in order by ``_ended``).
"""

from __future__ import annotations

import logging
import sys
from types import MappingProxyType
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from ..pacing import (
    BULK_MAX_STEPS,
    DraftBook,
    InnerRates,
    LanePolicy,
    MAY_SAMPLE,
    NO_SAMPLE,
    SAMPLES,
    LimitsError,
    LimitsFileWatcher,
    OTHER_USER,
    OutputRateLimiter,
    PacingStats,
    RunningPlan,
    StepPlanner,
    Stream,
    UserRateLimits,
    user_rank,
    validate_rate,
    validate_rate_version,
)
from ._config import PacingConfig
from ._events import EventLog
from ._aborted import EndedRequests, install_aborted_outputs
from ._ended import install_ended_requests
from ._control import install_rate_control
from ._metrics import install_pacing_stats
from ._hooks import data_parallel_of, install_idle_wait, release_step_hint
from ._identity import (
    ANONYMOUS_USER,
    extra_args as _extra_args,
    request_application,
    request_end_user,
    request_user,
)
from ._modes import unsupported_modes
from ._warn import warn_once
from ._windows import DraftWindows
from ._vllm import (
    AsyncScheduler,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    SchedulingPolicy,
    internals_problems,
)
from ._xargs import (
    APPLICATION_END_USER_RATE_EXTRA_ARG,
    APPLICATION_EXTRA_ARG,
    APPLICATION_RATE_EXTRA_ARG,
    END_USER_RATE_EXTRA_ARG,
    RATE_EXTRA_ARG,
    RATE_VERSION_EXTRA_ARG,
    USER_EXTRA_ARG,
)

# Under "vllm." so that vLLM's logging configuration (format, level) applies in the engine process.
logger = logging.getLogger("vllm.tokenpace.engine")

CLEANUP_EVERY_STEPS = 256
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_PRIORITY_DEFER_S = 1e12  # pushes a throttled request to the end of its priority level
STREAM_ATTRIBUTE = "tokenpace_stream"
"""Set on each vLLM ``Request`` by ``add_request``: its planner ``Stream``, so that the
step reads one attribute per request instead of resolving its user again."""

class _DraftsOut(NamedTuple):
    """A step's granted drafts awaiting its results, one entry per paced stream."""

    requests: list[Request]
    streams: list[Stream]
    granted: list[int]
    """Drafts each stream may still deliver: granted (or owed) and not yet given back."""
    at: int
    """The step's dispatch instant (ns), for the event log."""


class _PacingMixin:
    """Pacing around vLLM's ``schedule()``; mixed into ``Scheduler`` and ``AsyncScheduler``."""

    # Provided by vLLM's Scheduler (listed in _vllm.SCHEDULER_ATTRIBUTES).
    running: list[Request]
    requests: dict[str, Request]
    current_step: int
    max_num_active_reqs: int
    max_num_running_reqs: int
    max_num_scheduled_tokens: int

    # Read by update_from_output before anything else: an empty, read-only default so
    # that a scheduler built without __init__ (vLLM's own tests do) behaves as stock.
    _draft_results: dict[int, tuple[SchedulerOutput, int, _DraftsOut]] = (
        MappingProxyType({}))  # type: ignore[assignment]
    # Likewise for the book of ended requests: None without __init__ (nothing is kept).
    ended_requests: EndedRequests | None = None
    _lanes: LanePolicy | None = None
    # Lanes, within one schedule() call: the active limit past which only a request of a
    # better priority than ``_lane_worst`` (the worst running) is admitted (None: no gate).
    _lane_gate: int | None = None
    _lane_worst = 0
    _held_last_step = False
    _windows: DraftWindows | None = None
    _sessions = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        problems = internals_problems(self)
        if problems:
            raise RuntimeError("tokenpace cannot pace this vLLM: " + "; ".join(problems))
        config = PacingConfig.from_additional_config(self.vllm_config.additional_config)
        self.pacing_config = config
        self._planner: StepPlanner | None = None
        self._watcher: LimitsFileWatcher | None = None
        self._event_log: EventLog | None = None
        self._pinned_rank: tuple[int, int] | None = None  # (this rank, ranks) under DP
        # The version of each user's gateway-sent rate (RATE_VERSION_EXTRA_ARG): one int
        # per user that a versioned rate was sent for, kept like the overrides it guards.
        self._rate_versions: dict[str, int] = {}
        self._steps = 0
        # Speculative decoding: drafts are granted, cut and given back by the book
        # (``pacing._drafts``); results still to come: id(output) -> (output, step,
        # the step's granted drafts).
        self._drafts: DraftBook | None = None
        self._draft_results = {}
        # Bulk windows of drafts (``_windows``), where this scheduler may open them, and
        # the open streaming-input sessions (none may be, for a window to open).
        self._windows = None
        self._sessions = 0
        # What each ended request was prompted with and generated, for the gateway
        # (``_aborted``): kept whenever this class is the engine's scheduler, pacing on
        # or off (a gateway meters requests through an unpaced engine too).
        self.ended_requests = EndedRequests()
        engine_core = sys.modules.get("vllm.v1.engine.core")
        if engine_core is not None:
            install_aborted_outputs(engine_core.EngineCoreProc)
            install_ended_requests(engine_core.EngineCoreProc)
            install_pacing_stats(engine_core.EngineCoreProc)
        if not config.runs_scheduler:
            return
        refused = unsupported_modes(self.vllm_config, self)
        if refused:
            raise ValueError(
                "tokenpace output pacing does not support " + "; ".join(refused)
            )
        # Lanes alone (pacing off): the planner runs with nobody paced.
        limits = config.limits if config.limits is not None else UserRateLimits(None, {})
        if engine_core is not None:  # also when the plugin entry point is not loaded
            install_idle_wait(engine_core.EngineCoreProc)
            install_rate_control(engine_core.EngineCoreProc)
        self._planner = StepPlanner(
            OutputRateLimiter(limits),
            PacingStats(config.metrics_users, first=limits.overrides),
            InnerRates(config.end_user_rate))
        self._lanes = self._planner.lanes = self._lanes_in_force(config)
        if self.vllm_config.speculative_config is not None:
            self._drafts = DraftBook(self._planner.limiter, self._planner.inner)
        lora = getattr(self, "lora_config", None)
        self._max_loras: int | None = lora.max_loras if lora is not None else None
        if config.limits_file is not None:
            self._watcher = LimitsFileWatcher(
                config.limits_file, config.limits.default, self._planner.limiter.now_ns
            )
        rank, ranks, pinned = data_parallel_of(self.vllm_config.parallel_config)
        if pinned:
            # The API server pins each user to one rank (_hooks, part 4); checked here.
            self._pinned_rank = (rank, ranks)
        if config.event_log is not None:
            self._event_log = EventLog(config.event_log, rank if ranks > 1 else None)
        if self._drafts is not None and self._bulk_possible():
            self._windows = DraftWindows(
                self._drafts, self._planner.limiter, 1 + self.num_spec_tokens,  # type: ignore[attr-defined]
                isinstance(self, AsyncScheduler)
                or self.vllm_config.scheduler_config.async_scheduling,
                self.requests, self._stream_of, self._give_back_grants)
            logger.info("tokenpace: speculative decoding: while every paced user has room, "
                        "drafts are charged once per window of up to %d steps (bulk windows)",
                        BULK_MAX_STEPS)
        logger.info(
            "tokenpace: pacing output tokens with %s, %s scheduling: default %s, "
            "%d user override(s)%s%s",
            type(self).__name__,
            "async" if self.vllm_config.scheduler_config.async_scheduling else "sync",
            _default_text(limits.default), len(limits.overrides),
            f" from {config.limits_file} (reloaded on change)" if config.limits_file else "",
            f"; rates sent in vllm_xargs.{RATE_EXTRA_ARG} are trusted"
            if config.trusted_gateway else "",
        )

    def _lanes_in_force(self, config: PacingConfig) -> LanePolicy | None:
        """The lane policy when lanes apply: the priority policy, ``lanes`` not false, and
        room in ``running`` beyond the active limit to hold requests in."""
        if config.lanes is None or self.policy != SchedulingPolicy.PRIORITY:  # type: ignore[attr-defined]
            return None
        room = self.max_num_running_reqs - self.max_num_active_reqs
        if room <= 0:
            logger.warning(
                "tokenpace: lanes are off: they hold lower-priority requests in the room "
                "--max-num-seqs (%d) leaves beyond --max-num-active-seqs (%d); set "
                "--max-num-active-seqs below --max-num-seqs (tokenpace serve does when "
                "--max-num-seqs is given)", self.max_num_running_reqs, self.max_num_active_reqs)
            return None
        logger.info("tokenpace: lanes on: up to %d lower-priority requests held for better "
                    "ones, min_share %g", room, config.lanes.min_share)
        return config.lanes

    # -- public surface used by the engine loop and by tests ------------------------

    @property
    def planner(self) -> StepPlanner | None:
        return self._planner

    def idle_wait_seconds(self) -> float:
        """How long the engine loop may block on its input queue before stepping.

        0 unless some user was refused in the last step and no request can run now; then
        min(50 ms, time until the earliest user with a runnable request has quota). The
        engine asks before each step, so a step that would run nothing is not taken.
        """
        planner = self._planner
        if planner is None or not self.pacing_config.idle_wait or not planner.refused_any:
            return 0.0
        return planner.idle_wait_seconds(self._quota_needs())

    def note_idle_wait(self, waited_s: float) -> None:
        """The engine loop waited ``waited_s`` for quota instead of stepping (``_hooks``)."""
        if self._planner is not None:
            self._planner.stats.note_idle_wait(int(waited_s * 1e9))

    def pacing_stats(self) -> dict[str, Any] | None:
        """What pacing did so far, for the engine's /metrics (``_metrics``): per user
        ``[tokens, refunds, throttled request-steps, throttled seconds, rate or None]``,
        the idle waits, how many users share the ``__other__`` label, and per priority
        level (lanes) ``[held request-steps, yielded prompt chunks, admitted past the
        active limit, held now]``. None when
        pacing is off. Runs between two steps (a utility call): O(users with a label)."""
        planner = self._planner
        if planner is None:
            return None
        snap = planner.stats.snapshot()
        limits = planner.limiter.limits
        return {"users": {u: [tokens, refunds, steps, ns / 1e9,
                              None if u == OTHER_USER else limits.rate(u)]
                          for u, (tokens, refunds, steps, ns) in snap.users.items()},
                "idle_waits": snap.idle_waits, "idle_wait_seconds": snap.idle_wait_ns / 1e9,
                "folded_users": snap.folded,
                "lanes": {p: list(v) for p, v in snap.lanes.items()}}

    def _bulk_possible(self) -> bool:
        """Whether a request's output length tells every token it was delivered once the
        results of the steps in flight have arrived (``_windows``): at most one step in
        flight when ``schedule()`` runs (two batches at most: pipeline parallel 1), none
        discarded by a KV connector's failed load, and no event log (it records each
        draft's charge at its step)."""
        config = self.vllm_config
        return (config.parallel_config.pipeline_parallel_size == 1
                and config.max_concurrent_batches <= 2
                and self.connector is None  # type: ignore[attr-defined]
                and self._event_log is None)

    def _quota_needs(self) -> Iterator[Stream | None]:
        """For each request that could be scheduled: its stream (the user, and end user if
        any, its next step charges), or None when that step samples nothing (it runs
        without quota)."""
        cap = self.max_num_scheduled_tokens
        for req in self.running:
            remaining = req.num_tokens_with_spec + req.num_output_placeholders - req.num_computed_tokens
            if remaining > 0:
                yield self._stream_of(req) if remaining <= cap else None
        for req in self.waiting:  # type: ignore[attr-defined]
            yield self._stream_of(req) if req.num_tokens - req.num_computed_tokens <= cap else None

    def _stream_of(self, request: Request) -> Stream:
        """The request's planner stream, opened (user resolved) on first sight."""
        stream: Stream | None = getattr(request, STREAM_ATTRIBUTE, None)
        if stream is None:
            assert self._planner is not None
            priority = request.priority if self.policy == SchedulingPolicy.PRIORITY else 0  # type: ignore[attr-defined]
            extra = _extra_args(request)
            stream = self._planner.open_stream(
                request.request_id, request_user(request), priority, request_end_user(request),
                request_application(request),
                own_end_users=extra is not None and APPLICATION_END_USER_RATE_EXTRA_ARG in extra)
            setattr(request, STREAM_ATTRIBUTE, stream)
        return stream

    def _user_of(self, request: Request) -> str:
        return self._stream_of(request).user

    def add_request(self, request: Request) -> None:
        """Resolve the request's user once (not every step) and adopt a gateway's rate.

        With ``trusted_gateway`` a request may carry its user's rate; the user's rate
        becomes that value from now on, for all of its requests. A limits-file reload
        replaces every override, so gateway-sent rates are forgotten then and each user's
        next request sends its rate again; until it does, the user's running requests
        get the default rate (or, without a default, are not paced).

        A new request is noted as held in the book of ended requests (``_aborted``:
        the gateway learns it is still running). Cost: a dict lookup, an ``rpartition``
        and a dict update per request.
        """
        if self._planner is not None:
            stream = self._stream_of(request)
            if self._pinned_rank is not None:
                _check_rank(request, stream.user, *self._pinned_rank)
        extra = _extra_args(request)
        if extra is not None and RATE_EXTRA_ARG in extra:
            if self._planner is not None and self.pacing_config.trusted_gateway:
                self._adopt_rate(request, extra)
            else:
                _report_untrusted_rate(request)
        if extra is not None and END_USER_RATE_EXTRA_ARG in extra:
            if self._planner is not None and self.pacing_config.trusted_gateway:
                self._adopt_end_user_rate(request, extra[END_USER_RATE_EXTRA_ARG])
            else:
                _report_untrusted_rate(request)
        for field, own_end_users in ((APPLICATION_RATE_EXTRA_ARG, False),
                                     (APPLICATION_END_USER_RATE_EXTRA_ARG, True)):
            if extra is not None and field in extra:
                if self._planner is not None and self.pacing_config.trusted_gateway:
                    self._adopt_application_rate(request, extra[field], own_end_users)
                else:
                    _report_untrusted_rate(request)
        # An id already held is the next input of a streaming session, not a new request.
        book = self.ended_requests
        fresh = request.request_id not in self.requests
        new = book is not None and fresh
        if fresh and request.resumable:
            self._sessions += 1
        super().add_request(request)  # type: ignore[misc]
        if new:
            book.started(request.request_id)  # type: ignore[union-attr]

    def _adopt_end_user_rate(self, request: Request, value: Any) -> None:
        """Make the rate a trusted gateway sent the end-user rate of the request's user
        (every end user of that user, from now on). A bad value is logged and ignored."""
        assert self._planner is not None
        try:
            rate = validate_rate(value, f"vllm_xargs.{END_USER_RATE_EXTRA_ARG}")
        except LimitsError as exc:
            logger.warning("tokenpace: request %s: %s; ignored", request.request_id, exc)
            return
        user = self._user_of(request)
        if user == ANONYMOUS_USER:
            return  # a malformed identity's rate must not retune the anonymous users' one
        limiter = self._planner.inner
        rates: InnerRates = limiter.limits  # type: ignore[assignment]
        if rates.of_user(user) != rate:
            # Cost: a copy of the per-user table, per change (a gateway sends the same
            # rate with every request of a tenant; it changes on a reload).
            limiter.set_limits(rates.with_user(user, rate))  # type: ignore[arg-type]

    def _adopt_application_rate(self, request: Request, value: Any,
                                own_end_users: bool = False) -> None:
        """Make the rate a trusted gateway sent the rate of the request's application
        (inside its user), or with ``own_end_users`` the rate of that application's own
        end users, from now on. A bad value, or a request that names no application, is
        logged and ignored."""
        assert self._planner is not None
        field = APPLICATION_END_USER_RATE_EXTRA_ARG if own_end_users else APPLICATION_RATE_EXTRA_ARG
        try:
            rate = validate_rate(value, f"vllm_xargs.{field}")
        except LimitsError as exc:
            logger.warning("tokenpace: request %s: %s; ignored", request.request_id, exc)
            return
        user, application = self._user_of(request), request_application(request)
        if user == ANONYMOUS_USER or application is None:
            if application is None:
                logger.warning("tokenpace: request %s: vllm_xargs.%s without %s; ignored",
                               request.request_id, field, APPLICATION_EXTRA_ARG)
            return
        limiter = self._planner.inner
        rates: InnerRates = limiter.limits  # type: ignore[assignment]
        # Cost: a copy of a table, per change (sent with every request of the
        # application; it changes on a gateway reload).
        if own_end_users:
            if rates.of_application_end_users(user, application) != rate:
                limiter.set_limits(  # type: ignore[arg-type]
                    rates.with_application_end_users(user, application, rate))
        elif rates.of_application(user, application) != rate:
            limiter.set_limits(rates.with_application(user, application, rate))  # type: ignore[arg-type]

    def _adopt_rate(self, request: Request, extra: dict[str, Any]) -> None:
        """Make the request's user's rate the one its trusted gateway sent.

        A bad value is logged and ignored, never raised: the engine serves everyone, and
        the guard already answers HTTP 400 to such requests when it is installed.
        """
        assert self._planner is not None
        try:
            rate = validate_rate(extra[RATE_EXTRA_ARG], f"vllm_xargs.{RATE_EXTRA_ARG}")
            version = validate_rate_version(extra.get(RATE_VERSION_EXTRA_ARG),
                                            f"vllm_xargs.{RATE_VERSION_EXTRA_ARG}")
        except LimitsError as exc:
            logger.warning("tokenpace: request %s: %s; rate ignored", request.request_id, exc)
            return
        user = self._user_of(request)
        if user == ANONYMOUS_USER and extra.get(USER_EXTRA_ARG) not in (None, ANONYMOUS_USER):
            # The identity was malformed (paced as anonymous): the rate belongs to someone
            # else, and must not retune the quota that every anonymous request shares.
            logger.warning("tokenpace: request %s: rate ignored, its %s is malformed",
                           request.request_id, USER_EXTRA_ARG)
            return
        self._apply_rates({user: (rate, version)})

    def set_user_rates(
        self, rates: Mapping[str, tuple[float, int | None]]
    ) -> dict[str, tuple[float | None, int | None]]:
        """Set users' rates between requests: what a trusted gateway's rate-control call
        does (``POST /tokenpace/v1/rates`` on the API server, ``engine`` rate control).

        ``rates``: user -> (rate, version), already validated. A rate whose version is
        below the user's last adopted version is stale and left out. Returns, per user
        asked about, the rate now in force (None: not paced) and its version. Raises
        ``PermissionError`` unless pacing is on with ``trusted_gateway``.
        """
        if self._planner is None or not self.pacing_config.trusted_gateway:
            raise PermissionError("rate control needs pacing with trusted_gateway "
                                  "(tokenpace serve --trusted-gateway)")
        self._apply_rates(rates)
        limits = self._planner.limiter.limits
        return {user: (limits.rate(user), self._rate_versions.get(user)) for user in rates}

    def _apply_rates(self, rates: Mapping[str, tuple[float, int | None]]) -> None:
        assert self._planner is not None
        limiter = self._planner.limiter
        limits = limiter.limits
        versions = self._rate_versions
        changed: dict[str, float] = {}
        for user, (rate, version) in rates.items():
            if version is not None:
                last = versions.get(user)
                if last is not None and version < last:
                    logger.debug("tokenpace: user %r: rate version %d is older than %d; "
                                 "ignored", user, version, last)
                    continue
                versions[user] = version
            if limits.rate(user) != rate:
                changed[user] = rate
        if changed:
            # set_limits keeps every user's place in time (rescaled), so a rate change
            # grants no fresh burst. Cost: a copy of the override table, per change.
            limiter.set_limits(UserRateLimits(limits.default, {**limits.overrides, **changed}))
            logger.debug("tokenpace: paced at %s tok/s (sent by the gateway)", changed)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """vLLM's, after the request's prompt and output counts are kept for the gateway
        (``_aborted``), with its pacing user (``_ended_user``). Every request that ends
        passes here once: one that stopped or reached ``max_tokens``
        (``update_from_output``), one aborted or failed (``finish_requests``). Cost per
        ended request: ``EndedRequests.ended`` (one ``rpartition``, two ordered-dict
        inserts, one dict update, two evictions once the book is full, a clock read and a
        list store) and an attribute read (pacing on) or a ``vllm_xargs`` lookup (off);
        nothing per step."""
        book = self.ended_requests
        if book is not None:
            book.ended(request, _ended_user(request))
        if request.resumable:
            self._sessions -= 1
        windows = self._windows
        if windows is not None and windows.counting:
            windows.ended(request)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    def shutdown(self) -> None:
        release_step_hint()
        if self._event_log is not None:
            self._event_log.close()
            self._event_log = None
        super().shutdown()  # type: ignore[misc]

    # -- the step --------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        planner = self._planner
        if planner is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        if self._watcher is not None:
            self._reload_limits(self._watcher)
        planner.begin_step()
        self._steps += 1
        if self._steps % CLEANUP_EVERY_STEPS == 0:
            self._cleanup()

        priority_policy = self.policy == SchedulingPolicy.PRIORITY  # type: ignore[attr-defined]
        # Per running request and step: four attribute reads, the remaining-token sum, one
        # attribute write and one append (about 0.05 us hot); no allocation. The token
        # count is read as ``len(_all_token_ids)``, without the speculative drafts that
        # vLLM's ``num_tokens_with_spec`` property adds (a property call cost 0.045 us per
        # request): a decode step with drafts still has one sure token to sample, and its
        # drafts are accounted for after the plan (``_grant_drafts``), or in a bulk window
        # not per step at all (``_windows``: one pass per window).
        cap = self.max_num_scheduled_tokens
        streams: list[Stream] = []
        append = streams.append
        samples = SAMPLES  # local: faster
        may_end_prompt = False
        prompts: list[Stream] = []  # running a prompt chunk (for lanes; rare: no cost per decode)
        admits = bool(self.waiting) or bool(self.kv_holding_waiting)  # type: ignore[attr-defined]
        # Drafts granted per request, unless this step is in a bulk window (nothing per
        # request: what each delivers is counted once per window).
        windows = self._windows
        bulk = windows is not None and windows.step(
            admits, self.running, not planner.names_inner_levels and not self._sessions)
        planner.count_dispatches = bulk
        drafting = self._drafts is not None and not bulk
        for req in self.running:
            try:
                s = req.tokenpace_stream  # = STREAM_ATTRIBUTE, set by add_request
            except AttributeError:
                s = self._stream_of(req)
            if drafting:  # speculative decoding only: an attribute read, a len, a store
                s.drafts = len(req.spec_token_ids)
            remaining = len(req._all_token_ids) + req.num_output_placeholders - req.num_computed_tokens
            if remaining == 1:  # a decode step
                s.samples = samples
            elif 0 < remaining <= cap:
                s.samples = MAY_SAMPLE
                may_end_prompt = True
                prompts.append(s)
            else:
                s.samples = NO_SAMPLE
                if remaining > 0:
                    prompts.append(s)
            append(s)
        active_slots = self.max_num_active_reqs
        requests = self.requests
        plan = planner.plan_running(
            streams,
            active_slots,
            waiting=lambda key: (r := requests.get(key)) is not None and r.status in _WAITING,
            can_admit=len(self.running) < self.max_num_running_reqs,
        )
        past_limit = 0
        if self._lanes is not None:
            past_limit = self._plan_lanes(self._lanes, streams, prompts, plan, active_slots)

        # Per skipped request: a dict lookup, two attribute reads and two writes, and the
        # move to the tail (a set insert and test); no object of its own (see the module
        # docstring: what a throttled request costs).
        skip_step = self.current_step + 2  # schedule() increments current_step first
        throttled = [requests[k] for k in plan.throttled]
        skipped = throttled + [requests[k] for k in plan.deferred] if plan.deferred else throttled
        if self._max_loras is not None:  # LoRA only: O(running) more, see _lora_misfits
            skipped = skipped + _lora_misfits(self.running, skipped, self._max_loras)
        saved_eligible = [r.next_decode_eligible_step for r in skipped]
        for r in skipped:
            r.next_decode_eligible_step = skip_step
        bumped: list[Request] = []
        if throttled:
            self._move_to_victim_end(throttled)
            if priority_policy:
                for r in throttled:
                    r.arrival_time += _PRIORITY_DEFER_S
                bumped = throttled
        self.max_num_active_reqs = min(active_slots + len(throttled), self.max_num_running_reqs)
        if past_limit:
            self._lane_gate = self.max_num_active_reqs
            self.max_num_active_reqs = min(self.max_num_active_reqs + past_limit,
                                           self.max_num_running_reqs)
        grants = self._grant_drafts() if drafting else None
        if admits:
            self.__dict__["_reserve_prefill_lookahead"] = self._charge_admission_chunk
        try:
            output: SchedulerOutput = super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            if admits:
                del self.__dict__["_reserve_prefill_lookahead"]
            if past_limit:
                self._lane_gate = None
            self.max_num_active_reqs = active_slots
            for r, eligible in zip(skipped, saved_eligible):
                r.next_decode_eligible_step = eligible
            if bumped:
                self._restore_arrival_times(bumped)

        logged_at = self._settle(output, len(streams), may_end_prompt)
        if grants is not None:
            self._settle_drafts(output, grants, admits, logged_at)
        if windows is not None:
            windows.scheduled(output, bulk, bool(prompts), admits)
            if bulk and plan.throttled:  # cannot happen in a window; if it does, it ends
                windows.end_soon()
        return output

    def _give_back_grants(self, output: SchedulerOutput) -> None:
        """Give back every draft granted for ``output``, a step still in flight that a
        bulk window takes in (``_windows``): what it delivers is counted there."""
        entry = self._draft_results.pop(id(output), None)
        if entry is None or entry[0] is not output:
            return
        assert self._drafts is not None and self._planner is not None
        drafts = entry[2]
        self._drafts.settle(drafts.streams, drafts.granted, [0] * len(drafts.granted),
                            self.num_sampled_tokens_per_step,  # type: ignore[attr-defined]
                            self._planner.limiter.now_ns())

    def _plan_lanes(self, lanes: LanePolicy, streams: list[Stream], prompts: list[Stream],
                    plan: RunningPlan, active_slots: int) -> int:
        """Lanes' part of the plan (``pacing._lanes``): counts the held requests, adds the
        prompt chunks that sit out for a better lane to ``plan.deferred``, and returns how
        many waiting requests may be admitted past the active limit (0: none).

        Cost, lanes on only: a peek at the waiting queue; while the active limit binds and
        a better-priority request waits, one pass over the running streams; with prompt
        chunks running, a set of the skipped keys; per held request a counter increment."""
        planner = self._planner
        assert planner is not None
        stats = planner.stats
        requests = self.requests
        if plan.deferred or self._held_last_step:
            stats.note_held(requests[k].priority for k in plan.deferred)
            self._held_last_step = bool(plan.deferred)
        waiting = self.waiting  # type: ignore[attr-defined]
        best = waiting.peek_request().priority if waiting else None
        past_limit = 0
        skipped: set[Any] | None = None
        if best is not None:
            running = len(self.running)
            if running - len(plan.throttled) >= active_slots:
                skipped = {*plan.throttled, *plan.deferred}
                placed = [s.priority for s in streams if s.key not in skipped]
                past_limit = lanes.admit_past_limit(
                    best, placed, active_slots, self.max_num_running_reqs - running)
                if past_limit:
                    self._lane_worst = max(placed)
                else:
                    best = None  # it cannot be admitted this step: nothing to yield to
        if prompts:
            if skipped is None:
                skipped = {*plan.throttled, *plan.deferred}
            for s in lanes.yields([s for s in prompts if s.key not in skipped], best):
                plan.deferred.append(s.key)
                stats.lane(s.priority).yielded_steps += 1
        return past_limit

    def _grant_drafts(self) -> tuple[list[Stream], list[int]]:
        """Cut the drafts of every charged stream to what its quota allows now: the paced
        streams and what each was granted (``DraftBook.grant_all``).

        vLLM verifies ``request.spec_token_ids``; a stream that gets fewer drafts than it
        proposed keeps the first ones (a new list: under async scheduling the list is a
        placeholder that vLLM shares between requests). Cost, with speculative decoding
        only: ``grant_all``'s (a GCRA update per stream with drafts), and a dict lookup per
        stream that was cut.
        """
        assert self._drafts is not None and self._planner is not None
        streams, granted, cut = self._drafts.grant_all(self._planner.sampling_streams(),
                                                       self._planner.limiter.now_ns())
        if cut:
            requests = self.requests
            for s, got in zip(streams, granted):
                if got < s.drafts:
                    req = requests[s.key]  # type: ignore[index]
                    req.spec_token_ids = req.spec_token_ids[:got]
        return streams, granted

    def _settle_drafts(self, output: SchedulerOutput, grants: tuple[list[Stream], list[int]],
                       admitted: bool, logged_at: int | None) -> None:
        """Keep the step's granted drafts for its results (``update_from_output``), where
        those not delivered go back, the unscheduled ones with them. Drafts vLLM
        scheduled without a grant (it pads a resumed decode request's first step, only in
        a step that admitted) are owed. With an event log, the drafts granted but not
        scheduled go back here and each scheduled one is logged as charged. Cost: a dict
        lookup per granted stream (its request, for the results), and in a step that
        admitted, one per request with scheduled drafts."""
        assert self._drafts is not None and self._planner is not None
        book = self._drafts
        streams, granted = grants
        requests = self.requests
        reqs = [requests[s.key] for s in streams]  # type: ignore[index]
        log = self._event_log
        spec = output.scheduled_spec_decode_tokens
        # The step's instant: the one its sure tokens were logged at, if they were.
        now = logged_at if logged_at is not None else self._planner.limiter.now_ns()
        if log is not None:
            for i, (req, s, got) in enumerate(zip(reqs, streams, granted)):
                n = len(spec.get(req.request_id, ()))  # (only scheduled requests have an entry)
                if n < got:
                    book.give_back(s, got - n)
                    granted[i] = n
        if admitted and spec:
            seen = {s.key for s in streams}
            for rid, drafts in spec.items():
                if rid in seen or not drafts:
                    continue
                req = requests.get(rid)
                if req is None:
                    continue
                s = self._stream_of(req)
                if book.owe(s, len(drafts)):
                    reqs.append(req)
                    streams.append(s)
                    granted.append(len(drafts))
        if log is not None:
            for req, s, got in zip(reqs, streams, granted):
                for _ in range(got):
                    log.record(now, s.user, req.request_id, "charge")
        if streams:
            self._draft_results[id(output)] = (output, self._steps,
                                               _DraftsOut(reqs, streams, granted, now))

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> Any:
        """vLLM's, then the drafts of ``scheduler_output`` that were not delivered go back
        to their users (``pacing._drafts``, step 2), and bulk windows take the counts
        that waited for these results (``_windows``). Cost: nothing unless the step
        granted drafts to paced users; then per such request two ``len`` of its output
        ids and ``DraftBook.settle``'s few operations; with windows possible, a dict pop
        and a few tests per step."""
        windows = self._windows
        if windows is not None:
            windows.arrived(scheduler_output)
        entry = self._draft_results.pop(id(scheduler_output), None) if self._draft_results else None
        if entry is None or entry[0] is not scheduler_output:
            outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        else:
            drafts = entry[2]
            before = [len(req._output_token_ids) for req in drafts.requests]
            outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
            self._return_undelivered(drafts, before)
        if windows is not None:
            windows.applied(scheduler_output, self.running)
        return outputs

    def _return_undelivered(self, drafts: _DraftsOut, before: list[int]) -> None:
        """Give back each request's drafts beyond those it was delivered: the ones not
        scheduled, the ones the model rejected, and accepted ones that vLLM dropped (past
        a stop token or ``max_tokens``, or the step's output was stale after a
        preemption). The sure token stays charged, as any dispatched step's."""
        assert self._drafts is not None and self._planner is not None
        delivered = [len(req._output_token_ids) - n for req, n in zip(drafts.requests, before)]
        returned = self._drafts.settle(
            drafts.streams, drafts.granted, delivered,
            self.num_sampled_tokens_per_step,  # type: ignore[attr-defined]
            self._planner.limiter.now_ns())  # one clock read for the step's returns
        log = self._event_log
        if log is not None and returned is not None:
            for req, s, back in zip(drafts.requests, drafts.streams, returned):
                for _ in range(back):
                    log.record(drafts.at, s.user, req.request_id, "reject")

    def _reload_limits(self, watcher: LimitsFileWatcher) -> None:
        """Apply an edited limits file between steps (never in the middle of one)."""
        result = watcher.poll()
        if result is None:
            return
        if result.error is not None:
            logger.warning("tokenpace: %s", result.error)
            return
        assert result.limits is not None and self._planner is not None
        self._planner.limiter.set_limits(result.limits)
        logger.info(
            "tokenpace: reloaded %s: default %s, %d user override(s)",
            watcher.path, _default_text(result.limits.default), len(result.limits.overrides),
        )

    def _move_to_victim_end(self, throttled: list[Request]) -> None:
        """Stable-move throttled requests to the tail of ``running`` (FCFS victims)."""
        ids = {r.request_id for r in throttled}
        self.running[:] = [r for r in self.running if r.request_id not in ids] + throttled

    def _restore_arrival_times(self, bumped: list[Request]) -> None:
        waiting = self.waiting  # type: ignore[attr-defined]
        for r in bumped:
            r.arrival_time -= _PRIORITY_DEFER_S
            if r.status == RequestStatus.PREEMPTED:
                # Preempted with the bumped key: re-insert so the queue orders it correctly.
                try:
                    waiting.remove_request(r)
                except ValueError:
                    continue
                waiting.add_request(r)

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        past = self._lane_gate is not None and len(self.running) >= self._lane_gate
        if past and request.priority >= self._lane_worst:
            # Past the active limit (lanes): only a request that outranks a running one
            # comes in; the first that does not ends admission for this step.
            self.max_num_active_reqs = len(self.running)
            return False
        ready = super()._handle_blocked_waiting_request(request)  # type: ignore[misc]
        if not ready or self._planner is None:
            return ready
        ready = self._planner.may_admit(request.request_id, self._user_of(request))
        if ready and past:
            self._planner.stats.lane(request.priority).admitted += 1
        return ready

    def _charge_admission_chunk(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """``_reserve_prefill_lookahead`` while requests wait: charge a waiting request
        when its admission chunk is its last prefill chunk.

        vLLM calls this with the final size of the chunk; running requests were charged
        before ``schedule()``. Without quota the chunk stops one position short of the
        sampling position, so the prompt still progresses.
        """
        n = super()._reserve_prefill_lookahead(  # type: ignore[misc]
            request, num_computed_tokens, num_new_tokens
        )
        if n <= 0 or request.status not in _WAITING:
            return n
        planner = self._planner
        if planner is None:
            return n
        if num_computed_tokens + n >= request.num_tokens and not planner.charge_admission(
            request.request_id, self._user_of(request)
        ):
            return n - 1
        return n

    def _settle(self, output: SchedulerOutput, planned: int, may_end_prompt: bool) -> int | None:
        """The one refund point (see the module docstring). Returns the instant the
        event log's lines of this step were stamped with (None: nothing logged).

        ``planned`` running requests went through the planner. When none was preempted,
        none may have ended its prompt, and ``running`` has exactly as many requests as
        were planned and as were scheduled, every planned request was scheduled: vLLM
        puts every request it schedules in ``running``, and only a preemption takes one
        out during ``schedule()``. The planner then skips its membership test per
        charged request (about 0.03 us each).
        """
        assert self._planner is not None
        requests = self.requests
        all_dispatched = (
            not may_end_prompt
            and not output.preempted_req_ids
            and planned == len(self.running) == len(output.num_scheduled_tokens)
        )

        def still_prefilling(key: Any) -> bool:
            req = requests.get(key)
            return req is None or req.is_prefill_chunk

        log = self._event_log
        settlements = self._planner.settle(
            output.num_scheduled_tokens, still_prefilling, report=log is not None,
            all_dispatched=all_dispatched,
        )
        if log is None or not settlements:
            return None
        now = self._planner.limiter.now_ns()
        for s in settlements:
            log.record(now, s.user, s.key, "charge")
            if not s.dispatched:
                log.record(now, s.user, s.key, "refund")
        return now

    def _cleanup(self) -> None:
        assert self._planner is not None
        if self._draft_results:
            # Results that never came (the engine dropped the step): nothing to return.
            stale = self._steps - CLEANUP_EVERY_STEPS
            self._draft_results = {k: v for k, v in self._draft_results.items() if v[1] > stale}
        if self._windows is not None:
            self._windows.cleanup(self.running)
        self._planner.limiter.cleanup_idle_users()
        self._planner.inner.cleanup_idle_users()
        self._planner.forget(self.requests.__contains__)


def _lora_misfits(running: list[Request], skipped: list[Request],
                  max_loras: int) -> list[Request]:
    """The running requests, not ``skipped`` already, whose LoRA adapter does not fit in
    this step: vLLM schedules every running request it does not skip without checking
    adapters, and asserts that they use at most ``max_loras`` (``Scheduler.schedule``),
    while a request skipped for its rate lets a waiting request of another adapter start.
    The adapters of the earliest requests in vLLM's own order (priority, then arrival) fit;
    the others' requests wait a step, so a throttled request that is ready again gets its
    adapter's place back from one that started while it waited, and neither is starved.

    Cost per step: one pass over the running requests (an attribute read and a set test
    each) and a sort of the distinct adapters that are ready; only with LoRA enabled."""
    out: set[Request] = set(skipped)
    first: dict[int, tuple[int, float]] = {}  # adapter -> its earliest ready request's place
    for req in running:
        lora = req.lora_request
        if lora is None or lora.lora_int_id <= 0 or req in out:
            continue
        place = (req.priority, req.arrival_time)
        seen = first.get(lora.lora_int_id)
        if seen is None or place < seen:
            first[lora.lora_int_id] = place
    if len(first) <= max_loras:
        return []
    fits = set(sorted(first, key=first.__getitem__)[:max_loras])
    return [req for req in running
            if req.lora_request is not None and req.lora_request.lora_int_id > 0
            and req.lora_request.lora_int_id not in fits and req not in out]


def _default_text(default: float | None) -> str:
    return "none (users without a rate are not paced)" if default is None else f"{default} tok/s"


def _check_rank(request: Request, user: str, rank: int, ranks: int) -> None:
    """Warn, once per process, when a request reaches a rank its user is not pinned to.

    The API server pins users (``_hooks``, part 4); a request that arrives elsewhere came
    through a process without that hook, and its user would get a second quota here.
    Cost: one BLAKE2b of the user id per rank of the engine.
    """
    pinned = user_rank(user, ranks)
    if pinned != rank:
        warn_once(
            "misrouted",
            "tokenpace: request %s of user %r reached data-parallel rank %d but the user is "
            "pinned to rank %d: this user's requests meet more than one limiter. Is "
            "tokenpace installed in every API-server process?", request.request_id, user,
            rank, pinned)


def _ended_user(request: Request) -> str:
    """The pacing user an ended request is listed under: the one its stream was paced as
    (pacing on), else the one its ``vllm_xargs`` names (validated as pacing would);
    ``""`` for none (anonymous)."""
    stream: Stream | None = getattr(request, STREAM_ATTRIBUTE, None)
    if stream is not None:
        user = stream.user
    else:
        extra = _extra_args(request)
        if extra is None or USER_EXTRA_ARG not in extra:
            return ""
        user = request_user(request)
    return "" if user == ANONYMOUS_USER else user


def _report_untrusted_rate(request: Request) -> None:
    """Warn, once per process, that a rate sent without ``trusted_gateway`` is ignored
    (every request of such a deployment carries one)."""
    warn_once(
        "untrusted_rate",
        "tokenpace: request %s carries vllm_xargs.%s, ignored: start with --trusted-gateway "
        "(additional_config tokenpace.trusted_gateway) to trust rates sent by a gateway",
        request.request_id, RATE_EXTRA_ARG)


class PacedScheduler(_PacingMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with per-user output-token pacing."""


class PacedAsyncScheduler(_PacingMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with per-user output-token pacing."""
