"""The example configs answer what a new user asks first, without an error or a flag.

ops/config/omnigate.yaml (the production template: its secrets made as it says, its engines at scripted
vLLM-Omni and OpenAI-compatible servers, its files under the test's folder) and the Helm chart's rendered
config (one pod, as tests/ops/test_deployment_shape.py starts them) run as ``omnigate serve`` processes.
An open-domain question, a question about a picture and a speech request, streamed and not, are served
200, with no ``x-omnigate-grounding: low`` and no error frame: a request that carries no evidence gives the
grounding guard nothing to judge against, so the guard abstains and says so (``x-omnigate-grounding:
no-evidence`` where the config runs it). A request that does carry a document (a ``tool`` message) is
still judged: an answer about something else is served, one that contradicts the document is flagged.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.media import data_uri, plain_image, png
from tests.ops import test_deployment_shape
from tests.ops.test_deployment_shape import REDIS, Pod, Shape, _engines_to, _tenant_key
from tests.ops.test_helm_chart import render
from tests.stores import fresh_pg_database, redis_prefix
from tests.upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "ops" / "config"
TEMPLATE = CONFIGS / "omnigate.yaml"
PUBLIC_MODEL = "qwen3-omni-flash"
# What a model says about an open-domain question: names and a number the question does not state.
ANSWER = (
    "Paris is the capital of France. It is known for the Eiffel Tower, finished in 1889, "
    "and for the Louvre, the most visited museum in the world."
)
OPEN_DOMAIN = "What is the capital of France? Tell me about it."
PICTURE = [
    {"type": "text", "text": "What is in this picture?"},
    {"type": "image_url", "image_url": {"url": data_uri("image/png", png(plain_image(64)))}},
]


def _body(kind: str, stream: bool, model: str = PUBLIC_MODEL) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": stream, "max_tokens": 256}
    if kind == "open-domain":
        body["messages"] = [{"role": "user", "content": OPEN_DOMAIN}]
    elif kind == "image":
        body["messages"] = [{"role": "user", "content": PICTURE}]
    else:
        body["messages"] = [{"role": "user", "content": OPEN_DOMAIN}]
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"voice": "ethan", "format": "wav"}
    return body


def _served(url: str, key: str | None, body: dict[str, Any]) -> tuple[httpx.Response, str, list[dict]]:
    """The response, the answer's text (or its speech's transcript), and every streamed frame."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    if not body["stream"]:
        if r.status_code != 200:
            return r, "", []
        msg = r.json()["choices"][0]["message"]
        return r, msg.get("content") or (msg.get("audio") or {}).get("transcript") or "", []
    frames: list[dict] = []
    text = ""
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", r.text[-2000:]
    for line in lines[:-1]:
        frame = json.loads(line[len("data: ") :])
        frames.append(frame)
        for choice in frame.get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or (delta.get("audio") or {}).get("transcript") or ""
    return r, text, frames


def _assert_answered(
    url: str,
    key: str | None,
    kind: str,
    stream: bool,
    *,
    model: str = PUBLIC_MODEL,
    text_is: str | None = ANSWER,
) -> None:
    r, text, frames = _served(url, key, _body(kind, stream, model))
    assert r.status_code == 200, (kind, stream, r.status_code, r.text[-2000:])
    # Unjudged for want of evidence where the config has the guard, never flagged low.
    assert r.headers.get("x-omnigate-grounding") in (None, "no-evidence"), (kind, stream, dict(r.headers))
    assert not [f for f in frames if "error" in f], (kind, stream, frames[-3:])
    assert text.strip() == text_is if text_is is not None else text.strip(), (kind, stream, text)


KINDS = [(k, s) for k in ("open-domain", "image", "speech") for s in (False, True)]
IDS = [f"{k}-{'stream' if s else 'json'}" for k, s in KINDS]


# -- the configs of ops/config that start here ----------------------------------------------------------
class Served:
    def __init__(self, url: str, key: str | None, upstreams: dict[str, ScriptedUpstream]) -> None:
        self.url, self.key, self.upstreams = url, key, upstreams


