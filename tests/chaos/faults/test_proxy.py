"""The loopback fault proxy on real sockets: transparent forwarding, latency, resets and stalls."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_resilience import BatchRunner, EnvStepError, RunnerConfig, validate_batch_output
from gym_resilience.engines.scripted import ScriptedEngine
from gym_resilience.envs import ToolServer, ToolUseEnv
from gym_resilience.rollout_header import ROLLOUT_HEADER, RolloutIdentity, format_rollout_header
from gym_resilience.task_gen import ToolEnvFactory, generate_tasks
from harness.faults import FaultPlan, connection_fires, request_fires
from harness.faults.proxy import FaultProxy, parse_request_head
from harness.run.recorder import Recorder
from harness.scenario.spec import ConnectionTargeting, NetworkFault


def network_fault(kind: str, link: str = "tool", **when: Any) -> NetworkFault:
    return NetworkFault(
        target="network",
        kind=kind,  # type: ignore[arg-type]
        link=link,  # type: ignore[arg-type]
        latency_s=0.1,
        when=ConnectionTargeting(**when),
    )


@pytest.fixture
def tool_server() -> Iterator[ToolServer]:
    with ToolServer() as server:
        yield server


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield str(host), int(port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def proxy_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("FaultProxy")]


def test_without_faults_the_tool_env_works_through_the_proxy(tool_server: ToolServer) -> None:
    with FaultProxy(tool_server.url) as proxy:
        env = ToolUseEnv(proxy.url, target=42)
        env.reset(seed=0)
        assert env.step("6 * 7")[1:3] == (1.0, True)
        env.close()
        assert proxy.connections == 2  # GET /tools, POST /calculate: one connection per call
        assert proxy.firings == []
    assert tool_server.calls == 1


def test_bytes_flow_both_ways_on_one_connection_and_a_half_close_passes_through(
    echo_server: tuple[str, int],
) -> None:
    with FaultProxy(echo_server) as proxy, socket.create_connection(proxy.address, timeout=5) as client:
        for message in (b"ping", b"pong" * 100):
            client.sendall(message)
            received = b""
            while len(received) < len(message):
                received += client.recv(65536)
            assert received == message
        payload = bytes(range(256)) * 4096  # 1 MiB: many chunks, and backpressure

        def send_all_then_eof() -> None:
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send_all_then_eof)
        sender.start()
        echoed = bytearray()
        while chunk := client.recv(65536):
            echoed += chunk
        sender.join()
        assert echoed == payload  # and the echo server's close after our EOF reached us as an EOF


def test_latency_delays_every_chunk_in_both_directions(tool_server: ToolServer) -> None:
    with FaultProxy(tool_server.url, [(4, network_fault("latency", nth_connection=[1]))]) as proxy:
        env = ToolUseEnv(proxy.url, target=42)
        started = time.perf_counter()
        env.reset(seed=0)
        undelayed = time.perf_counter() - started
        started = time.perf_counter()
        assert env.step("6 * 7")[1:3] == (1.0, True)
        delayed = time.perf_counter() - started
        env.close()
    assert delayed >= 0.2 > undelayed  # the request one way and the response the other, 0.1 s each
    assert [(f.fault, f.kind, f.detail) for f in proxy.firings] == [
        (4, "latency", "tool connection 1: latency 0.1 s")
    ]


def test_reset_peer_makes_the_tool_env_step_raise_connection_reset_error(
    tool_server: ToolServer, tmp_path: Path
) -> None:
    fault = network_fault("reset_peer", nth_connection=[1])
    recorder = Recorder(tmp_path)
    plan = FaultPlan([fault], seed=0, events=recorder)
    with FaultProxy(tool_server.url, plan.network_faults("tool"), plan) as proxy:
        env = ToolUseEnv(proxy.url, target=42)
        env.reset(seed=0)
        with pytest.raises(ConnectionResetError):
            env.step("6 * 7")
        env.close()
    assert tool_server.calls == 0  # reset mid-request: the request never reached the tool
    [firing] = recorder.firings()
    assert (firing.fault, firing.kind, firing.target, firing.rollout, firing.detail) == (
        0,
        "reset_peer",
        "network",
        None,
        "tool connection 1: reset",
    )
    assert firing.at_s >= 0


async def test_a_reset_tool_call_becomes_a_placeholder_with_skip_failed_rollouts(
    tool_server: ToolServer,
) -> None:
    tasks = generate_tasks(2, seed=0, env="tool_use", max_turns=1)
    # One rollout at a time, so the connections come in a fixed order: reset, step, reset, step.
    config = RunnerConfig(skip_failed_rollouts=True, max_concurrency=1)
    with FaultProxy(tool_server.url, [(0, network_fault("reset_peer", nth_connection=[3]))]) as proxy:
        result = await BatchRunner(ScriptedEngine(), ToolEnvFactory(proxy.url), config).generate(tasks)
    [failure] = result.failures
    assert (failure.rollout_index, failure.phase, failure.turn) == (1, "step", 0)
    assert isinstance(failure.exception, EnvStepError)
    assert isinstance(failure.exception.__cause__, ConnectionResetError)
    assert result.output.is_placeholder == [False, True]
    validate_batch_output(result.output, num_prompts=2)


def test_timeout_makes_the_clients_own_timeout_fire(tool_server: ToolServer) -> None:
    with FaultProxy(tool_server.url, [(0, network_fault("timeout", nth_connection=[1]))]) as proxy:
        env = ToolUseEnv(proxy.url, target=42, timeout=0.2)
        env.reset(seed=0)
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            env.step("6 * 7")
        assert 0.2 <= time.perf_counter() - started < 2.0
        env.close()
    assert tool_server.calls == 0


def test_stop_ends_open_connections_and_leaves_no_thread(echo_server: tuple[str, int]) -> None:
    proxy = FaultProxy(echo_server, [(0, network_fault("timeout"))]).start()
    assert proxy.thread is not None and proxy.thread.is_alive()
    with socket.create_connection(proxy.address, timeout=5) as client:
        client.sendall(b"anyone there?")
        time.sleep(0.05)
        proxy.stop()
        assert client.recv(100) == b""  # closed by the proxy, not left hanging
    assert not proxy.thread.is_alive()
    assert proxy_threads() == []
    proxy.stop()  # idempotent


def test_a_refused_upstream_resets_the_client() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    with FaultProxy(("127.0.0.1", port)) as proxy:
        # The reset may land before connect() returns (it then reports it), or while sending or reading.
        with (
            pytest.raises((ConnectionResetError, BrokenPipeError)),
            socket.create_connection(proxy.address, timeout=5) as client,
        ):
            client.sendall(b"GET / HTTP/1.0\r\n\r\n")
            client.recv(100)
        assert proxy.connections == 1


def test_the_first_fault_whose_targeting_picks_a_connection_applies_alone(
    echo_server: tuple[str, int],
) -> None:
    faults = [(3, network_fault("latency", nth_connection=[0, 1])), (5, network_fault("reset_peer"))]
    with FaultProxy(echo_server, faults) as proxy:
        for _ in range(3):
            with socket.create_connection(proxy.address, timeout=5) as client:
                client.sendall(b"x")
                with contextlib.suppress(ConnectionResetError):
                    client.recv(10)
    assert [(f.fault, f.detail) for f in proxy.firings] == [
        (3, "tool connection 0: latency 0.1 s"),
        (3, "tool connection 1: latency 0.1 s"),
        (5, "tool connection 2: reset"),
    ]
    assert proxy.connections == 3


def test_connection_probability_replays_with_the_seed_and_changes_with_another() -> None:
    when = ConnectionTargeting(nth_connection=list(range(200)), probability=0.5)

    def decisions(seed: int) -> list[bool]:
        return [connection_fires(when, seed=seed, fault_index=2, connection=n) for n in range(200)]

    assert decisions(3) == decisions(3)
    assert decisions(3) != decisions(4)
    assert 60 < sum(decisions(3)) < 140
    only = ConnectionTargeting(nth_connection=[1], probability=1.0)
    assert [connection_fires(only, seed=0, fault_index=0, connection=n) for n in range(3)] == [
        False,
        True,
        False,
    ]


def test_request_probability_is_keyed_by_rollout_attempt_and_turn_not_by_order() -> None:
    when = ConnectionTargeting(probability=0.5)
    identities = [RolloutIdentity(rollout, 0, turn) for rollout in range(50) for turn in range(4)]

    def decisions(seed: int, order: list[RolloutIdentity]) -> dict[RolloutIdentity, bool]:
        return {i: request_fires(when, seed=seed, fault_index=2, identity=i) for i in order}

    assert decisions(3, identities) == decisions(3, identities[::-1])
    assert decisions(3, identities) != decisions(4, identities)
    assert 60 < sum(decisions(3, identities).values()) < 140
    # A request that names no rollout is never drawn for: which such requests come is timing.
    assert not request_fires(when, seed=3, fault_index=2, identity=None)


@pytest.mark.parametrize(
    ("when", "hit"),
    [
        ({}, [True, True, True, True]),
        ({"rollouts": [1]}, [False, True, False, False]),
        ({"turns": [0]}, [True, False, False, False]),
        ({"rollouts": [1], "attempts": [1]}, [False, False, False, False]),
        ({"nth_connection": [0]}, [False, False, False, False]),
    ],
)
def test_request_targeting_matches_the_rollout_header_and_a_request_without_one_only_when_untargeted(
    when: dict[str, Any], hit: list[bool]
) -> None:
    targeting = ConnectionTargeting(**when)
    requests = [RolloutIdentity(0, 0, 0), RolloutIdentity(1, 0, None), RolloutIdentity(2, 0, 1), None]
    fires = [request_fires(targeting, seed=0, fault_index=0, identity=r) for r in requests]
    assert fires == [*hit[:3], not targeting.by_request_identity and "nth_connection" not in when]


def test_nth_connection_cannot_be_combined_with_rollout_filters() -> None:
    with pytest.raises(ValueError, match="nth_connection counts connections"):
        ConnectionTargeting(nth_connection=[0], rollouts=[1])


def test_a_request_head_is_parsed_for_framing_and_rollout_and_anything_else_is_not_a_request() -> None:
    head = (
        b"POST /calculate HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n"
        b"X-Gym-Resilience-Rollout: rollout=3; attempt=1; turn=2\r\n\r\n"
    )
    request = parse_request_head(head)
    assert request is not None
    assert (request.method, request.path, request.content_length, request.chunked) == (
        "POST",
        "/calculate",
        12,
        False,
    )
    assert request.identity == RolloutIdentity(3, 1, 2)
    assert parse_request_head(b"GET /health HTTP/1.1\r\n\r\n").identity is None  # type: ignore[union-attr]
    assert parse_request_head(b"\x16\x03\x01 tls hello\r\n\r\n") is None
    assert parse_request_head(b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n") is None


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the connection open between requests

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_faults_hit_the_targeted_rollouts_requests_on_a_keep_alive_connection() -> None:
    """Three requests share one connection; only the one that names rollout 1, turn 0 is reset."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    fault = network_fault("reset_peer", rollouts=[1], turns=[0])
    try:
        with FaultProxy(("127.0.0.1", server.server_address[1]), [(7, fault)]) as proxy:
            connection = http.client.HTTPConnection(*proxy.address, timeout=5)
            answers = []
            for rollout, turn in ((0, 0), (1, 1), (1, 0)):
                header = format_rollout_header(RolloutIdentity(rollout, 0, turn))
                body = f"rollout {rollout} turn {turn}".encode()
                try:
                    connection.request("POST", "/echo", body=body, headers={ROLLOUT_HEADER: header})
                    answers.append(connection.getresponse().read())
                except ConnectionResetError:
                    answers.append(b"reset")
            connection.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert answers == [b"rollout 0 turn 0", b"rollout 1 turn 1", b"reset"]
    assert proxy.connections == 1
    assert [(f.fault, f.rollout, f.attempt, f.turn, f.detail) for f in proxy.firings] == [
        (7, 1, 0, 0, "tool POST /echo: reset")
    ]


