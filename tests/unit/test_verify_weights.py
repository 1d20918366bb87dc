"""``omnigate verify-weights`` on a generated model folder: good, a flipped byte, a missing file, an extra file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from gateway.cli import main
from gateway.weights import ManifestError, parse_manifest

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def snapshot(tmp_path):
    """A small model snapshot as a download leaves it: weights, config, tokenizer, HF download metadata."""
    folder = tmp_path / "omni-int4" / "snapshots" / REV
    (folder / "sub").mkdir(parents=True)
    rng = np.random.default_rng(7)
    save_file(
        {"w": rng.standard_normal((64, 64)).astype(np.float32)},
        str(folder / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"b": rng.standard_normal((64,)).astype(np.float32)}, str(folder / "model-00002-of-00002.safetensors")
    )
    (folder / "config.json").write_text(json.dumps({"architectures": ["Test"], "hidden_size": 64}))
    (folder / "sub" / "tokenizer.json").write_text("{}")
    manifest = tmp_path / "omni-int4.sha256"
    assert main(["weights-manifest", str(folder)]) == 0
    return folder, manifest


def _manifest(capsys, snapshot) -> None:
    folder, manifest = snapshot
    capsys.readouterr()
    main(["weights-manifest", str(folder)])
    manifest.write_text(capsys.readouterr().out)


def _verify(folder, manifest, *extra: str) -> int:
    return main(
        ["verify-weights", "--dir", str(folder), "--manifest", str(manifest), "--revision", REV, *extra]
    )


def test_the_manifest_lists_every_file_once(capsys, snapshot):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    sums = parse_manifest(manifest.read_text())
    assert sorted(sums) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "sub/tokenizer.json",
    ]
    # The format is sha256sum's: the standard tool checks it too.
    check = subprocess.run(["sha256sum", "-c", str(manifest)], cwd=folder, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_good_snapshot_passes(capsys, snapshot):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    # huggingface_hub's own bookkeeping beside a download is not part of the weights.
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "config.json.metadata").write_text("x")
    assert _verify(folder, manifest) == 0
    assert "weights verified" in capsys.readouterr().out


def test_a_flipped_byte_fails(capsys, snapshot):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    shard = folder / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert _verify(folder, manifest) == 1
    err = capsys.readouterr().err
    assert "weights NOT verified" in err and "model-00001-of-00002.safetensors: sha256" in err


def test_a_missing_file_fails(capsys, snapshot):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    (folder / "model-00002-of-00002.safetensors").unlink()
    assert _verify(folder, manifest) == 1
    assert "model-00002-of-00002.safetensors: missing" in capsys.readouterr().err


def test_an_extra_file_fails(capsys, snapshot):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    (folder / "sub" / "extra.safetensors").write_bytes(b"\0" * 16)
    assert _verify(folder, manifest) == 1
    assert "sub/extra.safetensors: not in the manifest" in capsys.readouterr().err


def test_another_revision_folder_fails(capsys, snapshot):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    other = folder.with_name("f" * 40)
    folder.rename(other)
    assert main(["verify-weights", "--dir", str(other), "--manifest", str(manifest), "--revision", REV]) == 1
    assert f"not the snapshot of revision {REV}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only a comment\n",
        "not a sum  config.json\n",
        "a" * 64 + "  ../outside\n",
        "a" * 64 + "  /etc/passwd\n",
        "a" * 64 + "  x\n" + "b" * 64 + "  x\n",
    ],
)
def test_a_manifest_it_cannot_trust_fails_closed(capsys, snapshot, text):
    folder, manifest = snapshot
    manifest.write_text(text)
    with pytest.raises(ManifestError):
        parse_manifest(text)
    assert _verify(folder, manifest) == 1
    assert "weights NOT verified: manifest" in capsys.readouterr().err


@pytest.mark.parametrize("revision", ["main", "unpinned", "v1.0", REV[:12], REV.upper()])
def test_only_a_commit_pins(capsys, snapshot, revision):
    folder, manifest = snapshot
    _manifest(capsys, snapshot)
    assert (
        main(
            [
                "verify-weights",
                "--dir",
                str(folder),
                "--manifest",
                str(manifest),
                "--revision",
                revision,
                "--download",
                "--model",
                "org/model",
            ]
        )
        == 1
    )
    assert "is not a commit" in capsys.readouterr().err


def test_no_manifest_or_no_folder_fails(capsys, snapshot, tmp_path):
    folder, manifest = snapshot
    assert _verify(folder, tmp_path / "absent.sha256") == 1
    _manifest(capsys, snapshot)
    assert _verify(tmp_path / "nothing" / REV, manifest) == 1


def test_the_console_script_exits_non_zero(snapshot):
    folder, manifest = snapshot
    manifest.write_text("0" * 64 + "  config.json\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "verify-weights",
            "--dir",
            str(folder),
            "--manifest",
            str(manifest),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "config.json: sha256" in done.stderr