def _start(config_path: Path, tmp: Path, bg) -> Iterator[Served]:
    """A config as written; what it leaves to the environment made here; its engines scripted."""
    text = config_path.read_text()
    config = yaml.safe_load(text)
    upstreams: dict[str, ScriptedUpstream] = {}
    for engine in config["engines"]:
        flavour = "omni" if engine["kind"] == "vllm-omni" else "vllm"
        up = ScriptedUpstream(Script(flavour=flavour, text=ANSWER, chunk_words=3), models=[engine["model"]])
        bg.run(up.start())
        upstreams[engine["name"]] = up
    _engines_to(config, upstreams)
    path = tmp / config_path.name
    path.write_text(yaml.safe_dump(config))
    admin = secrets.token_hex(32)
    env = {
        # its files in the test's folder
        "OMNIGATE_AUDIT__SQLITE_PATH": str(tmp / "audit.db"),
        "OMNIGATE_AUTH__DIRECTORY__SQLITE_PATH": str(tmp / "directory.db"),
    }
    # the secrets its comments name, made as they say
    if "OMNIGATE_ADMIN__API_KEY" in text:
        env["OMNIGATE_ADMIN__API_KEY"] = admin
    if "OMNIGATE_AUDIT__SIGNING__KEY" in text:
        env["OMNIGATE_AUDIT__SIGNING__KEY"] = secrets.token_hex(32)
    for i in range(len(config["engines"])):
        if f"OMNIGATE_ENGINES__{i}__API_KEY" in text:
            env[f"OMNIGATE_ENGINES__{i}__API_KEY"] = "sk-" + secrets.token_hex(16)
    pod = Pod(
        "gateway",
        ["serve", "--config", str(path), "--host", "0.0.0.0", "--port", "8080"],
        env,
        path,
        tmp / "gateway",
    )
    try:
        pod.wait_ready()
        key = None
        if config.get("tenants") or config.get("api_keys"):
            # The config's own key is a placeholder: a tenant on the default chain, made through /admin.
            shape = Shape(tmp, config, [], [], {}, dsn="")  # for its admin headers only
            shape.admin_key = admin
            key = _tenant_key(pod, shape, {"name": "newcomer"})
        yield Served(pod.url, key, upstreams)
    finally:
        pod.stop()
        for up in upstreams.values():
            bg.run(up.stop())


@pytest.fixture(scope="module")
def template(tmp_path_factory, bg) -> Iterator[Served]:
    """ops/config/omnigate.yaml, the production template (its grounding guard in the default chain)."""
    yield from _start(TEMPLATE, tmp_path_factory.mktemp("template"), bg)


@pytest.fixture(scope="module")
def scripted_omni(tmp_path_factory, bg) -> Iterator[Served]:
    yield from _start(CONFIGS / "scripted-omni.yaml", tmp_path_factory.mktemp("scripted-omni"), bg)


