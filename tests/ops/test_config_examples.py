"""Every omnigate config the project shows passes ``omnigate check-config``, run as users run it: the YAML
blocks of docs/ that are omnigate configs and every file in ops/config/, each with only the environment
it documents (the secrets it leaves to OMNIGATE_* variables; a compose file's own service environment)."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import pytest
import yaml

from gateway.settings import Settings
from tests.harness import omnigate_command
from tests.ops.tools import run

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIGS = ROOT / "ops" / "config"
_TOP_KEYS = {f.alias or n for n, f in Settings.model_fields.items()} | set(Settings.model_fields)
_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _secret() -> str:
    return secrets.token_hex(32)  # as the docs say to make one: `openssl rand -hex 32`


def _doc_examples() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            doc = yaml.safe_load(m.group(1))
            # An omnigate config: a mapping whose keys are all the settings' own (compose, Helm values and
            # Prometheus rules are shown in YAML too).
            if isinstance(doc, dict) and doc and set(doc) <= _TOP_KEYS:
                line = text.count("\n", 0, m.start()) + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return found


def _named_secrets(text: str) -> dict[str, str]:
    """The secrets a config leaves to the environment, as its comments name them (OMNIGATE_..._KEY), each
    made as the docs say; nothing else: a placeholder typed in the file is not covered by a variable."""
    names = set(re.findall(r"OMNIGATE_[A-Z0-9_]+__(?:API_KEY|SIGNING__KEY)\b", text))
    return {n: ("sk-" + _secret() if n.startswith("OMNIGATE_ENGINES__") else _secret()) for n in names}


def _check(path: Path, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OMNIGATE_")}
    done = run([*omnigate_command(), "check-config", str(path)], env={**clean, **env}, cwd=cwd, timeout=120)
    return done.returncode, done.stdout + done.stderr


DOC_EXAMPLES = _doc_examples()


def test_the_docs_show_config_examples():
    assert len(DOC_EXAMPLES) >= 4, [name for name, _ in DOC_EXAMPLES]


@pytest.mark.parametrize(("name", "text"), DOC_EXAMPLES, ids=[n for n, _ in DOC_EXAMPLES])
def test_each_config_example_in_the_docs_passes_check_config(name, text, tmp_path):
    example = tmp_path / "omnigate.yaml"
    example.write_text(text)
    rc, out = _check(example, _named_secrets(text), tmp_path)
    assert rc == 0, f"{name}:\n{out}"


LOCAL_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("compose-"))


@pytest.mark.parametrize("config", LOCAL_CONFIGS, ids=[p.name for p in LOCAL_CONFIGS])
def test_each_config_in_ops_passes_check_config_with_the_secrets_it_names(config, tmp_path):
    env = _named_secrets(config.read_text())
    rc, out = _check(config, env, tmp_path)
    assert rc == 0, out
    if env:
        # As it stands, the file's placeholders are refused by name (it says so) rather than started.
        rc, out = _check(config, {}, tmp_path)
        assert rc == 1 and "placeholder" in out, out


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_each_compose_config_passes_check_config_in_its_services_environment(profile, tmp_path):
    from tests.ops.test_compose import compose_config

    rendered = compose_config(profile)
    [(name, gateway)] = [(n, s) for n, s in rendered["services"].items() if n.startswith("gateway")]
    config = Path(
        next(v["source"] for v in gateway["volumes"] if v["target"] == "/etc/omnigate/omnigate.yaml")
    )
    assert config.parent == CONFIGS and config.name.startswith("compose-")
    env = {k: v for k, v in gateway["environment"].items() if k.startswith("OMNIGATE_")}
    env["OMNIGATE_ADMIN__API_KEY"] = _secret()  # the env file's key, made as it says (the test's is weak)
    rc, out = _check(config, env, tmp_path)
    assert rc == 0, f"{name} ({config.name}):\n{out}"


def test_the_media_page_names_the_default_pre_chain_the_code_has():
    chain = " → ".join(p.name for p in Settings().policies.pre)
    text = " ".join((DOCS / "media.md").read_text().split())
    assert f"The default pre chain is `{chain}`" in text


def _in_step_with_the_defaults(rules: list, variants: set[str]) -> None:
    """Each shipped rule is a default rule restricted to the layout: the same signal, thresholds and pacing;
    its engines and targets only those of the layout's variants, and no offload where the engines share no
    GPU. A change to a default rule then fails here until the shipped layouts follow it."""
    from engines.rollout.rules import default_rules

    defaults = {r.name: r for r in default_rules()}
    for rule in rules:
        assert rule.name in defaults, f"{rule.name} is no default rule"
        want = defaults[rule.name]
        sel = want.select.model_dump()
        if sel["variants"]:
            sel["variants"] = [v for v in sel["variants"] if v in variants]
        assert rule.select.model_dump() == sel, rule.name
        assert rule.model_dump(exclude={"action", "select"}) == want.model_dump(
            exclude={"action", "select"}
        ), rule.name
        action = want.model_dump()["action"]
        action["to_variants"] = [v for v in action["to_variants"] if v in variants]
        got = rule.action.model_dump()
        assert got == action | {"sleep_idle": got["sleep_idle"]}, rule.name


def test_compose_s_rules_are_the_default_rules_restricted_to_its_engines():
    from engines.adapters.settings import EngineConfig
    from engines.rollout.settings import ControllerSettings

    doc = yaml.safe_load((CONFIGS / "compose-gpu.yaml").read_text())
    engines = [EngineConfig.model_validate(e) for e in doc["engines"]]
    controller = ControllerSettings.model_validate(doc["routing"]["controller"])
    _in_step_with_the_defaults(controller.rules, {e.variant for e in engines})
    # the latency rules of both kinds of answer watch the INT4 engine
    names = {r.name for r in controller.rules}
    assert {"int4-latency", "int4-latency-whole", "latency-batch", "wer-drift"} <= names, names
