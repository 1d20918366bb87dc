"""A new user's first hour, as the README and ops/config give it: `omnigate serve` processes started from
the shipped configs (only the engines' addresses substituted) against scripted engines on real sockets.

- ops/config/my-vllm.yaml ("my own vLLM at host:8000") starts as written and serves a chat completion;
- the server says "ready" once, with its URL, when it can answer, and /v1/* answers 503 with Retry-After
  before (the engines are probed after uvicorn listens);
- the README's curl line and Python block run as printed, and its next step
  (ops/config/scripted-omni.yaml, scripted vLLM-Omni servers) serves its Python speech example.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.harness import ServeProcess, free_port, omnigate_command, wait_until
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
MY_VLLM = ROOT / "ops" / "config" / "my-vllm.yaml"
SCRIPTED_OMNI = ROOT / "ops" / "config" / "scripted-omni.yaml"


def _events(log: Path, name: str) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{name}"' in line:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("event") == name:
                out.append(doc)
    return out


def _moved(config: Path, tmp_path: Path, urls: list[str]) -> Path:
    """The shipped config with its engines' base_url replaced, in order; everything else as written."""
    doc = yaml.safe_load(config.read_text())
    assert len(doc["engines"]) == len(urls)
    for engine, url in zip(doc["engines"], urls, strict=True):
        engine["base_url"] = url
    out = tmp_path / config.name
    out.write_text(yaml.safe_dump(doc))
    return out


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """The server's files (audit, directory) under the test's own folder, not the checkout's var/."""
    monkeypatch.setenv("OMNIGATE_AUDIT__SQLITE_PATH", str(tmp_path / "audit.db"))
    monkeypatch.setenv("OMNIGATE_AUTH__DIRECTORY__SQLITE_PATH", str(tmp_path / "directory.db"))
    return tmp_path


def test_my_vllm_config_is_ten_lines_and_passes_check_config_as_written():
    settings = [
        line
        for line in MY_VLLM.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(settings) <= 10, settings
    done = subprocess.run(
        [*omnigate_command(), "check-config", str(MY_VLLM)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "configuration OK" in done.stdout and "my-model" in done.stdout


def test_my_vllm_config_serves_and_says_ready_once_after_503s_while_the_engine_is_not_up(bg, isolated):
    port = free_port()
    vllm = ScriptedUpstream(Script(flavour="vllm", text="Paris is the capital of France."))
    server = ServeProcess(_moved(MY_VLLM, isolated, [f"http://127.0.0.1:{port}/v1"]), isolated / "serve.log")
    try:
        # The engine is not up (a vLLM still loading its weights): once its first probe has failed the
        # gateway says it is ready and that no engine answered, and requests get 503s that say to retry.
        assert wait_until(lambda: _events(server.log_path, "gateway_ready"), timeout=60, interval=0.1), (
            server.log_path.read_text()[-3000:]
        )
        [early] = _events(server.log_path, "gateway_ready")
        assert "no engine answered" in early["detail"]
        refused = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "my-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert refused.status_code == 503 and int(refused.headers.get("retry-after", 0)) >= 1, (
            refused.text,
            refused.headers,
        )
        assert "127.0.0.1" not in refused.text  # the engine's address is not the client's business
        assert httpx.get(server.url + "/healthz", timeout=5).status_code == 200

        bg.run(vllm.start(port=port))
        assert early["url"] == f"http://127.0.0.1:{server.port}"
        client = openai.OpenAI(base_url=early["url"] + "/v1", api_key="unused", max_retries=0)
        assert wait_until(
            lambda: any(e.get("healthy") for e in _events(server.log_path, "engine_health_changed")),
            timeout=60,
            interval=0.1,
        ), server.log_path.read_text()[-3000:]
        answer = client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "What is the capital of France?"}]
        )
        assert answer.choices[0].message.content == "Paris is the capital of France."
        assert client.models.retrieve("my-model").id == "my-model"
        assert "Uvicorn running" not in server.log_path.read_text()  # the one line is "ready"
        assert len(_events(server.log_path, "gateway_ready")) == 1
    finally:
        server.stop()
        bg.run(vllm.stop())


def _readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


def _readme_speech_example() -> str:
    [speech] = [b for b in _readme_blocks("python") if "qwen3-omni-flash" in b]
    return speech


def test_the_readmes_first_examples_run_as_printed(bg, tmp_path, capfd):
    """The curl line and the Python block for `make serve`'s embedded model, against a gateway whose engine
    answers under that model's name (tests/contract/test_local_model.py runs the real model)."""
    from prometheus_client import CollectorRegistry

    from engines.adapters.settings import DEFAULT_PUBLIC_MODEL
    from gateway.settings import Settings
    from tests.harness import GatewayServer

    vllm = ScriptedUpstream(Script(flavour="vllm", text="Paris."))
    bg.run(vllm.start())
    settings = Settings(
        engines=[
            {
                "name": "local",
                "kind": "vllm",
                "base_url": vllm.base_url,
                "model": "scripted",
                "serves": [DEFAULT_PUBLIC_MODEL],
            }
        ],
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        logging={"level": "warning"},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        [curl] = [b for b in _readme_blocks("sh") if b.startswith("curl")]
        done = subprocess.run(
            ["bash", "-c", curl.replace("http://127.0.0.1:8080", server.url)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and "Paris." in done.stdout and done.stdout.rstrip().endswith("[DONE]")
        [first] = [b for b in _readme_blocks("python") if DEFAULT_PUBLIC_MODEL in b]
        capfd.readouterr()
        exec(compile(first.replace("http://127.0.0.1:8080", server.url), "README.md", "exec"), {})
        assert "Paris." in capfd.readouterr().out
        assert vllm.request_count == 2
    finally:
        server.stop()
        bg.run(vllm.stop())


def test_the_readmes_next_step_serves_its_speech_example_without_a_gpu(bg, isolated):
    ups = [ScriptedUpstream(Script(flavour="omni")) for _ in range(2)]
    for u in ups:
        bg.run(u.start())
    config = _moved(SCRIPTED_OMNI, isolated, [u.base_url for u in ups])
    done = subprocess.run(
        [*omnigate_command(), "check-config", str(SCRIPTED_OMNI)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    server = ServeProcess(config, isolated / "serve.log")
    try:
        assert wait_until(server.ready, timeout=60, interval=0.1)
        code = _readme_speech_example().replace("http://127.0.0.1:8080", server.url)
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)  # the example as printed, nothing else
        assert namespace["transcript"] and len(namespace["speech"]) > 1000
        assert ups[0].request_count == 1 and ups[0].headers[-1]["x-request-id"]
    finally:
        server.stop()
        for u in ups:
            bg.run(u.stop())