@pytest.fixture(scope="module")
def my_vllm(tmp_path_factory, bg) -> Iterator[Served]:
    yield from _start(CONFIGS / "my-vllm.yaml", tmp_path_factory.mktemp("my-vllm"), bg)


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_the_template_answers_without_an_error_or_a_flag(template, kind, stream):
    _assert_answered(template.url, template.key, kind, stream)


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_the_scripted_omni_config_answers_without_an_error_or_a_flag(scripted_omni, kind, stream):
    _assert_answered(scripted_omni.url, scripted_omni.key, kind, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_my_vllm_config_answers_an_open_domain_question_without_an_error_or_a_flag(my_vllm, stream):
    """A text model's config: the open-domain question (pictures and speech are for omni engines)."""
    _assert_answered(my_vllm.url, my_vllm.key, "open-domain", stream, model="my-model")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_template_still_flags_an_answer_that_contradicts_its_document(template, stream):
    """Evidence in the request (a retrieved document in a tool message): the guard judges; an answer about
    something else is unverifiable there and served, one that names another venue is flagged."""
    body = {
        "model": PUBLIC_MODEL,
        "stream": stream,
        "max_tokens": 256,
        "messages": [
            {"role": "user", "content": "Which city does the report name as the venue?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": "The annual report names Lyon as the venue of the 2031 meeting of the board.",
            },
        ],
    }
    r, _, frames = _served(template.url, template.key, body)
    assert r.status_code == 200, r.text[-2000:]
    assert r.headers.get("x-omnigate-grounding") is None, (dict(r.headers), frames[-2:])  # unverifiable
    wrong = "The report names Paris as the venue of the 2031 meeting of the board."
    kept = {name: up.default for name, up in template.upstreams.items()}
    try:
        for up in template.upstreams.values():
            up.default = Script(flavour=up.default.flavour, text=wrong, chunk_words=3)
        r, _, frames = _served(template.url, template.key, body)
    finally:
        for name, up in template.upstreams.items():
            up.default = kept[name]
    assert r.status_code == 200, r.text[-2000:]
    assert r.headers.get("x-omnigate-grounding") == "low", (dict(r.headers), frames[-2:])


# -- the Helm chart's config -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chart_pod(tmp_path_factory, bg) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("chart")
    objects = render({"autoscaling": {"enabled": False}, "replicaCount": 1})
    (container,) = objects[("Deployment", "omnigate")]["spec"]["template"]["spec"]["containers"]
    config = yaml.safe_load(objects[("ConfigMap", "omnigate")]["data"]["omnigate.yaml"])
    upstreams = {
        e["name"]: ScriptedUpstream(Script(flavour="omni", text=ANSWER, chunk_words=3))
        for e in config["engines"]
    }
    for up in upstreams.values():
        bg.run(up.start())
    _engines_to(config, upstreams)
    chart_secrets = {
        (name, key): base64.b64decode(value).decode()
        for (kind, name), obj in objects.items()
        if kind == "Secret"
        for key, value in obj["data"].items()
    }
    prefix = redis_prefix()
    try:
        with fresh_pg_database() as dsn:
            chart_secrets |= {
                ("omnigate-directory", "dsn"): dsn,
                ("omnigate-audit", "dsn"): dsn,
                ("omnigate-audit", "signing-key"): secrets.token_hex(32),
                ("omnigate-redis", "url"): REDIS,
            }
            mounts = {m["mountPath"]: tmp / m["name"] for m in container.get("volumeMounts", [])}
            for here in mounts.values():
                here.mkdir(parents=True, exist_ok=True)
            shape = Shape(
                tmp,
                config,
                container["args"],
                container["env"],
                chart_secrets,
                dsn=dsn,
                paths={k: v for k, v in mounts.items() if not k.startswith("/etc/omnigate")},
                extra={
                    "OMNIGATE_TRAFFIC__KEY_PREFIX": f"{prefix}:traffic",
                    "OMNIGATE_ROUTING__STATE__KEY_PREFIX": f"{prefix}:routing",
                    "OMNIGATE_RATE_LIMITS__KEY_PREFIX": f"{prefix}:rate",
                },
            )
            try:
                pod = shape.start("omnigate-0").wait_ready()
                yield Served(pod.url, _tenant_key(pod, shape), upstreams)
            finally:
                shape.stop()
    finally:
        for up in upstreams.values():
            bg.run(up.stop())


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_the_chart_s_config_answers_without_an_error_or_a_flag(chart_pod, kind, stream):
    _assert_answered(chart_pod.url, chart_pod.key, kind, stream)


# -- compose's gpu profile, as docker compose config renders it --------------------------------------------
compose = test_deployment_shape.compose  # its gateway service as a process, on this machine's stores


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_compose_s_gpu_profile_answers_without_an_error_or_a_flag(compose, kind, stream):
    shape, _, key = compose
    _assert_answered(shape.pods[-1].url, key, kind, stream, text_is=None)
