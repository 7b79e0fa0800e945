"""``k8s``: one Kubernetes Pod per sandbox; commands go to the sandbox agent sidecar, never the API server.

The INTELLECT-3 layout (Prime Sandboxes), without a home-made control plane:

- each sandbox is a Pod with two containers, the *target* (the image the
  model's code runs in, holding only a sleeper) and the *agent* sidecar
  (``i3core sandbox-agent``), which runs each command inside the target's
  namespaces (``setns`` through :mod:`i3core.sandbox.nsexec`, no ``nsenter``
  binary; ``shareProcessNamespace: true``). No
  ``kubectl exec``: no API server, no websocket upgrade per command;
- a headless Service (``clusterIP: None``) gives each Pod a DNS A record,
  ``<id>.<service>.<namespace>.svc`` (``hostname``/``subdomain``), so the
  orchestrator reaches the agent directly at the Pod IP, without kube-proxy;
- readiness is pushed: the agent POSTs to the orchestrator's readiness webhook
  once it serves; nobody polls the API server. The API server sees one create
  per sandbox (rate limited, :class:`TokenBucket`) and one delete per sandbox,
  plus one delete-by-label of the whole run at :meth:`K8sSandboxes.aclose`.

Threat model (model-written code is hostile; the agent and the orchestrator are trusted):

- covered: the agent runs each command in the target's pid, mount, ipc and
  uts namespaces and root, as a uid of its own per sandbox (never the
  sleeper's, never an image's user), with no capabilities, no_new_privs,
  rlimits (``pids``, ``file_size_mb``, memory as address space where no
  memory cgroup can be made) and a fresh network namespace with only
  loopback (the agent's own, not the Pod's network). The target's root
  filesystem is read-only; the work directory and ``/tmp`` are
  memory-backed ``emptyDir`` volumes. setns joins namespaces, not cgroups:
  the commands live in the agent container's cgroup, so ``cpus`` and
  ``memory_mb`` are the agent container's limits (plus the agent's own
  share) and the target container holds only the sleeper (uid 65534, every
  capability dropped, no privilege escalation). The Pod has a RuntimeDefault
  seccomp profile, no service-account token and no service links; a
  NetworkPolicy lets in only the agent port and lets out only the readiness
  webhook's port (plus cluster DNS when the webhook URL names a host). The
  bearer token comes from a Secret, in the agent's environment only; the
  agent runs as root, so the commands' uid cannot read its
  ``/proc/<pid>/environ`` through the shared process namespace.
- not covered: the agent holds the capabilities setns needs (SYS_ADMIN,
  SYS_PTRACE, SYS_CHROOT, SETUID/SETGID, KILL, DAC_OVERRIDE, FOWNER, CHOWN):
  a bug in the agent or a kernel escape from a command is a Pod escape. A
  memory-hungry command shares the agent container's memory limit, so the
  OOM killer may pick the agent (the sandbox then fails with SandboxError).
  A NetworkPolicy is enforced only by a CNI that implements it (Calico,
  Cilium, ...). Every sandbox of a run shares one token, and the agent port
  is open to the cluster network: the token is all that keeps other Pods
  out. The Pod spec has no process limit: the node's ``podPidsLimit`` is the
  backstop to the per-uid ``pids``. The images are trusted to be what their
  names say (pin them by digest).
"""

import asyncio
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import structlog
from aiohttp import web
from pydantic import Field, model_validator

from i3core.errors import I3Error, SandboxError, SandboxFileError, SandboxFileNotFound
from i3core.sandbox.base import (
    AGENT_LIMITS, AGENT_TOKEN_ENV, AGENT_UID, SandboxBase, SandboxConfig, as_bytes, check_exec, relative_path,
)  # fmt: skip
from i3core.types import ExecResult

log = structlog.get_logger("i3core.sandbox.k8s")

