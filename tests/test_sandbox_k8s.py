"""The ``k8s`` sandbox backend, without a cluster: its manifests against the client's models, the creation
rate limiter, the readiness webhook, the agent client, ``i3core sandbox manifests``, and the agent's
readiness + exec path end to end against a real agent and a namespaced process."""

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import yaml

from kubernetes_asyncio import client as kube_client

from i3core.errors import ConfigError, RolloutMasked, SandboxError, SandboxFileError, SandboxFileNotFound
from i3core.plugins.sandboxes.k8s import (
    RUN_LABEL,
    AgentClient,
    K8sConfig,
    ReadinessWebhook,
    TokenBucket,
    agent_args,
    command_uid,
    dns_name,
    pod_manifest,
)
from i3core.sandbox.base import AGENT_LIMITS, AGENT_TOKEN_ENV
from i3core.sandbox.pool import SANDBOX_FAILED, SandboxPool
from i3core.testing import make_component

from tests.sandbox_backends import all_gone, sleep_in_flight

from .conftest import run_cli

TOKEN_ENV = "I3CORE_SANDBOX_TOKEN"
MODELS = {"Pod": "V1Pod", "Service": "V1Service", "NetworkPolicy": "V1NetworkPolicy", "Secret": "V1Secret"}
WEBHOOK_BY_IP = "http://10.1.2.3:8788/ready"
WEBHOOK_BY_NAME = "http://orchestrator.rl.svc:8788/ready"


@pytest.fixture
def token(monkeypatch):
    value = secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, value)
    return value


def backend(**options):
    return make_component("sandbox", "k8s", **{"webhook_url": WEBHOOK_BY_IP, **options})


def by_kind(items):
    return {item["kind"]: item for item in items}


class Body:
    """What ApiClient.deserialize reads from an HTTP answer: the JSON text in ``data``."""

    def __init__(self, obj):
        self.data = json.dumps(obj)


def round_trip(items):
    """Each manifest into its kubernetes_asyncio model and back to JSON, as the client would send it."""

    async def go():
        async with kube_client.ApiClient() as api:
            return [api.sanitize_for_serialization(api.deserialize(Body(m), MODELS[m["kind"]])) for m in items]

    return asyncio.run(go())


# -- manifests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("webhook_url", [WEBHOOK_BY_IP, WEBHOOK_BY_NAME])
@pytest.mark.parametrize("limits", [{}, {"memory_mb": 2048, "cpus": 0.5, "workdir": "/sandbox/work"}])
def test_every_manifest_survives_the_client_models_unchanged(token, webhook_url, limits):
    items = backend(webhook_url=webhook_url, namespace="rl-sandboxes", **limits).manifests()
    assert sorted(m["kind"] for m in items) == sorted(MODELS)
    assert round_trip(items) == items  # no field unknown to the models, none misspelt, none of the wrong type


def test_pod_security_settings(token):
    cfg = K8sConfig(webhook_url=WEBHOOK_BY_IP, memory_mb=768, cpus=1.5, disk_mb=300)
    pod = pod_manifest(cfg, "i3core-0a1b2c3d4e")
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True and spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False and spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    target, agent = spec["containers"]
    assert target["command"] == ["sleep", "2147483647"]
    tsc = target["securityContext"]
    assert tsc["runAsNonRoot"] is True and tsc["runAsUser"] != 0 and tsc["allowPrivilegeEscalation"] is False
    assert tsc["readOnlyRootFilesystem"] is True and tsc["capabilities"] == {"drop": ["ALL"]}
    assert tsc["privileged"] is False
    # commands stay in the agent's cgroup (nsenter joins namespaces, not cgroups): the sandbox's limits are there
    assert agent["resources"]["limits"] == {"cpu": "1750m", "memory": "896Mi"} == agent["resources"]["requests"]
    assert target["resources"]["limits"] == {"cpu": "10m", "memory": "16Mi"}
    assert {"name": "work", "mountPath": "/work"} in target["volumeMounts"]
    work = next(v for v in spec["volumes"] if v["name"] == "work")
    assert work["emptyDir"] == {"medium": "Memory", "sizeLimit": "300Mi"}
    asc = agent["securityContext"]
    assert asc["capabilities"]["drop"] == ["ALL"] and {"SYS_ADMIN", "SYS_PTRACE"} <= set(asc["capabilities"]["add"])
    assert asc["privileged"] is False and asc["readOnlyRootFilesystem"] is True
    # the API server refuses allowPrivilegeEscalation=false next to an added SYS_ADMIN
    assert "allowPrivilegeEscalation" not in asc
    token_env = next(e for e in agent["env"] if e["name"] == AGENT_TOKEN_ENV)
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": "i3core-sandboxes-token", "key": "token"}
    assert not any("secret" in json.dumps(e).lower() for e in target.get("env", []))  # the target never sees it
    command = agent["command"]
    assert command[:2] == ["i3core", "sandbox-agent"] and cfg.webhook_url in command
    flags = dict(zip(command[2::2], command[3::2]))
    assert flags["--memory-mb"] == "768" and flags["--cpus"] == "1.5" and flags["--workdir"] == "/work"
    assert flags["--uid"] == flags["--gid"] != str(tsc["runAsUser"])  # /reset must never kill the sleeper
    assert int(flags["--uid"]) >= 1_000_000