def test_the_tool_env_names_its_rollout_so_a_network_fault_hits_the_same_step_every_time(
    tool_server: ToolServer,
) -> None:
    fault = network_fault("reset_peer", rollouts=[2], turns=[1])
    with FaultProxy(tool_server.url, [(0, fault)]) as proxy:
        outcomes = []
        for rollout in range(4):
            env = ToolUseEnv(proxy.url, target=1000)
            env.reset(seed=0, options={"rollout_index": rollout, "attempt": 0})
            steps = []
            for _ in range(2):
                try:
                    env.step("1 + 1")
                    steps.append("ok")
                except ConnectionError:
                    steps.append("reset")
            outcomes.append(steps)
            env.close()
    assert outcomes == [["ok", "ok"], ["ok", "ok"], ["ok", "reset"], ["ok", "ok"]]
    assert [(f.rollout, f.attempt, f.turn) for f in proxy.firings] == [(2, 0, 1)]


@pytest.mark.parametrize(
    "upstream", ["http://10.0.0.1:8000", ("example.com", 80), "http://127.0.0.1/no-port", "not a url"]
)
def test_only_a_loopback_upstream_with_a_port_is_accepted(upstream: Any) -> None:
    with pytest.raises(ValueError, match="the upstream must be a loopback host with a port"):
        FaultProxy(upstream)


def test_the_url_keeps_the_upstreams_scheme_and_path() -> None:
    with FaultProxy("http://localhost:9/v1") as proxy:
        host, port = proxy.address
        assert proxy.url == f"http://{host}:{port}/v1"


def test_a_proxy_starts_once() -> None:
    proxy = FaultProxy(("127.0.0.1", 9)).start()
    proxy.stop()
    with pytest.raises(RuntimeError, match=r"^a fault proxy starts once; this one is stopped$"):
        proxy.start()
