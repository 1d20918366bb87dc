"""The import graph's contracts (pyproject.toml, ``[tool.importlinter]``) hold, and they bite.

The layers import downward only: the gateway wires policies and engines, which know nothing of each
other, read observability and the kernel; the kernel (``core/``) imports nothing of the project; no
package's modules import each other in a circle. TYPE_CHECKING imports count.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "gateway", "policies", "engines", "observability")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_every_contract() -> None:
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
    for contract in (
        "Layers:",
        "The kernel imports nothing of the project",
        "No circles",
        "Adapters know nothing",
    ):
        assert contract in done.stdout


def _copy(tmp_path: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_a_type_only_import_from_the_kernel_up_breaks_the_build(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    _append(
        tree / "core" / "context.py",
        "if TYPE_CHECKING:\n    from gateway.admission import Ticket  # noqa: F401",
    )
    done = _lint_imports(tree)
    assert done.returncode == 1
    assert "The kernel imports nothing of the project BROKEN" in done.stdout
    assert "core.context -> gateway.admission" in done.stdout


def test_a_policy_that_imports_an_engine_or_the_gateway_breaks_the_layers(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    _append(tree / "policies" / "limits.py", "from engines.selection.pool import EnginePool  # noqa: F401")
    _append(tree / "observability" / "metrics.py", "import gateway.services  # noqa: F401")
    done = _lint_imports(tree)
    assert done.returncode == 1
    assert "policies.limits -> engines.selection.pool" in done.stdout
    assert "observability.metrics -> gateway.services" in done.stdout


def test_a_new_circle_inside_a_package_breaks_the_build(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    # gateway/settings.py reads its sources from gateway/settings_sources.py: a way back closes a circle.
    _append(tree / "gateway" / "settings_sources.py", "import gateway.settings  # noqa: F401")
    done = _lint_imports(tree)
    assert done.returncode == 1
    assert "No cycles are allowed in gateway" in done.stdout


def test_an_adapter_or_the_rollout_plane_reaching_across_engines_breaks_the_build(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    engines = tree / "engines"
    _append(
        engines / "adapters" / "local.py", "from engines.rollout.signals import OutcomeWindow  # noqa: F401"
    )
    _append(engines / "rollout" / "offload.py", "from engines.selection.pool import EnginePool  # noqa: F401")
    _append(
        tree / "gateway" / "pipeline" / "relay.py",
        "from engines.rollout.state_store import StateStore  # noqa: F401",
    )
    done = _lint_imports(tree)
    assert done.returncode == 1
    assert "engines.adapters.local -> engines.rollout.signals" in done.stdout
    assert "engines.rollout.offload -> engines.selection.pool" in done.stdout
    assert "gateway.pipeline.relay -> engines.rollout.state_store" in done.stdout
    assert "engines.rollout is not allowed to import engines.selection" in done.stdout
