"""A real vLLM-Omni server as a test resource: started on an ephemeral port, stopped by PID (process group).

Stopping, killing, the log tail and reading ``/metrics`` are the real-vLLM suite's (``VllmServer``); what
differs is the command, the environment and how long the three stages take to come up.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.realomni.prepare import Prepared, server_command, server_env
from tests.realvllm.server import VllmServer, _free_port

# Three stages load, profile and warm up one after the other on two cores: 3-4 minutes on an idle machine.
READY_TIMEOUT_S = 900.0


class OmniServer(VllmServer):
    """vLLM-Omni's OpenAI server with Qwen3-Omni's thinker, talker and code2wav stages (each a process)."""

    served_name = "qwen3-omni"

    def __init__(self, prepared: Prepared, otlp_traces_endpoint: str | None = None) -> None:
        self.prepared = prepared  # type: ignore[assignment]
        self.otlp_traces_endpoint = otlp_traces_endpoint
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkdtemp(prefix="realomni-")) / "vllm-omni.log"

    def start(self) -> OmniServer:
        out = self.log.open("ab")
        # A process group of its own: the API server starts one engine process per stage, and a stop must
        # reach every one of them.
        self.proc = subprocess.Popen(
            server_command(self.prepared, self.port, self.served_name, self.otlp_traces_endpoint),
            env={**server_env(), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}, stdout=out,
            stderr=subprocess.STDOUT, cwd=self.log.parent, start_new_session=True,
        )  # fmt: skip
        out.close()
        try:
            self.wait_ready()
        except BaseException:
            self.kill()  # a server that never became ready (or an interrupted run) is not left behind
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM-Omni exited with {self.proc.returncode}:\n{self.tail(80)}")
            try:
                if httpx.get(self.root + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM-Omni was not ready within {READY_TIMEOUT_S} s:\n{self.tail(80)}")