RUN_LABEL = "i3core/run"
"""Label on every object of a run; its value is ``run_label``. Bulk deletion selects on it."""
SANDBOX_LABEL = "i3core/sandbox"
"""Label holding a sandbox's id (its Pod name and DNS hostname)."""
MANAGED_BY = {"app.kubernetes.io/managed-by": "i3core"}
TOKEN_KEY = "token"
"""Key of the bearer token inside the run's Secret."""
POD_IP_ENV = "POD_IP"
"""Set from the downward API in the agent container: the address it reports when ready."""
SANDBOX_USER = 65534
"""uid/gid of the target container's sleeper ("nobody"): not root, owns nothing in the image."""
COMMAND_UID_BASE = AGENT_UID
COMMAND_UIDS = 1 << 24
"""Commands run as COMMAND_UID_BASE + (id mod COMMAND_UIDS): never the sleeper's uid (a /reset kills every
process of the command uid in the Pod's pid namespace), never an image's user."""
SLEEPER = ["sleep", "2147483647"]
"""The target container's only process of its own: keeps its namespaces alive (coreutils and busybox)."""
TARGET_MATCH = r"^sleep 2147483647$"
"""How the agent finds the sleeper among the Pod's processes (``--target-match``)."""
AGENT_CAPABILITIES = ["SYS_ADMIN", "SYS_PTRACE", "SYS_CHROOT", "SETUID", "SETGID", "KILL", "DAC_OVERRIDE",
                      "FOWNER", "CHOWN"]  # fmt: skip
"""What the agent needs to enter the target's namespaces and root, run commands as their uid, kill them, and own
the work directory's files."""
AGENT_OWN_CPU = 0.25
AGENT_OWN_MEMORY_MB = 128
"""The agent's own share on top of the sandbox's limits: it serves small JSON requests (one Python process)."""
SLEEPER_RESOURCES = {"cpu": "10m", "memory": "16Mi"}
"""The target container runs only the sleeper: the commands live in the agent container's cgroup."""
TMP_MB = 64
"""Size of the target's /tmp (memory-backed: what commands write there counts in their memory limit)."""
HTTP_SLACK_S = 30.0
"""Extra seconds an exec request may take past the command's timeout (killing it, collecting output)."""
HEALTH_TIMEOUT_S = 5.0
"""How long ``alive()`` waits for the agent's /health."""
DELETE_GRACE_S = 0
"""Sandbox Pods are deleted at once: nothing in them is worth a graceful stop."""
READY_PATH = "/ready"
"""The webhook's route; ``webhook_url`` must end with it."""
MAX_READY_BODY = 4096
"""Largest readiness POST the webhook reads (it is two short strings)."""
API_TIMEOUT_S = 30.0
"""Longest a single API server request may take (a create, a delete)."""
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def require_client() -> None:
    """A clear error when the ``k8s`` extra is missing (checked when the component is built)."""
    try:
        import kubernetes_asyncio  # noqa: F401
    except ImportError as exc:
        raise I3Error(f"the k8s sandbox backend needs kubernetes_asyncio ({exc}): pip install 'i3core[k8s]'") from None


