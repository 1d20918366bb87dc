"""Issue 25: a decoder that runs the attacker's code is confined to the part it was handed.

A decoder parses hostile bytes with C libraries; assume one falls. The attacker's code then runs in
a real decoding worker, with the real confinement (policies/media/worker.py), and tries what the
issue found open: the gateway's environment and memory through ``/proc``, another request's spool
file by name in ``/dev/shm``, the audit database (opened and mapped shared), any other path, a
network socket, ``execve``, a new process, ``ptrace``, and writing the part it was handed, and it
searches its own memory for the gateway's keys. The same code run unconfined shows each step works
there first.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core import spooled
from core.errors import GuardUnavailable
from policies.media import sandbox as sandbox_module
from policies.media.sandbox import Sandbox, Unconfined, missing_confinement
from policies.media.shared import SharedBytes
from policies.settings import MediaSettings
from tests import hostile_decoders as bad

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
STEPS = (
    "environ",
    "mem",
    "spool_by_name",
    "audit_open",
    "audit_mmap",
    "other_path",
    "network",
    "execve",
    "fork",
    "ptrace",
    "handed_file",
)


@pytest.fixture
def targets(tmp_path):
    """What an escaped decoder would go for: a screened spool file, the audit database, a config file."""
    writer = spooled.SpoolWriter()
    writer.write(b"SCREENED" * 4096)
    spool = writer.finish("data:image/png;base64,", 43692)
    db = tmp_path / "audit.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE records (seq INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO records (body) VALUES ('the record as written')")
    conn.close()
    other = tmp_path / "gateway.yaml"
    other.write_text("admin:\n  key: not-for-decoders\n")
    yield spool, db, other
    spool.release()


def _run(coro):
    return asyncio.run(coro)


def _sandbox(**kw) -> Sandbox:
    cfg = {"decode_workers": 1, "decode_deadline_s": 20, "decode_cpu_s": 20, "decode_memory_mb": 512, **kw}
    return Sandbox(MediaSettings(**cfg))


def test_the_escape_works_from_an_unconfined_process(targets):
    """The attack first: the same code, run as a plain process of the gateway's user, does every step."""
    spool, db, other = targets
    code = textwrap.dedent(
        f"""
        import json
        from tests.hostile_decoders import escapes
        print(json.dumps(escapes({os.getpid()}, {spool.name!r}, {str(db)!r}, {str(other)!r})))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout)
    opened_by_name = [s for s in STEPS if s != "handed_file"]  # (it was handed nothing)
    assert {step: seen[step] for step in opened_by_name} == dict.fromkeys(opened_by_name, "allowed")
    # (it wrote, so put the targets back as the gateway had them)
    with open(f"/dev/shm/{spool.name}", "r+b") as f:
        f.write(b"SCREENED")


@pytest.mark.parametrize("filesystem", ["mount-namespace", "landlock"])
def test_hostile_code_in_a_worker_is_denied_every_step(targets, filesystem):
    spool, db, other = targets
    before_db = db.read_bytes()

    async def go():
        box = _sandbox(decode_filesystem=filesystem)
        await box.start()
        try:
            handed = SharedBytes(spool.name, spool.size)  # the worker's own part, by descriptor
            seen = await box.run(
                bad.escapes, (os.getpid(), spool.name, str(db), str(other), handed), param="p"
            )
            return box.confinement, seen
        finally:
            await box.aclose()

    confinement, seen = _run(go())
    assert confinement is not None
    assert confinement["filesystem"] == filesystem
    assert confinement["syscalls"] == "allow-list"
    assert confinement["environment"] == "scrubbed"
    denied = {step: seen[step] for step in STEPS}
    assert "allowed" not in denied.values(), denied
    # what the seccomp allow-list refuses, whatever the filesystem view
    for step in ("network", "execve", "fork", "ptrace"):
        assert denied[step] == "EPERM", (step, denied[step])
    assert seen["environment"] == "empty"  # none of the gateway's variables reached the worker
    assert spool.read() == b"SCREENED" * 4096
    assert db.read_bytes() == before_db


#: a gateway's keys as its environment carries them: sizes that land in each of the allocators
#: (the interpreter's small-object arenas, the C library's heap), every one under a page
_SECRET_SIZES = {
    "OMNIGATE_ADMIN__API_KEY": 64,
    "OMNIGATE_TENANT_SENTINEL_KEY": 200,
    "OMNIGATE_TENANTS_SENTINEL_KEYS": 400,
    "OMNIGATE_AUDIT_SENTINEL_SIGNING_KEY": 600,
    "OMNIGATE_ENGINE_SENTINEL_TOKEN": 1500,
}

_SECRETS_IN_A_WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from policies.settings import MediaSettings
    from policies.media.sandbox import Sandbox
    from tests import hostile_decoders as bad

    names = sys.argv[1].split(",")
    halves = [(os.environ[n][:8], os.environ[n][8:]) for n in names]  # never whole in the worker's args

    def environment(pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            return sorted(e.partition(b"=")[0].decode() for e in f.read().split(b"\\0") if e)

    async def go():
        box = Sandbox(MediaSettings(decode_workers=1, decode_deadline_s=60, decode_cpu_s=60))
        await box.start()
        try:
            seen = await box.run(bad.finds_secrets, (halves,), param="p")
            # what the gateway's own processes below it (the forkserver, its resource tracker) started with
            below = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
            children = {}
            for pid in below:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                            children[pid] = environment(pid)
                except OSError:
                    pass
            return box.confinement, seen, sorted(children.values())
        finally:
            await box.aclose()

    print(json.dumps(asyncio.run(go())))
    """
)