def test_each_sandbox_runs_its_commands_as_its_own_uid():
    uids = {command_uid(f"i3core-{i:010x}") for i in range(256)}  # a full node
    assert len(uids) >= 250 and min(uids) >= 1_000_000 and max(uids) < 1_000_000 + (1 << 24)
    assert command_uid("i3core-0000000001") == command_uid("i3core-0000000001")


def test_agent_args_carry_only_the_limits_the_agent_applies():
    cfg = K8sConfig(webhook_url=WEBHOOK_BY_IP, memory_mb=768, warm=3, reuse=False)
    args = agent_args(cfg, "sb-1")
    flags = {arg for arg in args if arg.startswith("--")}
    assert {f"--{name.replace('_', '-')}" for name in AGENT_LIMITS} <= flags
    assert not flags & {"--warm", "--max-concurrent", "--reuse", "--health-interval-s"}
    assert args[args.index("--memory-mb") + 1] == "768"


def test_pod_gets_a_dns_record_from_the_headless_service(token):
    component = backend(namespace="rl", service_name="sbx", run_label="exp7")
    items = by_kind(component.manifests())
    service, pod = items["Service"], items["Pod"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {RUN_LABEL: "exp7"}
    assert pod["metadata"]["labels"][RUN_LABEL] == "exp7"
    assert pod["spec"]["hostname"] == pod["metadata"]["name"] and pod["spec"]["subdomain"] == "sbx"
    assert dns_name(component.config, "exp7-abc") == "exp7-abc.sbx.rl.svc"
    ids = {component.new_id() for _ in range(200)}
    assert len(ids) == 200 and all(re.fullmatch(r"exp7-[0-9a-f]{10}", i) for i in ids)


def test_network_policy_lets_in_the_agent_port_and_out_only_the_webhook(token):
    policy = by_kind(backend(agent_port=9000).manifests())["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9000}]}]
    webhook_only = {"ports": [{"protocol": "TCP", "port": 8788}], "to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}]}
    assert policy["egress"] == [webhook_only]
    by_name = by_kind(backend(webhook_url=WEBHOOK_BY_NAME).manifests())["NetworkPolicy"]["spec"]["egress"]
    assert by_name[0] == {"ports": [{"protocol": "TCP", "port": 8788}]}
    assert {p["port"] for p in by_name[1]["ports"]} == {53} and len(by_name) == 2


def test_secret_carries_the_token_from_the_environment(token, monkeypatch):
    assert by_kind(backend().manifests())["Secret"]["stringData"] == {"token": token}
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(Exception, match=f"set \\${TOKEN_ENV}"):
        backend().manifests()


def test_component_meets_the_protocols(token):
    from i3core.protocols import Sandbox, SandboxBackend

    assert isinstance(backend(), SandboxBackend)
    assert isinstance(AgentClient("sb", "127.0.0.1:1", "t", K8sConfig(webhook_url=WEBHOOK_BY_IP)), Sandbox)


def test_config_refuses_bad_values():
    with pytest.raises(ConfigError) as info:
        make_component("sandbox", "k8s", webhook_url="http://x:1/ready", in_cluster=True, kubeconfig="/k")
    assert "exclude each other" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_component("sandbox", "k8s", webhook_url="ftp://x/ready", run_label="Bad_Label", namespace="x" * 70)
    assert {p.path for p in info.value.problems} == {"sandbox.webhook_url", "sandbox.run_label", "sandbox.namespace"}
    with pytest.raises(ConfigError, match="webhook_url"):
        make_component("sandbox", "k8s")


# -- creation rate limiting ------------------------------------------------------------------------------


def test_token_bucket_allows_a_burst_then_the_rate():
    async def go():
        bucket = TokenBucket(rate=20.0, burst=3)
        start = time.monotonic()
        stamps = []
        for _ in range(7):
            await bucket.acquire()
            stamps.append(time.monotonic() - start)
        return stamps

    stamps = asyncio.run(go())
    assert stamps[2] < 0.05  # the burst goes at once
    assert 0.18 <= stamps[6] < 1.0  # then 4 more at 20/s: 0.2 s
    gaps = [b - a for a, b in zip(stamps[3:], stamps[4:])]
    assert all(0.03 <= g < 0.5 for g in gaps), gaps


def test_token_bucket_serves_concurrent_waiters_at_the_rate():
    async def go():
        bucket = TokenBucket(rate=50.0, burst=1)
        start = time.monotonic()
        await asyncio.gather(*(bucket.acquire() for _ in range(11)))
        return time.monotonic() - start

    assert 0.18 <= asyncio.run(go()) < 1.5  # 10 waits of 1/50 s


# -- the readiness webhook -------------------------------------------------------------------------------


def test_webhook_refuses_bad_requests_and_keeps_serving():
    async def go():
        webhook = ReadinessWebhook("good-token", "127.0.0.1", 0)
        await webhook.start()
        url = f"http://127.0.0.1:{webhook.port}/ready"
        auth = {"Authorization": "Bearer good-token"}
        ready = webhook.expect("sb-1")
        try:
            async with aiohttp.ClientSession() as http:
                async def post(headers=None, **kwargs):
                    async with http.post(url, headers=headers, **kwargs) as response:
                        return response.status

                body = {"sandbox": "sb-1", "address": "10.0.0.9:8080"}
                assert await post(json=body) == 401
                assert await post({"Authorization": "Bearer bad-token"}, json=body) == 401
                assert await post({"Authorization": "good-token"}, json=body) == 401
                assert await post(auth, data=b"{not json") == 400
                assert await post(auth, json=["sb-1"]) == 400
                assert await post(auth, json={"sandbox": "sb-1"}) == 400
                assert await post(auth, json={"sandbox": "sb-1", "address": "no-port"}) == 400
                assert await post(auth, json={"sandbox": 7, "address": "10.0.0.9:8080"}) == 400
                assert await post(auth, data=b"x" * 100_000) == 413
                assert await post(auth, json={"sandbox": "sb-unknown", "address": "10.0.0.9:8080"}) == 404
                async with http.get(url, headers=auth) as response:
                    assert response.status == 405
                assert not ready.done()
                assert await post(auth, json=body) == 204
                assert await webhook.wait("sb-1", ready, 5) == "10.0.0.9:8080"
                assert await post(auth, json=body) == 404  # delivered once; the id is forgotten
        finally:
            await webhook.stop()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_webhook_wait_times_out_with_a_sandbox_error():
    async def go():
        webhook = ReadinessWebhook("t", "127.0.0.1", 0)
        await webhook.start()
        try:
            ready = webhook.expect("sb-slow")
            with pytest.raises(SandboxError, match="no readiness POST"):
                await webhook.wait("sb-slow", ready, 0.2)
        finally:
            await webhook.stop()

    asyncio.run(go())


def test_webhook_port_in_use_is_a_sandbox_error():
    async def go():
        first = ReadinessWebhook("t", "127.0.0.1", 0)
        await first.start()
        try:
            with pytest.raises(SandboxError, match="cannot bind"):
                await ReadinessWebhook("t", "127.0.0.1", first.port).start()
        finally:
            await first.stop()

    asyncio.run(go())


# -- the agent client ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_agent_client_with_no_agent_is_a_sandbox_error():
    async def go():
        cfg = K8sConfig(webhook_url=WEBHOOK_BY_IP, timeout_s=2)
        async with AgentClient("sb-gone", f"127.0.0.1:{free_port()}", "t", cfg) as sb:
            with pytest.raises(SandboxError, match="unreachable"):
                await sb.exec("true")
            with pytest.raises(SandboxError, match="unreachable"):
                await sb.read_file("x")
            with pytest.raises(SandboxFileError):  # refused before any request
                await sb.write_file("../escape", "x")
            refused = await sb.exec([])  # refused before any request: a result, not an unreachable agent
            assert refused.exit_code == 126 and "exec refused" in refused.stderr, refused
            assert not await sb.alive()
        assert not await sb.alive()
        with pytest.raises(SandboxError, match="closed"):
            await sb.exec("true")

    asyncio.run(go())


def kubeconfig_for(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "here",
        "clusters": [{"name": "here", "cluster": {"server": server}}],
        "users": [{"name": "me", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "here", "context": {"cluster": "here", "user": "me"}}],
    }))  # fmt: skip
    return path


def test_create_without_a_reachable_api_server_is_a_sandbox_error(token, tmp_path):
    async def go():
        sandboxes = backend(kubeconfig=str(kubeconfig_for(tmp_path, f"http://127.0.0.1:{free_port()}")),
                            webhook_host="127.0.0.1", webhook_port=free_port())  # fmt: skip
        results = await asyncio.gather(*(sandboxes.create() for _ in range(5)), return_exceptions=True)
        for result in results:  # concurrent first calls share one webhook and one API client
            assert isinstance(result, SandboxError) and re.search("cannot create sandbox Pod .*unreachable",
                                                                  str(result)), result  # fmt: skip
        assert sandboxes._webhook._waiting == {}  # the failed sandbox is not awaited any more
        with pytest.raises(SandboxError, match="cannot delete the run's sandbox Pods"):
            await sandboxes.aclose()
        assert sandboxes._webhook._runner is None  # stopped all the same
        missing = backend(kubeconfig=str(tmp_path / "nowhere"), webhook_host="127.0.0.1", webhook_port=free_port())
        with pytest.raises(SandboxError, match="through the kubeconfig"):
            await missing.create()
        await missing.aclose()

    asyncio.run(asyncio.wait_for(go(), 60))


# -- i3core sandbox manifests ----------------------------------------------------------------------------


def write_config(tmp_path: Path, sandbox: str) -> Path:
    path = tmp_path / "plugins.toml"
    path.write_text(f'[run]\nname = "k8s-test"\n\n{sandbox}')
    return path


K8S_SECTION = '[sandbox]\nuse = "k8s"\nnamespace = "rl"\nwebhook_url = "http://10.1.2.3:8788/ready"\n'


def cli_env(**extra):
    return {**os.environ, TOKEN_ENV: "cli-token", **extra}


@pytest.mark.slow
def test_manifests_command_prints_yaml_and_json(tmp_path):
    config = write_config(tmp_path, K8S_SECTION)
    result = run_cli("sandbox", "manifests", str(config), "--set", "sandbox.run_label='exp9'", env=cli_env())
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["Secret", "Service", "NetworkPolicy", "Pod"]
    assert docs[0]["stringData"]["token"] == "cli-token" and docs[3]["metadata"]["labels"][RUN_LABEL] == "exp9"
    assert round_trip(docs) == docs
    result = run_cli("sandbox", "manifests", str(config), "--format", "json", "--set", "sandbox.run_label='exp9'",
                     env=cli_env())
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert listed["kind"] == "List" and listed["apiVersion"] == "v1"
    assert [d["kind"] for d in listed["items"]] == ["Secret", "Service", "NetworkPolicy", "Pod"]
    assert listed["items"][1] == docs[1]


def one_line_error(result, code):
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.slow
def test_manifests_command_errors_are_one_line(tmp_path):
    no_sandbox = write_config(tmp_path, "")
    assert "no [sandbox] section" in one_line_error(run_cli("sandbox", "manifests", str(no_sandbox), env=cli_env()), 2)
    config = write_config(tmp_path, K8S_SECTION)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    assert f"${TOKEN_ENV}" in one_line_error(run_cli("sandbox", "manifests", str(config), env=env), 1)
    # the k8s extra missing (kubernetes_asyncio unimportable) is named with its install command
    blocked = ("import sys; sys.modules['kubernetes_asyncio'] = None; from i3core.cli.main import main; "
               f"sys.exit(main(['sandbox', 'manifests', {str(config)!r}]))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert "pip install 'i3core[k8s]'" in one_line_error(result, 1)
    result = run_cli("sandbox", "--help")
    assert result.returncode == 0 and "manifests" in result.stdout


@pytest.mark.slow
def test_manifests_command_on_a_backend_without_manifests(tmp_path):
    config = write_config(tmp_path, '[sandbox]\nuse = "local"\n')
    line = one_line_error(run_cli("sandbox", "manifests", str(config), env=cli_env()), 2)
    assert "'local' has no manifests" in line


# -- end to end: a real agent, its readiness POST, the exec path ------------------------------------------


E2E_WORKDIR = "/tmp/work"
"""The work directory inside the target: its /tmp is a tmpfs of its own mount namespace, like the Pod's emptyDir."""


def namespaced_sleeper() -> tuple[subprocess.Popen, int]:
    """``unshare`` holding new mount and PID namespaces around the Pod's sleeper, with a private tmpfs on /tmp
    (the host's /tmp is untouched); (the unshare process, the sleeper's host pid)."""
    import psutil

    holder = subprocess.Popen(["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c",
                               "mount -t tmpfs -o size=64m,mode=1777 i3core-e2e /tmp && exec sleep 2147483647"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = psutil.Process(holder.pid).children()
        if children and children[0].cmdline() == ["sleep", "2147483647"]:
            return holder, children[0].pid
        time.sleep(0.05)
    holder.kill()
    raise RuntimeError("unshare did not start its sleeper")


def local_agent_argv(cfg: K8sConfig, sandbox_id: str, target_pid: int, port: int) -> list[str]:
    """The Pod's own agent command line (:func:`agent_args`), aimed at a local process instead of the sleeper
    container: the target by pid, bound and advertised on the loopback."""
    args = agent_args(cfg, sandbox_id)
    swaps = {"--target-match": ("--target-pid", str(target_pid)), "--host": ("--host", "127.0.0.1"),
             "--port": ("--port", str(port)), "--advertise": ("--advertise", f"127.0.0.1:{port}")}  # fmt: skip
    out = []
    for flag, value in zip(args[2::2], args[3::2]):
        out.extend(swaps.get(flag, (flag, value)))
    assert args[:2] == ["i3core", "sandbox-agent"] and len(args) % 2 == 0
    return [sys.executable, "-m", "i3core.cli", "sandbox-agent", *out]


@contextlib.asynccontextmanager
async def ready_agent(target_pid: int, **limits) -> AsyncIterator[tuple[subprocess.Popen, AgentClient]]:
    """A real agent serving ``target_pid``, started from the Pod's command line and ready once its readiness POST
    reached a real webhook; (its process, a client of it). Its output is printed at the end (shown on failure)."""
    token = secrets.token_hex(16)
    sandbox_id = "i3core-e2e0000001"
    webhook = ReadinessWebhook(token, "127.0.0.1", 0)
    await webhook.start()
    cfg = K8sConfig(webhook_url=f"http://127.0.0.1:{webhook.port}/ready", workdir=E2E_WORKDIR, **limits)
    port = free_port()
    ready = webhook.expect(sandbox_id)
    agent = subprocess.Popen(local_agent_argv(cfg, sandbox_id, target_pid, port),
                             env={**os.environ, AGENT_TOKEN_ENV: token}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        started = time.monotonic()
        address = await webhook.wait(sandbox_id, ready, 60)
        assert address == f"127.0.0.1:{port}", address
        print(f"agent ready after {time.monotonic() - started:.2f}s")
        async with AgentClient(sandbox_id, address, token, cfg) as sb:
            yield agent, sb
    finally:
        if agent.poll() is None:
            agent.kill()
        print("agent output:", agent.communicate(timeout=10)[0])
        await webhook.stop()


def with_sleeper(test: Callable[[int], Awaitable[None]]) -> None:
    """Run ``test(target_pid)`` against a fresh namespaced sleeper (bounded: 180 s), which is killed after."""
    holder, target_pid = namespaced_sleeper()
    try:
        asyncio.run(asyncio.wait_for(test(target_pid), 180))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)


@pytest.mark.slow
@pytest.mark.sandbox
def test_agent_readiness_post_and_exec_end_to_end():
    work = E2E_WORKDIR

    async def go(target_pid):
        async with ready_agent(target_pid, timeout_s=20, max_output_bytes=4096) as (agent, sb):
            assert await sb.alive()
            await sb.write_file("dir/prog.py", "import os; print(open('dir/data.txt').read().upper(), os.getpid())")
            await sb.write_file(f"{work}/dir/data.txt", b"hello")
            result = await sb.exec(["python3", "dir/prog.py"])
            word, pid = result.stdout.split()
            assert (result.exit_code, word, result.timed_out) == (0, "HELLO", False), result
            assert int(pid) < 100  # numbered in the target's PID namespace, not the host's
            assert (await sb.exec("id -u")).stdout == f"{command_uid(sb.id)}\n"  # the Pod's --uid
            result = await sb.exec("echo out; echo err >&2; exit 3")
            assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
            result = await sb.exec("head -c 100000 /dev/zero")
            assert result.truncated and len(result.stdout) == 4096
            result = await sb.exec("sleep 30", timeout=1)
            assert result.timed_out and result.exit_code is None
            await sb.exec("printf made > made.txt")
            assert await sb.read_file("made.txt") == b"made"
            with pytest.raises(SandboxFileNotFound):
                await sb.read_file("missing.txt")
            with pytest.raises(SandboxFileError):
                await sb.write_file("/etc/passwd", "x")  # refused before any request
            await sb.exec("ln -s /etc/passwd escape")
            with pytest.raises(SandboxFileError):
                await sb.read_file("escape")  # refused by the agent (400)
            await sb.reset()
            assert (await sb.exec("ls -A")).stdout == ""
            assert os.path.exists(f"/proc/{target_pid}")  # a timeout or reset never kills the sleeper
            async with AgentClient(sb.id, sb.address, "wrong-token", sb.config) as intruder:
                with pytest.raises(SandboxError):
                    await intruder.exec("true")
            agent.kill()
            agent.wait(10)
            with pytest.raises(SandboxError):
                await sb.exec("true")
            assert not await sb.alive()

    with_sleeper(go)


class ReadyAgents:
    """The backend a pool sees: it hands out one sandbox whose agent is already serving, as the ``k8s`` backend
    does once a Pod's readiness POST arrived (no cluster here to make the Pod)."""

    def __init__(self, sandbox: AgentClient):
        self.sandbox = sandbox

    async def create(self) -> AgentClient:
        return self.sandbox

    async def aclose(self) -> None:
        await self.sandbox.close()


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("victim", ["agent", "target"])
def test_an_agent_or_its_target_killed_mid_exec_masks_the_rollout(victim):
    """SIGKILL the agent (or the process whose namespaces it serves) while a rollout's command runs: the exec is
    a SandboxError, never a hang or an exit status of the model's code, the pool masks the rollout with reason
    sandbox_failed, and the command does not outlive the kill."""

    async def go(target_pid):
        async with ready_agent(target_pid, timeout_s=120) as (agent, sb):
            pool = SandboxPool(ReadyAgents(sb), health_interval_s=60)  # the exec's own error masks, not the poll

            async def rollout():
                async with pool.lease() as leased:
                    await leased.exec(["sleep", "100"])

            task, members = await sleep_in_flight(rollout(), target_pid)
            start = time.monotonic()
            os.kill(agent.pid if victim == "agent" else target_pid, signal.SIGKILL)
            try:
                with pytest.raises(RolloutMasked) as masked:
                    await task
            finally:
                await pool.close()
            assert time.monotonic() - start < 30  # not the command's 100 s
            assert masked.value.reason == SANDBOX_FAILED
            why = "unreachable" if victim == "agent" else "died while it ran"
            assert why in masked.value.detail, masked.value.detail
            assert pool.stats["failed"] == 1
            # the command dies with the agent's fork server, or with the target's pid namespace
            assert await all_gone([p for p in members if p.pid != target_pid])

    with_sleeper(go)