class ApiRefused(SandboxError):
    """The API server answered a request with an error status."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(message)


class K8sConfig(SandboxConfig):
    """The ``k8s`` backend: where Pods go, which images, the readiness webhook and the API client."""

    namespace: str = Field("default", pattern=DNS_LABEL, max_length=63, description="Namespace of the sandbox Pods "
                           "and the run's Service, NetworkPolicy and Secret.")  # fmt: skip
    image: str = Field("python:3.12-slim", min_length=1, description="Image of the target container, where the "
                       "model's code runs (pin it by digest in production).")  # fmt: skip
    agent_image: str = Field("i3core:latest", min_length=1, description="Image of the agent sidecar: i3core "
                             "installed (the `i3core` command); it joins the target with setns (no nsenter "
                             "binary needed).")  # fmt: skip
    agent_port: int = Field(8080, ge=1, le=65535, description="Port the agent serves its HTTP API on.")
    run_label: str = Field("i3core", pattern=DNS_LABEL, max_length=40, description="Value of the i3core/run label "
                           "on every object of this run, and the prefix of sandbox ids; aclose() deletes every "
                           "Pod carrying it.")  # fmt: skip
    service_name: str = Field("i3core-sandboxes", pattern=DNS_LABEL, max_length=50, description="Name of the "
                              "headless Service (the Pods' DNS subdomain); the NetworkPolicy and Secret are "
                              "named after it.")  # fmt: skip
    webhook_host: str = Field("0.0.0.0", description="Address the orchestrator's readiness webhook binds.")
    webhook_port: int = Field(8788, ge=1, le=65535, description="Port the readiness webhook binds.")
    webhook_url: str = Field(..., pattern=r"^https?://[^/\s]+/ready$", description="URL at which the Pods reach "
                             "the readiness webhook, ending in /ready (e.g. http://10.0.0.5:8788/ready).")  # fmt: skip
    connect: Literal["dns", "ready-address"] = Field("dns", description="How the orchestrator addresses an agent: "
                                                     "its DNS name from the headless Service, or the address its "
                                                     "readiness POST carried.")  # fmt: skip
    readiness_timeout_s: float = Field(120.0, gt=0, description="How long create() waits for the agent's readiness "
                                       "POST before deleting the Pod and failing.")  # fmt: skip
    creates_per_s: float = Field(10.0, gt=0, description="Pod creations per second, sustained (token bucket).")
    create_burst: int = Field(20, ge=1, description="Pod creations allowed at once before creates_per_s applies.")
    token_env: str = Field("I3CORE_SANDBOX_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment "
                           "variable holding the agents' bearer token, read by the orchestrator and by "
                           "`i3core sandbox manifests` (which puts it in the Secret).")  # fmt: skip
    in_cluster: bool = Field(False, description="Authenticate with the Pod's service account (the orchestrator runs "
                             "in the cluster) instead of a kubeconfig.")  # fmt: skip
    kubeconfig: str | None = Field(None, description="Path of the kubeconfig to use; default $KUBECONFIG or "
                                   "~/.kube/config. Not with in_cluster.")  # fmt: skip

    @model_validator(mode="after")
    def _one_auth(self) -> "K8sConfig":
        if self.in_cluster and self.kubeconfig is not None:
            raise ValueError("in_cluster and kubeconfig exclude each other: pick one way to reach the API server")
        return self


# -- manifests (plain dicts, as `kubectl apply` and the API take them) ----------------------------------


def run_labels(cfg: K8sConfig) -> dict[str, str]:
    return {**MANAGED_BY, RUN_LABEL: cfg.run_label}


def secret_name(cfg: K8sConfig) -> str:
    return f"{cfg.service_name}-token"


def dns_name(cfg: K8sConfig, sandbox_id: str) -> str:
    """The agent's DNS name: the A record the headless Service gives the Pod."""
    return f"{sandbox_id}.{cfg.service_name}.{cfg.namespace}.svc"


def _cpu(cores: float) -> str:
    return f"{round(cores * 1000)}m"


def command_uid(sandbox_id: str) -> int:
    """The uid (and gid) the agent runs this sandbox's commands as: one per sandbox, none of an image's users.

    RLIMIT_NPROC (the agent's ``pids`` limit without a pids cgroup) counts the
    processes of a uid across the whole node: sandboxes sharing a node must not
    share a uid. Derived from a hash of the id (2**24 choices).
    """
    digest = hashlib.sha256(sandbox_id.encode()).digest()
    return COMMAND_UID_BASE + int.from_bytes(digest[:8], "big") % COMMAND_UIDS


def agent_args(cfg: K8sConfig, sandbox_id: str) -> list[str]:
    """The sidecar's command line: ``i3core sandbox-agent`` aimed at the target's sleeper, with every limit."""
    uid = str(command_uid(sandbox_id))
    args = [
        "i3core", "sandbox-agent",
        "--target-match", TARGET_MATCH,
        "--host", "0.0.0.0", "--port", str(cfg.agent_port),
        "--token-env", AGENT_TOKEN_ENV,
        "--sandbox-id", sandbox_id,
        "--advertise", f"$({POD_IP_ENV}):{cfg.agent_port}",
        "--ready-url", cfg.webhook_url,
        "--uid", uid, "--gid", uid,
    ]  # fmt: skip
    for name in AGENT_LIMITS:
        args += [f"--{name.replace('_', '-')}", str(getattr(cfg, name))]
    return args


