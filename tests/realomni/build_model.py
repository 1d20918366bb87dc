"""Build a tiny random-weight Qwen3-Omni (thinker, talker, code2wav) with an offline tokenizer and processor.

Run with the vLLM-Omni environment's Python (it has the transformers that knows Qwen3-Omni):
``python tests/realomni/build_model.py OUT_DIR``. Nothing is downloaded: the configs come from transformers'
own config classes, the weights are random, the tokenizer is built here with the tokenizers library.

The shapes are the smallest that vLLM's CPU kernels and vLLM-Omni's stage code accept: two layers a stage,
widths of 64, four experts, head_dim 32 (vLLM's CPU attention refuses 16). The token ids are Qwen3-Omni's
own, because vLLM-Omni hard-codes some of them (``<|audio_start|>`` = 151669, the talker's stop 2150).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Qwen3-Omni's special tokens at Qwen's ids (the vocabulary is padded to 151936 as in the real model).
VOCAB_SIZE = 151936
SPECIAL = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656,
    "<|audio_start|>": 151669, "<|audio_end|>": 151670, "<tts_pad>": 151671, "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673, "<tts_text_bos_single>": 151674, "<|audio_pad|>": 151675,
}  # fmt: skip
# The role words are single tokens in Qwen's vocabulary; the talker finds the turns by these ids.
ROLES = {"user": 872, "system": 8948, "assistant": 77091}
# The talker's speakers (lowercase, as vLLM-Omni matches them) and their codec-vocabulary ids.
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer(out: Path) -> None:
    """A byte-level BPE without merges (every byte one token) over Qwen's id space, saved as tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab: dict[str, int] = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    fixed = {**SPECIAL, **ROLES}
    taken = set(fixed.values())
    for i in range(len(vocab), VOCAB_SIZE):
        if i not in taken:
            vocab[f"<unused{i}>"] = i
    vocab.update(fixed)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # add_tokens keeps the ids already in the vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=True) for t in ROLES])
    for t, i in fixed.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        extra_special_tokens={
            "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
            "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
        },
    )  # fmt: skip
    fast.save_pretrained(str(out))


def build_config():
    from transformers import Qwen3OmniMoeConfig

    rope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [6, 5, 5],
        "interleaved": True,
        "mrope_interleaved": True,
    }  # fmt: skip  (6 + 5 + 5 = head_dim / 2)
    moe_text = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=4096, rope_parameters=rope)  # fmt: skip
    config = Qwen3OmniMoeConfig(
        thinker_config={
            "text_config": {**moe_text, "vocab_size": VOCAB_SIZE},
            "audio_config": dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=128,
                                 d_model=64, output_dim=64, downsample_hidden_size=32),
            "vision_config": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
                                  deepstack_visual_indexes=[0], patch_size=16, spatial_merge_size=2,
                                  temporal_patch_size=2, num_position_embeddings=2304),
            "audio_token_id": SPECIAL["<|audio_pad|>"], "image_token_id": SPECIAL["<|image_pad|>"],
            "video_token_id": SPECIAL["<|video_pad|>"], "audio_start_token_id": SPECIAL["<|audio_start|>"],
            "user_token_id": ROLES["user"],
        },
        talker_config={
            "text_config": {**moe_text, "vocab_size": 3072, "shared_expert_intermediate_size": 128},
            "code_predictor_config": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                          num_code_groups=16, max_position_embeddings=4096),
            "num_code_groups": 16, "thinker_hidden_size": 64, "accept_hidden_layer": 1,
            # Qwen3-Omni's codec ids (transformers' defaults are not the released model's).
            "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155,
            "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
            "audio_token_id": SPECIAL["<|audio_pad|>"], "image_token_id": SPECIAL["<|image_pad|>"],
            "video_token_id": SPECIAL["<|video_pad|>"], "vision_start_token_id": SPECIAL["<|vision_start|>"],
            "audio_start_token_id": SPECIAL["<|audio_start|>"], "speaker_id": SPEAKERS,
        },
        code2wav_config=dict(codebook_size=2048, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=128, num_hidden_layers=1, num_quantizers=16, decoder_dim=64,
                             max_position_embeddings=8000),
        im_start_token_id=SPECIAL["<|im_start|>"], im_end_token_id=SPECIAL["<|im_end|>"],
        tts_pad_token_id=SPECIAL["<tts_pad>"], tts_bos_token_id=SPECIAL["<tts_text_bos>"],
        tts_eos_token_id=SPECIAL["<tts_text_eod>"], system_token_id=ROLES["system"], user_token_id=ROLES["user"],
        assistant_token_id=ROLES["assistant"],
    )  # fmt: skip
    # vLLM reads these; transformers' config classes leave them unset.
    vision = config.thinker_config.vision_config
    vision.image_size = 768  # sqrt(num_position_embeddings) * patch_size
    vision.apply_vit_abs_pos_embed = True
    config.talker_config.spatial_merge_size = vision.spatial_merge_size
    for text in (config.thinker_config.text_config, config.talker_config.text_config):
        text.head_dim = 32
    return config


def build_processor(out: Path) -> None:
    from transformers import AutoTokenizer, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        video_processor=Qwen2VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
        tokenizer=AutoTokenizer.from_pretrained(str(out)),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))


def build(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_processor(out)
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(build_config()).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(eos_token_id=[SPECIAL["<|im_end|>"], SPECIAL["<|endoftext|>"]],
                     pad_token_id=SPECIAL["<|endoftext|>"]).save_pretrained(str(out))  # fmt: skip
    print(json.dumps({"model": str(out), "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
