"""Tiny random-weight BERT-shaped guard models for the real vLLM, and a pooling server that serves one.

Built offline (transformers' ``BertConfig`` at tiny sizes, a WordPiece vocabulary written here), cached
outside the clone beside the suite's other entries (tests/cachedir.py) and stamped with what they were
built from. With one label a model is a cross-encoder (vLLM answers ``/score`` and ``/rerank``); with
three it is a classifier (``/classify``). vLLM serves each with ``--runner pooling`` in float32, so the
engine's own numbers are what the gateway's verdicts are compared with.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

from tests import cachedir
from tests.realvllm.prepare import CACHE, Prepared, server_env
from tests.realvllm.server import VllmServer

#: bump to rebuild the cached models
BUILD = "3"
WORDS = [
    "the",
    "a",
    "an",
    "is",
    "are",
    "was",
    "were",
    "be",
    "of",
    "in",
    "on",
    "at",
    "to",
    "and",
    "or",
    "not",
    "no",
    "yes",
    "it",
    "this",
    "that",
    "what",
    "who",
    "where",
    "when",
    "paris",
    "france",
    "capital",
    "city",
    "river",
    "seine",
    "eiffel",
    "tower",
    "built",
    "opened",
    "in",
    "1889",
    "berlin",
    "germany",
    "rome",
    "italy",
    "ignore",
    "previous",
    "instructions",
    "system",
    "prompt",
    "reveal",
    "secret",
    "password",
    "kill",
    "hurt",
    "bomb",
    "weapon",
    "hello",
    "please",
    "answer",
    "question",
    "tell",
    "me",
    "about",
    "story",
    "weather",
    "today",
    "sunny",
    "rain",
    "cloud",
    "sky",
    "blue",
    "green",
    "red",
]
#: the classifier's three labels: a prompt screen reads them by these names, an NLI scorer (the same
#: weights, for the wire) by the NLI names, index for index
SCREEN_LABELS = ("benign", "injection", "harmful")
NLI_LABELS = ("entailment", "neutral", "contradiction")


def _vocab() -> list[str]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    punct = list(".,!?;:'\"()-")
    words = list(dict.fromkeys(WORDS))
    return [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *punct,
        *letters,
        *(f"##{c}" for c in letters),
        *words,
    ]


def build(name: str, labels: tuple[str, ...], seed: int) -> Path:
    """The model folder (built once): ``labels`` empty is a one-label cross-encoder."""
    folder = CACHE / "guard-models" / name
    stamp = folder / f".built-{BUILD}"
    with cachedir.building(folder):
        if stamp.exists():
            return folder
        import torch
        from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

        tmp = folder.with_name(folder.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "vocab.txt").write_text("\n".join(_vocab()) + "\n")
        tokenizer = BertTokenizerFast(vocab_file=str(tmp / "vocab.txt"), do_lower_case=True)
        n = len(labels) or 1
        config = BertConfig(
            vocab_size=len(_vocab()),
            hidden_size=128,  # head_dim 64: vLLM's CPU attention has no kernel for 16
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=256,
            max_position_embeddings=512,
            num_labels=n,
            id2label={i: lab for i, lab in enumerate(labels or ("LABEL_0",))},
            label2id={lab: i for i, lab in enumerate(labels or ("LABEL_0",))},
            architectures=["BertForSequenceClassification"],
        )
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
        _spread(model, tokenizer, n, seed, pairs=not labels)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        stamp.touch()
    return folder


def _spread(model: Any, tokenizer: Any, n: int, seed: int, *, pairs: bool) -> None:
    """Random weights give every input nearly the same output (the [CLS] position dominates): sharper
    attention, and a head along the directions the inputs vary most, spread the scores over 0..1."""
    import torch

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(64)]
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.query.weight.mul_(8.0)
            layer.attention.self.key.weight.mul_(8.0)
        batch = (
            tokenizer(texts[:32], texts[32:], padding=True, return_tensors="pt")
            if pairs
            else (tokenizer(texts, padding=True, return_tensors="pt"))
        )
        pooled = model.bert.pooler(model.bert(**batch).last_hidden_state)
        mean = pooled.mean(0)
        _, _, v = torch.linalg.svd(pooled - mean, full_matrices=False)
        head = v[:n]
        scale = 2.0 / ((pooled - mean) @ head.T).std(0)
        model.classifier.weight.copy_(head * scale[:, None])
        model.classifier.bias.copy_(-(mean @ head.T) * scale)


def cross_encoder() -> Path:
    return build("bert-cross-encoder", (), seed=3)


def classifier() -> Path:
    return build("bert-classifier-3", SCREEN_LABELS, seed=7)


class PoolingServer(VllmServer):
    """vLLM serving one pooling model (``--runner pooling``) under the name ``served``."""

    def __init__(self, prepared: Prepared, model_dir: Path, served: str) -> None:
        super().__init__(prepared)
        self.model_dir = model_dir
        self.served = served

    def command(self) -> list[str]:
        return [
            str(self.prepared.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served,
            "--runner",
            "pooling",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--enforce-eager",  # nothing to compile for a model this small: a quicker boot
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def start(self) -> PoolingServer:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.command(),
            env=server_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=self.log.parent,
            start_new_session=True,
        )
        out.close()
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self