def pod_manifest(cfg: K8sConfig, sandbox_id: str) -> dict[str, Any]:
    """One sandbox: the target container (a sleeper) and the agent sidecar, sharing a process namespace."""
    # setns joins the target's namespaces, not its cgroup: a command stays in the cgroup of the agent that
    # forked it, so the sandbox's cpus/memory_mb are the agent container's limits (plus the agent's own share)
    agent_limits = {"cpu": _cpu(cfg.cpus + AGENT_OWN_CPU), "memory": f"{cfg.memory_mb + AGENT_OWN_MEMORY_MB}Mi"}
    target = {
        "name": "target",
        "image": cfg.image,
        "command": SLEEPER,
        "workingDir": cfg.workdir,
        "resources": {"limits": dict(SLEEPER_RESOURCES), "requests": dict(SLEEPER_RESOURCES)},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": SANDBOX_USER,
            "runAsGroup": SANDBOX_USER,
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "work", "mountPath": cfg.workdir}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    agent = {
        "name": "agent",
        "image": cfg.agent_image,
        "command": agent_args(cfg, sandbox_id),
        "ports": [{"name": "agent", "containerPort": cfg.agent_port, "protocol": "TCP"}],
        "env": [
            {"name": AGENT_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name(cfg), "key": TOKEN_KEY}}},
            {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "resources": {"limits": agent_limits, "requests": dict(agent_limits)},
        "securityContext": {
            "runAsUser": 0,  # allowPrivilegeEscalation stays unset: the API refuses false next to SYS_ADMIN
            "runAsNonRoot": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": list(AGENT_CAPABILITIES)},
        },  # no volumes: the agent reaches the work directory through /proc/<sleeper>/root
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": sandbox_id,
            "namespace": cfg.namespace,
            "labels": {**run_labels(cfg), SANDBOX_LABEL: sandbox_id},
        },
        "spec": {
            "hostname": sandbox_id,
            "subdomain": cfg.service_name,
            "shareProcessNamespace": True,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": DELETE_GRACE_S,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [target, agent],
            "volumes": [
                {"name": "work", "emptyDir": {"medium": "Memory", "sizeLimit": f"{cfg.disk_mb}Mi"}},
                {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": f"{TMP_MB}Mi"}},
            ],
        },
    }


def service_manifest(cfg: K8sConfig) -> dict[str, Any]:
    """The headless Service: no cluster IP, no kube-proxy; DNS A records for every Pod of the run."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": cfg.service_name, "namespace": cfg.namespace, "labels": run_labels(cfg)},
        "spec": {
            "clusterIP": "None",
            "selector": {RUN_LABEL: cfg.run_label},
            "publishNotReadyAddresses": True,  # the agent says when it is ready; DNS must not wait for probes
            "ports": [{"name": "agent", "port": cfg.agent_port, "targetPort": cfg.agent_port, "protocol": "TCP"}],
        },
    }


def network_policy_manifest(cfg: K8sConfig) -> dict[str, Any]:
    """In: only the agent's port. Out: only the readiness webhook's port (and cluster DNS for a host name)."""
    url = urlsplit(cfg.webhook_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    webhook: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": port}]}
    egress = [webhook]
    try:
        address = ipaddress.ip_address(url.hostname or "")
        webhook["to"] = [{"ipBlock": {"cidr": f"{address}/{address.max_prefixlen}"}}]
    except ValueError:  # a host name: the agent must resolve it, so cluster DNS is let out too
        egress.append({
            "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
        })  # fmt: skip
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{cfg.service_name}-isolation", "namespace": cfg.namespace, "labels": run_labels(cfg)},
        "spec": {
            "podSelector": {"matchLabels": {RUN_LABEL: cfg.run_label}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": cfg.agent_port}]}],
            "egress": egress,
        },
    }


def secret_manifest(cfg: K8sConfig, token: str) -> dict[str, Any]:
    """The agents' bearer token (the same value the orchestrator reads from ``token_env``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name(cfg), "namespace": cfg.namespace, "labels": run_labels(cfg)},
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


# -- creation rate limiting ----------------------------------------------------------------------------


