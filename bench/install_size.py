"""The base install's size and the gateway's cold start, against the install with the model extras.

    python -m bench.install_size [--runs 5] [--out FILE]   # build both venvs, measure, print JSON
    python -m bench.install_size --closure [--extra guards]  # the locked packages of a set, one a line
    python -m bench.install_size --smoke                     # no venv built: this venv's cold start once

A set is pyproject.toml's ``[project] dependencies`` (the base) plus the named extras, closed over
what they pull as requirements/lock.txt's ``# via`` comments say (a package is in when one of the
packages it is pulled by is). The full set for comparison is base + ``guards`` + ``local`` (what
loads local models), with the weights of requirements/models.txt; the ``test`` tools are in neither.

Each set is installed into a fresh venv in a temporary folder: its hashed lock lines with
``--require-hashes --no-deps``, then omnigate itself (not editable, built from a copy of the
sources). Size: ``du -sk`` of the venv's site-packages. Cold start: ``omnigate serve`` of that venv
against a scripted vLLM (tests/upstream.py) with the default chain (load shedding, request limits,
media fetch, media limits, the NSFW screen on onnxruntime) and the SQLite audit on: seconds from
the process start to its ``gateway_ready`` log line, and to the first answered chat completion
(polled every 20 ms from the start), and the process's RSS then. The first run warms the page
cache, so the figures are medians of the runs after it: a cold process, a warm disk. Both venvs
are built first and then started in turn (base, full, base, ...), so the machine's load falls on both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.common import add_smoke, emit, free_port, out_path, smoke_result

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
MODELS = ROOT / "requirements" / "models.txt"
PYPROJECT = ROOT / "pyproject.toml"
#: what loads local models: the guard models and the embedded engine
MODEL_EXTRAS = ("guards", "local")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """``uvicorn[standard]==0.54.0`` -> ``uvicorn``."""
    m = _NAME.match(spec.strip())
    if m is None:
        raise ValueError(f"not a requirement: {spec!r}")
    return normalise(m.group(1))


@dataclass(frozen=True, slots=True)
class Locked:
    name: str
    #: the pin with its hashes, as the lock writes it
    text: str
    #: the packages it is pulled by (``omnigate`` for a direct dependency of any set)
    via: frozenset[str]


def read_lock(path: Path = LOCK) -> dict[str, Locked]:
    """The lock's packages by name, each with its hashed lines and its ``# via`` parents."""
    out: dict[str, Locked] = {}
    block: list[str] = []

    def close() -> None:
        if not block:
            return
        pin = [line for line in block if not line.lstrip().startswith("#")]
        via: set[str] = set()
        in_via = False
        for line in block:
            s = line.strip()
            if s.startswith("# via"):
                in_via = True
                rest = s[len("# via") :].strip()
                if rest:
                    via.add(requirement_name(rest))
            elif in_via and s.startswith("#   "):
                via.add(requirement_name(s[1:].strip()))
            elif in_via and s.startswith("#"):
                continue
        name = requirement_name(pin[0])
        out[name] = Locked(name, "\n".join(pin).rstrip(" \\") + "\n", frozenset(via))
        block.clear()

    for line in path.read_text().splitlines():
        if not line.strip() or (line.startswith("#") and not block):
            continue  # the header, blank lines
        if not line.startswith((" ", "#")):
            close()
        block.append(line)
    close()
    return out


