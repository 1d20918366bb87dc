"""The server process freezes its startup heap; a reload lets the old configuration's cycles go.

Run in a subprocess: freezing is process-wide and the test process must not keep it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import gc, sys, weakref
    from starlette.testclient import TestClient
    from gateway import heap
    from gateway.app import create_app
    from gateway.settings import Settings

    class Node:
        pass

    settings = Settings.model_validate({
        "engines": [{"name": "text", "kind": "vllm", "base_url": "http://127.0.0.1:9/v1", "model": "m",
                     "variant": "fp16", "serves": ["text-model"]}],
        "audit": {"sqlite_path": sys.argv[1]},
        "routing": {"controller": {"enabled": False}},
        "logging": {"level": "warning"},
    })
    assert gc.get_freeze_count() == 0
    with TestClient(create_app(settings)):
        assert gc.get_freeze_count() == 0          # only the server process asks for it
    cycle = Node(); cycle.self = cycle; gone = weakref.ref(cycle)
    with TestClient(create_app(settings, freeze_heap=True)):
        assert gc.get_freeze_count() > 1000        # the startup heap is out of the collector's scans
        del cycle
        gc.collect()
        assert gone() is not None                  # a frozen cycle waits ...
        heap.refreeze()
        assert gone() is None                      # ... until a reload's refreeze
        assert gc.get_freeze_count() > 1000
    print("ok")
    """
)


def test_the_server_freezes_its_startup_heap_and_a_reload_releases_old_cycles(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "audit.db")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