class TokenBucket:
    """At most ``burst`` acquisitions at once, then ``rate`` per second; waiters are served in order."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def acquire(self) -> None:
        async with self._lock:
            self._refill()
            if self._tokens < 1:
                await asyncio.sleep((1 - self._tokens) / self.rate)
                self._refill()
            self._tokens -= 1


# -- the readiness webhook -----------------------------------------------------------------------------


class ReadinessWebhook:
    """The orchestrator's endpoint the agents POST ``{"sandbox": id, "address": "host:port"}`` to when ready.

    Only sandboxes announced with :meth:`expect` are accepted; the token is
    checked in constant time. Bad requests get a 4xx and the server keeps
    serving.
    """

    def __init__(self, token: str, host: str, port: int):
        self._token = token
        self.host = host
        self.port = port
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve (idempotent); ``port`` 0 binds a free port, then holds the bound one."""
        if self._runner is not None:
            return
        app = web.Application(client_max_size=MAX_READY_BODY)
        app.router.add_post(READY_PATH, self._ready)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise SandboxError(f"readiness webhook cannot bind {self.host}:{self.port}: {exc.strerror}") from None
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def stop(self) -> None:
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def expect(self, sandbox_id: str) -> asyncio.Future[str]:
        """The future that the readiness POST of ``sandbox_id`` resolves with the agent's address."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[sandbox_id] = future
        return future

    def forget(self, sandbox_id: str) -> None:
        self._waiting.pop(sandbox_id, None)

    async def wait(self, sandbox_id: str, future: asyncio.Future[str], timeout: float) -> str:
        """The address ``sandbox_id``'s agent reported, or :class:`SandboxError` after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            raise SandboxError(f"sandbox {sandbox_id}: no readiness POST from its agent within {timeout:g}s") from None
        finally:
            self.forget(sandbox_id)

    async def _ready(self, request: web.Request) -> web.Response:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(token.encode(), self._token.encode()):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": f"body larger than {MAX_READY_BODY} bytes"}, status=413)
        except ValueError:
            return web.json_response({"error": "body is not JSON"}, status=400)
        sandbox_id = body.get("sandbox") if isinstance(body, dict) else None
        address = body.get("address") if isinstance(body, dict) else None
        if not isinstance(sandbox_id, str) or not isinstance(address, str) or not _is_host_port(address):
            return web.json_response({"error": 'expected {"sandbox": id, "address": "host:port"}'}, status=400)
        future = self._waiting.get(sandbox_id)
        if future is None:
            return web.json_response({"error": f"no sandbox {sandbox_id!r} is starting"}, status=404)
        if not future.done():
            future.set_result(address)
        return web.Response(status=204)


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


# -- the gateway: a client of one agent ----------------------------------------------------------------