def direct(extras: tuple[str, ...] = (), path: Path = PYPROJECT) -> set[str]:
    """The names pyproject.toml lists for the base and ``extras``."""
    project = tomllib.loads(path.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    return {requirement_name(s) for s in specs}


def closure(extras: tuple[str, ...] = (), lock: dict[str, Locked] | None = None) -> set[str]:
    """The locked packages the base and ``extras`` pull, by the lock's ``# via`` comments."""
    lock = read_lock() if lock is None else lock
    have = direct(extras)
    unknown = have - lock.keys()
    if unknown:
        raise ValueError(f"pyproject.toml names packages the lock does not pin: {sorted(unknown)}")
    grew = True
    while grew:
        grew = False
        for pkg in lock.values():
            if pkg.name not in have and pkg.via & have:
                have.add(pkg.name)
                grew = True
    return have


# --- measuring ------------------------------------------------------------------------------------


def _run(cmd: list[str], **kw: object) -> None:
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def build_venv(where: Path, extras: tuple[str, ...], with_models: bool) -> tuple[Path, float]:
    """A fresh venv with the set installed from the lock; (its site-packages, seconds it took)."""
    t0 = time.monotonic()
    lock = read_lock()
    req = where / "requirements.txt"
    req.write_text("".join(lock[n].text for n in sorted(closure(extras, lock))))
    venv = where / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, "--require-hashes", "--no-deps", "-r", str(req)])
    if with_models:
        _run([*pip, "--require-hashes", "--no-deps", "-r", str(MODELS)])
    src = where / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ("core", "gateway", "policies", "engines", "observability"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    _run([*pip, "--no-deps", str(src)])
    [site] = (venv / "lib").glob("python3*/site-packages")
    return site, time.monotonic() - t0


def du_mib(path: Path) -> float:
    out = subprocess.run(["du", "-sk", str(path)], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0]) / 1024


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cold_start(venv: Path, upstream_url: str, work: Path) -> dict[str, float]:
    """One ``omnigate serve`` of ``venv``: seconds to gateway_ready and to the first answer, and RSS."""
    import httpx

    port = free_port()
    config = work / "gateway.yaml"
    config.write_text(
        "engines:\n"
        "  - name: scripted\n"
        "    kind: vllm\n"
        f"    base_url: {upstream_url}\n"
        "    model: scripted\n"
        "    serves: [bench-model]\n"
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMNIGATE_AUDIT__SQLITE_PATH": str(work / "audit.db"),
        "OMNIGATE_AUTH__DIRECTORY__SQLITE_PATH": str(work / "directory.db"),
    }
    for stale in ("audit.db", "directory.db"):
        for f in work.glob(stale + "*"):
            f.unlink()
    t0, wall0 = time.monotonic(), time.time()
    proc = subprocess.Popen(
        [str(venv / "bin" / "omnigate"), "serve", "--config", str(config), "--port", str(port)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    ready: list[float] = []
    log: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            log.append(line)
            if not ready and '"gateway_ready"' in line:
                # The line's own time, not when this thread read it (which may come after the first answer).
                ready.append(_logged_at(line, wall0) or time.monotonic() - t0)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    body = {"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]}
    answered = float("nan")
    try:
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - t0 < 300:
                if proc.poll() is not None:
                    raise RuntimeError("the gateway exited:\n" + "".join(log[-40:]))
                try:
                    r = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                    if r.status_code == 200:
                        answered = time.monotonic() - t0
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
        rss = _rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(5)
    if not ready or answered != answered:
        raise RuntimeError("no gateway_ready line or no answer:\n" + "".join(log[-40:]))
    return {"ready_s": ready[0], "first_answer_s": answered, "rss_mib": rss}


def _summary(starts: list[dict[str, float]]) -> dict[str, object]:
    warm = starts[1:] or starts
    return {
        "ready_s_median": round(statistics.median(s["ready_s"] for s in warm), 3),
        "first_answer_s_median": round(statistics.median(s["first_answer_s"] for s in warm), 3),
        "rss_mib_median": round(statistics.median(s["rss_mib"] for s in warm), 1),
        "first_run": {k: round(v, 3) for k, v in starts[0].items()},
        "all_runs": [{k: round(v, 3) for k, v in s.items()} for s in starts],
    }


def _sets() -> dict[str, dict[str, object]]:
    lock = read_lock()
    out: dict[str, dict[str, object]] = {}
    for label, extras in (("base", ()), ("full", MODEL_EXTRAS)):
        names = closure(extras, lock)
        out[label] = {"extras": list(extras), "packages": len(names), "has_torch": "torch" in names}
    return out


def _logged_at(line: str, wall0: float) -> float | None:
    """Seconds from ``wall0`` (the process's start, wall clock) to a JSON log line's own timestamp."""
    try:
        stamp = json.loads(line).get("timestamp")
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - wall0 if stamp else None
    except (ValueError, AttributeError):
        return None


def measure(runs: int, smoke: bool = False) -> dict[str, object]:
    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.upstream", "--flavour", "vllm", "--port", str(up_port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    upstream_url = f"http://127.0.0.1:{up_port}/v1"
    result: dict[str, object] = {"runs": runs, "python": sys.version.split()[0], **_sets()}
    try:
        if smoke:  # this venv (the whole lock, editable), once: shows the measuring still works
            with tempfile.TemporaryDirectory(prefix="omnigate-install-smoke-") as tmp:
                result["current"] = _summary([cold_start(Path(sys.prefix), upstream_url, Path(tmp))])
            return result
        with contextlib.ExitStack() as stack:
            venvs: dict[str, tuple[Path, Path]] = {}
            for label, extras, models in (("base", (), False), ("full", MODEL_EXTRAS, True)):
                where = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"omnigate-{label}-")))
                site, build_s = build_venv(where, extras, models)
                venvs[label] = (site, where)
                entry = result[label]
                assert isinstance(entry, dict)
                entry["site_packages_mib"] = round(du_mib(site), 1)
                entry["install_s"] = round(build_s, 1)
            # Alternating, base then full, so that a change in the machine's load falls on both.
            starts: dict[str, list[dict[str, float]]] = {label: [] for label in venvs}
            for _ in range(runs):
                for label, (site, where) in venvs.items():
                    starts[label].append(cold_start(site.parents[2], upstream_url, where))
            for label, runs_of in starts.items():
                entry = result[label]
                assert isinstance(entry, dict)
                entry.update(_summary(runs_of))
    finally:
        upstream.terminate()
        upstream.wait(10)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.install_size", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="cold starts per install (the first warms the disk)")
    ap.add_argument("--closure", action="store_true", help="print the locked packages of the set and stop")
    ap.add_argument("--extra", action="append", default=[], help="with --closure: an extra of the set")
    add_smoke(ap)
    args = ap.parse_args(argv)
    if args.closure:
        print("\n".join(sorted(closure(tuple(args.extra)))))
        return 0
    result = measure(1 if args.smoke else args.runs, smoke=args.smoke)
    not_measured = {"both installs": "smoke: no venv is built (minutes each); this venv is started once"}
    emit(smoke_result(result, args, not_measured), out_path(args, "install_size"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
