"""A real vLLM OpenAI server as a test resource: started on an ephemeral port, stopped (and restarted) by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.realvllm.prepare import Prepared, server_command, server_env

# vLLM on two CPU cores loads SmolLM2 and warms up in 2-3 minutes; give it room on a loaded machine.
READY_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, prepared: Prepared, otlp_traces_endpoint: str | None = None) -> None:
        self.prepared = prepared
        #: an OTLP/HTTP endpoint vLLM exports its own spans to (``--otlp-traces-endpoint``)
        self.otlp_traces_endpoint = otlp_traces_endpoint
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkdtemp(prefix="realvllm-")) / "vllm.log"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def start(self) -> VllmServer:
        out = self.log.open("ab")
        # A process group of its own: vLLM forks its engine core, and a stop must reach both.
        command, env = server_command(self.prepared, self.port), server_env()
        if self.otlp_traces_endpoint is not None:
            command += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
            # vLLM exports over gRPC unless told otherwise; spans leave within 100 ms, not the SDK's 5 s.
            env |= {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.log.parent,
            start_new_session=True,
        )
        out.close()
        try:
            self.wait_ready()
        except BaseException:
            self.kill()  # a server that never became ready (or an interrupted run) is not left behind
            raise
        return self

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.root + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM was not ready within {READY_TIMEOUT_S} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server and its engine process, as a crash would."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        self.proc = None

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a series of vLLM's /metrics over the label sets matching ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.root + "/metrics", timeout=5).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total