class AgentClient(SandboxBase):
    """One sandbox, reached over the agent's HTTP API (docs/sandboxes.md); the Sandbox protocol.

    :param address: ``host:port`` of the agent (a DNS name or the address its readiness POST carried).
    :param release: awaited once by :meth:`close` after the client closes (the backend deletes the Pod).
    """

    def __init__(self, sandbox_id: str, address: str, token: str, config: SandboxConfig,
                 release: Callable[[], Awaitable[None]] | None = None):  # fmt: skip
        self.id = sandbox_id
        self.address = address
        self.config = config
        self._base = f"http://{address}"
        self._headers = {"Authorization": f"Bearer {token}"}
        self._release = release
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _call(self, method: str, route: str, timeout: float, **kwargs) -> tuple[int, bytes]:
        """(status, body) of one request; SandboxError when the agent is unreachable or fails (5xx)."""
        try:
            async with self._http().request(method, self._base + route, timeout=aiohttp.ClientTimeout(total=timeout),
                                            **kwargs) as response:  # fmt: skip
                body = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SandboxError(f"sandbox {self.id}: agent at {self.address} unreachable: "
                               f"{type(exc).__name__}: {exc}") from None  # fmt: skip
        if response.status >= 500 or response.status in (401, 403):
            raise SandboxError(f"sandbox {self.id}: agent answered {method} {route} with {response.status}: "
                               f"{_error(body)}")  # fmt: skip
        return response.status, body

    async def exec(self, cmd: str | Sequence[str], timeout: float | None = None) -> ExecResult:
        checked = check_exec(cmd, timeout, self.config.timeout_s)  # refused here, before any request
        if isinstance(checked, ExecResult):
            return checked
        args, timeout = checked
        payload = {"cmd": cmd if isinstance(cmd, str) else args, "timeout": timeout}
        status, body = await self._call("POST", "/exec", timeout + HTTP_SLACK_S, json=payload)
        if status != 200:
            raise SandboxError(f"sandbox {self.id}: agent refused exec ({status}): {_error(body)}")
        try:
            fields = json.loads(body)
            return ExecResult(
                exit_code=fields["exit_code"], stdout=fields["stdout"], stderr=fields["stderr"],
                timed_out=fields["timed_out"], oom_killed=fields.get("oom_killed"),
                truncated=fields.get("truncated", False), duration_s=fields.get("duration_s", 0.0),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as exc:
            raise SandboxError(f"sandbox {self.id}: agent sent a malformed exec result: {exc}") from None

    async def write_file(self, path: str, data: bytes | str) -> None:
        payload = as_bytes(data)
        rel = relative_path(path, self.config.workdir)
        status, body = await self._call("PUT", "/files", self.config.timeout_s, params={"path": str(rel)},
                                        data=payload)  # fmt: skip
        if status != 204:
            raise SandboxFileError(f"{path!r}: {_error(body)}")

    async def read_file(self, path: str) -> bytes:
        rel = relative_path(path, self.config.workdir)
        status, body = await self._call("GET", "/files", self.config.timeout_s, params={"path": str(rel)})
        if status == 404:
            raise SandboxFileNotFound(f"{path!r}: {_error(body)}")
        if status != 200:
            raise SandboxFileError(f"{path!r}: {_error(body)}")
        if len(body) > self.config.max_file_bytes:
            raise SandboxFileError(f"{path!r} is larger than max_file_bytes ({self.config.max_file_bytes})")
        return body

    async def reset(self) -> None:
        status, body = await self._call("POST", "/reset", self.config.timeout_s + HTTP_SLACK_S)
        if status != 204:
            raise SandboxError(f"sandbox {self.id}: agent refused reset ({status}): {_error(body)}")

    async def alive(self) -> bool:
        if self._closed:
            return False
        try:
            status, _ = await self._call("GET", "/health", HEALTH_TIMEOUT_S)
        except SandboxError:
            return False
        return status == 200

    def detach(self) -> None:
        """Close without the release step (the backend frees every Pod of the run at once)."""
        self._release = None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._session is not None:
            await self._session.close()
        if self._release is not None:
            await self._release()


def _error(body: bytes) -> str:
    """The ``error`` of an agent's JSON answer, else its first 200 characters."""
    try:
        data = json.loads(body)
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return data["error"]
    except ValueError:
        pass
    return body[:200].decode("utf-8", errors="replace") or "(no body)"


# -- the backend ---------------------------------------------------------------------------------------


class K8sSandboxes:
    """The ``k8s`` component: creates sandbox Pods through the API server, talks to their agents directly.

    The run's shared objects (:meth:`manifests`: Service, NetworkPolicy, Secret)
    are applied once by the operator (``i3core sandbox manifests plugins.toml |
    kubectl apply -f -``); the orchestrator's service account needs only
    create, delete and deletecollection on Pods in ``namespace``.
    """

    Config = K8sConfig

    def __init__(self, config: K8sConfig):
        require_client()
        self.config = config
        self._bucket = TokenBucket(config.creates_per_s, config.create_burst)
        self._webhook: ReadinessWebhook | None = None
        self._api_client = None
        self._open: dict[str, AgentClient] = {}
        self._starting = asyncio.Lock()

    def token(self) -> str:
        """The agents' bearer token, from the environment variable ``token_env``."""
        token = os.environ.get(self.config.token_env, "")
        if not token:
            raise I3Error(f"set ${self.config.token_env} to the sandbox agents' bearer token (e.g. "
                          "$(openssl rand -hex 32)); the orchestrator and the Secret need the same value")
        return token

    def manifests(self) -> list[dict[str, Any]]:
        """What ``kubectl apply`` needs before a run: the Secret, the headless Service, the NetworkPolicy,
        and a sample sandbox Pod (``<run_label>-sample``) to check the spec with."""
        cfg = self.config
        return [secret_manifest(cfg, self.token()), service_manifest(cfg), network_policy_manifest(cfg),
                pod_manifest(cfg, f"{cfg.run_label}-sample")]  # fmt: skip

    def new_id(self) -> str:
        return f"{self.config.run_label}-{secrets.token_hex(5)}"

    async def _api(self, call: str, *args, **kwargs) -> Any:
        """One CoreV1Api call (the client built on first use from the kubeconfig or the in-cluster service
        account). :raises SandboxError: the API server refused, failed or could not be reached."""
        from kubernetes_asyncio import client, config as kube_config
        from kubernetes_asyncio.client.exceptions import ApiException

        async with self._starting:  # concurrent first calls build one client
            if self._api_client is None:
                try:
                    if self.config.in_cluster:
                        kube_config.load_incluster_config()
                        self._api_client = client.ApiClient()
                    else:
                        self._api_client = await kube_config.new_client_from_config(
                            config_file=self.config.kubeconfig)  # fmt: skip
                except (kube_config.ConfigException, OSError) as exc:
                    where = "the in-cluster service account" if self.config.in_cluster else "the kubeconfig"
                    raise SandboxError(f"cannot reach the Kubernetes API through {where}: {exc}") from None
        try:
            return await getattr(client.CoreV1Api(self._api_client), call)(*args, _request_timeout=API_TIMEOUT_S,
                                                                           **kwargs)  # fmt: skip
        except ApiException as exc:
            raise ApiRefused(exc.status, f"Kubernetes API {call}: {exc.status} {exc.reason}") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SandboxError(f"Kubernetes API {call}: unreachable: {type(exc).__name__}: {exc}") from None

    async def _started_webhook(self) -> ReadinessWebhook:
        async with self._starting:  # concurrent first create() calls bind one webhook
            if self._webhook is None:
                self._webhook = ReadinessWebhook(self.token(), self.config.webhook_host, self.config.webhook_port)
            await self._webhook.start()
        return self._webhook

    async def create(self) -> AgentClient:
        """A new sandbox Pod, returned once its agent has POSTed its readiness; never polls the API server.

        :raises SandboxError: the Pod cannot be created, or its agent did not report within
            ``readiness_timeout_s`` (the Pod is deleted then).
        """
        webhook = await self._started_webhook()
        await self._bucket.acquire()
        sandbox_id = self.new_id()
        ready = webhook.expect(sandbox_id)
        try:
            await self._api("create_namespaced_pod", self.config.namespace, pod_manifest(self.config, sandbox_id))
        except SandboxError as exc:
            webhook.forget(sandbox_id)
            raise SandboxError(f"cannot create sandbox Pod {sandbox_id}: {exc}") from None
        try:
            address = await webhook.wait(sandbox_id, ready, self.config.readiness_timeout_s)
        except BaseException:
            await self._delete(sandbox_id)
            raise
        if self.config.connect == "dns":
            address = f"{dns_name(self.config, sandbox_id)}:{self.config.agent_port}"
        return self._client(sandbox_id, address)

    def _client(self, sandbox_id: str, address: str) -> AgentClient:
        async def release() -> None:
            self._open.pop(sandbox_id, None)
            await self._delete(sandbox_id)

        sandbox = AgentClient(sandbox_id, address, self.token(), self.config, release)
        self._open[sandbox_id] = sandbox
        return sandbox

    async def _delete(self, sandbox_id: str) -> None:
        """Delete one sandbox Pod; a failure is logged, not raised (aclose() deletes the run's Pods by label)."""
        try:
            await self._api("delete_namespaced_pod", sandbox_id, self.config.namespace,
                            grace_period_seconds=DELETE_GRACE_S)  # fmt: skip
        except ApiRefused as exc:
            if exc.status != 404:
                log.warning("sandbox pod not deleted; aclose() deletes it by label", sandbox=sandbox_id, error=str(exc))
        except SandboxError as exc:
            log.warning("sandbox pod not deleted; aclose() deletes it by label", sandbox=sandbox_id, error=str(exc))

    async def aclose(self) -> None:
        """Every Pod of the run deleted at once (by its i3core/run label), then the webhook stopped.

        :raises SandboxError: the bulk delete failed (the webhook is stopped anyway).
        """
        for sandbox in list(self._open.values()):
            sandbox.detach()  # the bulk delete below removes their Pods in one call
            await sandbox.close()
        self._open.clear()
        try:
            if self._api_client is not None:
                try:
                    await self._api("delete_collection_namespaced_pod", self.config.namespace,
                                    label_selector=f"{RUN_LABEL}={self.config.run_label}",
                                    grace_period_seconds=DELETE_GRACE_S)  # fmt: skip
                except SandboxError as exc:
                    raise SandboxError(f"cannot delete the run's sandbox Pods (label {RUN_LABEL}="
                                       f"{self.config.run_label}): {exc}") from None  # fmt: skip
                finally:
                    await self._api_client.close()
                    self._api_client = None
        finally:
            if self._webhook is not None:
                await self._webhook.stop()