def test_a_worker_holds_none_of_the_gateway_s_keys_in_its_memory():
    """The gateway's keys are in its environment; a decoder that runs the attacker's code searches its
    own memory for them (its environment block, the interpreter's and the C library's heaps, without
    ``/proc``). Clearing the worker's environment leaves copies in memory it inherited from a forkserver
    that started with all of the gateway's; the forkserver must start without them."""
    secrets = {name: os.urandom(size).hex()[:size] for name, size in _SECRET_SIZES.items()}
    env = {**os.environ, **secrets}
    names = ",".join(secrets)
    halves = [(v[:8], v[8:]) for v in secrets.values()]

    # the search first, in a plain process that started with the keys: it finds every one
    code = f"import json; from tests.hostile_decoders import finds_secrets as f; print(json.dumps(f({halves!r})))"
    plain = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 0, plain.stderr
    unconfined = json.loads(plain.stdout)
    everyone = list(range(len(secrets)))
    assert unconfined["proc_environ"] == everyone
    assert unconfined["environ"] == everyone
    assert unconfined["memory"]["stack"] == everyone  # found by walking its memory, without /proc

    # then as a gateway whose worker runs the same search
    out = subprocess.run(
        [sys.executable, "-c", _SECRETS_IN_A_WORKER, names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    confinement, seen, below = json.loads(out.stdout.splitlines()[-1])  # (after the start-up log)
    assert confinement["environment"] == "scrubbed"
    assert seen["pages"] > 1000  # it did read its memory
    assert seen["environ"] == []
    assert seen["proc_environ"] in ("FileNotFoundError", "PermissionError", [])
    assert seen["memory"] == {}, {list(secrets)[i] for hits in seen["memory"].values() for i in hits}
    # the processes the gateway started for its workers started without its keys
    assert below
    for names_seen in below:
        assert not set(names_seen) & set(secrets), names_seen


def test_workers_of_a_forkserver_started_with_the_gateway_s_environment_are_unconfined():
    """A forkserver something else started first (multiprocessing's own way, with every variable) is
    not replaced: its workers say so, and the gateway refuses to start on them."""
    code = textwrap.dedent(
        """
        import asyncio, multiprocessing.forkserver
        from policies.settings import MediaSettings
        from policies.media.sandbox import Sandbox, Unconfined
        multiprocessing.forkserver.ensure_running()
        async def go():
            box = Sandbox(MediaSettings(decode_workers=1))
            try:
                await box.start()
            except Unconfined as exc:
                print("refused:", exc)
            finally:
                await box.aclose()
        asyncio.run(go())
        """
    )
    env = {**os.environ, "OMNIGATE_ADMIN__API_KEY": os.urandom(32).hex()}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110
    )
    assert out.returncode == 0, out.stderr
    assert "refused: the decoding workers could not be confined (environment)" in out.stdout


def test_a_worker_reads_the_part_it_was_handed_and_writes_only_its_output(tmp_path):
    """The descriptors that replace names: an argument read-only, a reserved output writable."""
    from policies.media.shared import SharedOut, write_out

    writer = spooled.SpoolWriter()
    writer.write(b"abc" * 1000)
    part = writer.finish("", 4000)
    out = spooled.SpoolWriter()
    out.reserve(64)

    async def go():
        box = _sandbox()
        await box.start()
        try:
            n = await box.run(len, (SharedBytes(part.name, part.size),), param="p")
            wrote = await box.run(write_out, (SharedOut(out.name, out.reserved), b"decoded"), param="p")
            return n, wrote
        finally:
            await box.aclose()

    try:
        n, wrote = _run(go())
        assert n == 3000
        assert wrote is True
        out.wrote(7)
        assert out.read_back() == b"decoded"
    finally:
        part.release()
        out.discard()


def test_missing_confinement_names_what_a_worker_lacks():
    full = {"filesystem": "landlock", "syscalls": "allow-list", "environment": "scrubbed"}
    assert missing_confinement([full]) == []
    assert missing_confinement([{**full, "filesystem": "none"}, {**full, "syscalls": "none"}]) == [
        "filesystem view",
        "seccomp allow-list",
    ]


@pytest.mark.parametrize("mode", ["require", "warn"])
def test_a_kernel_that_refuses_the_confinement_stops_the_start_or_is_logged(monkeypatch, mode):
    """Where the kernel refuses part of it, the gateway refuses to start (or, set to warn, says so)."""
    monkeypatch.setattr(sandbox_module, "missing_confinement", lambda seen: ["filesystem view"])

    async def go():
        box = _sandbox(decode_confinement=mode)
        try:
            await box.start()
            return box.confinement
        finally:
            await box.aclose()

    if mode == "require":
        with pytest.raises(Unconfined, match="filesystem view"):
            _run(go())
    else:
        assert _run(go()) is not None


@pytest.mark.parametrize("mode", ["require", "warn"])
def test_a_lazy_sandbox_checks_the_confinement_before_its_first_task(monkeypatch, mode):
    """Without media-limits in a chain the workers start with the first part: checked the same way,
    and a part is never decoded unconfined where the confinement is required (a 503, not a decode)."""
    monkeypatch.setattr(sandbox_module, "missing_confinement", lambda seen: ["seccomp allow-list"])

    async def go():
        box = _sandbox(decode_confinement=mode)
        try:
            return await box.run(len, (b"part",), param="p")
        finally:
            await box.aclose()

    if mode == "require":
        with pytest.raises(GuardUnavailable) as err:
            _run(go())
        assert err.value.status == 503
        assert "seccomp" not in err.value.message  # the reason is logged, not told
    else:
        assert _run(go()) == 4


_DUMPABLE = textwrap.dedent(
    """
    import ctypes, os, sys, time
    from policies.media.sandbox import not_dumpable
    libc = ctypes.CDLL(None, use_errno=True)
    harden = sys.argv[1] == "harden"
    r, w = os.pipe()
    gateway = os.fork()
    if gateway == 0:
        os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
        libc.prctl(4, 1, 0, 0, 0)  # a change of uid clears it: as an ordinary process of this user
        if harden:
            assert not_dumpable()
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0)
    os.read(r, 1)
    reader = os.fork()
    if reader == 0:
        os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
        try:
            open(f"/proc/{gateway}/environ", "rb").read()
            os._exit(0)
        except PermissionError:
            os._exit(13)
    _, status = os.waitpid(reader, 0)
    os.kill(gateway, 9)
    os.waitpid(gateway, 0)
    print(os.waitstatus_to_exitcode(status))
    """
)


def test_the_gateway_is_not_dumpable_so_its_environment_is_not_readable_by_its_user():
    """Another process of the gateway's user reads its environment (the admin key) unless it is made
    non-dumpable, as the media runtime does at start."""

    def reader_exit(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _DUMPABLE, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip())

    assert reader_exit("plain") == 0  # the attack first: read
    assert reader_exit("harden") == 13  # PermissionError

    code = textwrap.dedent(
        """
        import asyncio, ctypes
        from policies.settings import MediaSettings
        from policies.media.sandbox import MediaRuntime
        asyncio.run(MediaRuntime(MediaSettings()).start())
        print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out.stderr


def test_readyz_tells_the_admin_what_confinement_the_workers_have(bg, upstreams, tmp_path):
    import httpx
    from prometheus_client import CollectorRegistry

    from tests.conftest import gateway_settings
    from tests.harness import GatewayServer
    from tests.stores import redis_prefix

    key = os.urandom(32).hex()
    settings = gateway_settings(
        upstreams,
        admin={"api_key": key},
        audit={"sqlite_path": str(tmp_path / "audit.db")},
        rate_limits={"key_prefix": redis_prefix()},
        # a chain that names media-limits starts the workers with the gateway
        policies={"pre": [{"name": "request-limits"}, {"name": "media-fetch"}, {"name": "media-limits"}]},
    )
    server = GatewayServer(bg, settings, CollectorRegistry()).start()
    try:
        anonymous = httpx.get(server.url + "/readyz", timeout=5).json()
        assert "media_sandbox" not in anonymous
        detail = httpx.get(
            server.url + "/readyz", headers={"authorization": f"Bearer {key}"}, timeout=5
        ).json()
        assert detail["media_sandbox"] == {
            "filesystem": "mount-namespace",
            "syscalls": "allow-list",
            "network": "seccomp+namespace",
            "environment": "scrubbed",
        }
    finally:
        server.stop()
