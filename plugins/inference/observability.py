"""What the builtin server tells its operators: ``/metrics`` in Prometheus' text format and one log line a request.

Metric names are vLLM's where vLLM has one (a dashboard built for vLLM reads these), i3core's own under
``i3core:``; every series carries ``model_name``. Gauges are read from the engine when scraped; counters and
histograms are fed by the engine task after every step (:meth:`ServerMetrics.after_step`), so a token is counted
once, when it is made, whether or not its client is still there. The registry is the server's own (several servers
may live in one process: tests, the ``local`` source).

The request line (:func:`request_log`) is one structlog event ``request`` per HTTP request with ``method``,
``route``, ``status``, ``prompt_tokens``, ``completion_tokens``, ``duration_s``, ``finish_reason`` and ``client``
(the peer address); a handler adds what it knows to ``http[TRACE]``. Imports: prometheus_client, structlog,
aiohttp; nothing of the engine.
"""

import asyncio
import sys
import time
from collections.abc import Callable

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

log = structlog.get_logger("i3core.server")

TRACE = web.RequestKey("i3core_trace", dict)
"""Where a handler leaves ``prompt_tokens``, ``completion_tokens`` and ``finish_reason`` for the request line."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format (what every scraper reads)."""

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
"""Seconds from a request's arrival to its first token: a queue behind a full batch can take minutes."""
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
"""Seconds between two tokens of one sequence: one decode step of the whole batch."""
CLIENT_GONE = 499
"""The status a request is logged with when its client closed the connection first (nginx's convention)."""
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class ServerMetrics:
    """The Prometheus registry of one server.

    ``state`` is called at every scrape and returns ``running``, ``waiting``, ``max_slots``, ``version``,
    ``paused`` (what the engine holds now).
    """

    def __init__(self, model_name: str, state: Callable[[], dict]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name, self.state = model_name, state
        labels = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.").labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(model_name)
        self.finished = counter("vllm:request_success", "Sequences finished, by finish reason.", ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two tokens of a sequence.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token of a sequence.",
                             E2E_BUCKETS)
        self.http = counter("i3core:http_requests", "HTTP requests answered, by route and status.",
                            ["route", "status"])
        self.weight_updates = counter("i3core:weight_updates", "Weight versions swapped in.").labels(model_name)
        self.registry.register(_Gauges(self))
        self._timing: dict[int, list[float]] = {}
        """Per sequence id: ``[arrival, last token time, tokens seen]``."""

    def arrived(self, seq) -> None:
        """``seq`` was queued now."""
        now = time.perf_counter()
        self._timing[seq.id] = [now, now, 0]

    def after_step(self, seqs, finished) -> None:
        """After one engine step (on the engine task, the engine idle): count each sequence's new tokens and time
        them; ``finished`` are the sequences that ended in it (they leave the books)."""
        now = time.perf_counter()
        for seq in (*seqs, *finished):
            timing = self._timing.get(seq.id)
            if timing is None:
                continue
            made = len(seq.token_ids) - int(timing[2])
            if made <= 0:
                continue
            if timing[2] == 0:
                self.prompt_tokens.inc(len(seq.request.prompt_ids))
                self.ttft.observe(now - timing[0])
                made_after_first = made - 1
            else:
                made_after_first = made
            for _ in range(made_after_first):
                self.itl.observe((now - timing[1]) / made)
            self.generation_tokens.inc(made)
            timing[1], timing[2] = now, len(seq.token_ids)
        for seq in finished:
            self.left(seq)

    def left(self, seq) -> None:
        """``seq`` finished or was aborted: its finish reason is counted, its timing dropped."""
        timing = self._timing.pop(seq.id, None)
        if timing is not None and seq.finish_reason is not None:
            self.finished.labels(self.model_name, seq.finish_reason).inc()
            if timing[2]:
                self.e2e.observe(timing[1] - timing[0])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class UnscrapedMetrics(ServerMetrics):
    """The registry of an engine no scraper reaches (the ``local`` source, in the orchestrator's process): the
    weight-update counter is kept, the per-token books are not (they cost the engine task a few hundred
    microseconds a step, on the interpreter the engine's forward needs)."""

    def arrived(self, seq) -> None:
        pass

    def after_step(self, seqs, finished) -> None:
        pass

    def left(self, seq) -> None:
        pass


class _Gauges:
    """What the engine holds at scrape time, as gauges."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        state, name = self.metrics.state(), self.metrics.model_name

        def gauge(metric, doc, value):
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", state["running"])
        yield gauge("vllm:num_requests_waiting", "Sequences waiting for a slot.", state["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache slots in use (1 = full).",
                    state["running"] / max(state["max_slots"], 1))
        yield gauge("i3core:kv_slots_used", "KV-cache slots in use (one a running sequence).", state["running"])
        yield gauge("i3core:kv_slots", "KV-cache slots (--max-slots).", state["max_slots"])
        yield gauge("i3core:policy_version", "The policy version being served.", state["version"])
        yield gauge("i3core:paused", "1 while decoding is paused (/pause).", float(state["paused"]))


def configure_logging(fmt: str = "json") -> None:
    """The server process's log: one line per event on stdout, JSON (for tools, the run's server logs) or
    ``console`` (for a person running ``i3core serve``)."""
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, renderer],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=False,
    )


def request_log(metrics: ServerMetrics | None):
    """The middleware that writes one ``request`` line per request (and counts it in ``metrics``)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        start = time.perf_counter()
        trace: dict = {}
        request[TRACE] = trace
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CLIENT_GONE  # the client went away (its sequences are aborted)
            raise
        finally:
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "(none)"
            if metrics is not None:
                metrics.http.labels(metrics.model_name, route, str(status)).inc()
            level = log.info if status < 500 else log.warning
            level("request", method=request.method, route=route, status=status,
                  prompt_tokens=trace.get("prompt_tokens"), completion_tokens=trace.get("completion_tokens"),
                  duration_s=round(time.perf_counter() - start, 6), finish_reason=trace.get("finish_reason"),
                  client=request.remote)

    return middleware
