"""Build a tiny, randomly initialised SigLIP checkpoint offline, for tests and offline demos.

The checkpoint has the layout of ``google/siglip2-base-patch16-224`` (``model_type`` ``siglip``, a
Gemma-style BPE ``tokenizer.json`` that appends ``<eos>``, a ``SiglipImageProcessor`` with mean and
std 0.5), so it loads through exactly the code path of the real model: ``AutoModel``,
``AutoTokenizer`` and ``AutoImageProcessor`` (or ``AutoProcessor``) ``.from_pretrained(path)``.
The tokenizer's merges are learnt here from a small built-in corpus; bytes outside it fall back
to byte tokens. Weights depend only on ``seed``; nothing is downloaded.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import torch
from transformers import (
    GemmaTokenizer,
    SiglipConfig,
    SiglipModel,
    SiglipTextConfig,
    SiglipVisionConfig,
)
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

HIDDEN_SIZE = 32
INTERMEDIATE_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 2
#: SigLIP text towers take 64 tokens (``ModelSettings.text_max_length``).
TEXT_MAX_POSITIONS = 64
NUM_MERGES = 300

# Same special tokens and ids as the Gemma tokenizer of SigLIP 2.
_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
_SPACE = "▁"

_CORPUS = """
a photo of a cat sitting on a sofa
a dog running on the beach at sunset
a person walking a dog in the park
a red car driving down a busy street
two people talking in a kitchen
a man riding a bicycle on a mountain road
a woman cooking dinner in the kitchen
children playing football on a green field
a city skyline at night with bright lights
a close up of a flower in the garden
a train arriving at the station
a plane taking off from the airport
waves crashing on the rocks near the shore
a crowd of people at a concert
a cat jumping onto a table
snow falling on a quiet street
a boat sailing on a calm lake
a person typing on a laptop at a desk
a bird flying over the water
a chef slicing vegetables on a cutting board
the sun rising over the hills
a group of friends laughing around a fire
someone opening a door and walking into a room
a black and white photo of an old building
rain drops on a window
a car parked in front of a house
a man speaking into a microphone on stage
a little girl reading a book
a horse running across a field
traffic lights changing from red to green
"""


def _learn_merges(corpus: str, num_merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Learn BPE merges from the words of ``corpus``, deterministically.

    Words are spelled as the Gemma normaliser leaves them (``▁`` before every word but a text's
    first). Returns the base symbols (sorted) and the merges in order; ties between equally
    frequent pairs are broken by the pair itself, so the result never depends on hash order.
    """
    counts: Counter[str] = Counter()
    for line in corpus.splitlines():
        first, *rest = line.split() or [""]
        counts.update([first, *(_SPACE + word for word in rest)])
    words: dict[tuple[str, ...], int] = {tuple(word): n for word, n in counts.items() if word}
    base = sorted({symbol for word in words for symbol in word} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:
            break
        merges.append(best)
        words = {_apply_merge(word, best): n for word, n in words.items()}
    return base, merges


def _apply_merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)


def build_tiny_tokenizer() -> GemmaTokenizer:
    """Build the tiny Gemma-style BPE tokenizer (no ``<bos>``, ``<eos>`` appended, right padding)."""
    base, merges = _learn_merges(_CORPUS, NUM_MERGES)
    vocab: dict[str, int] = {}
    for token in (*_SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *base):
        vocab.setdefault(token, len(vocab))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return GemmaTokenizer(
        vocab=vocab,
        # tokenizers' BPE wants (left, right) pairs; transformers' hint says list[str].
        merges=merges,  # type: ignore[arg-type]
        add_bos_token=False,
        add_eos_token=True,
        padding_side="right",
        model_max_length=TEXT_MAX_POSITIONS,
    )


def build_tiny_siglip(
    path: Path, *, seed: int = 0, image_size: int = 64, patch_size: int = 16, hidden_size: int = HIDDEN_SIZE
) -> Path:
    """Write a tiny random SigLIP checkpoint (model, tokenizer, image processor) into ``path``.

    The same ``seed`` (and ``hidden_size``) always gives the same weights. ``hidden_size`` is the
    embedding size of both towers: checkpoints of other sizes stand in for another model in a switch.
    ``path`` is created if missing; files already there are overwritten. Returns ``path``.

    Raises:
        ValueError: if ``image_size`` is not a positive multiple of ``patch_size``, or ``hidden_size``
            not a positive multiple of the number of attention heads.
        OSError: if ``path`` can't be written.
    """
    if patch_size <= 0 or image_size <= 0 or image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a positive multiple of patch_size ({patch_size})")
    if hidden_size <= 0 or hidden_size % NUM_HEADS:
        raise ValueError(f"hidden_size ({hidden_size}) must be a positive multiple of {NUM_HEADS} (attention heads)")
    # The MLP keeps its proportion to the width (the default checkpoint is unchanged).
    intermediate_size = INTERMEDIATE_SIZE * hidden_size // HIDDEN_SIZE
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    text_config = SiglipTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=TEXT_MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision_config = SiglipVisionConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        image_size=image_size,
        patch_size=patch_size,
    )
    config = SiglipConfig(text_config=text_config.to_dict(), vision_config=vision_config.to_dict())
    # A private RNG state: seeding must not disturb the caller's torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SiglipModel(config)
    model.save_pretrained(path)
    image_processor = SiglipImageProcessorPil(
        size={"height": image_size, "width": image_size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        resample=2,  # bilinear, as in SigLIP 2's preprocessor_config.json
    )
    # Separate files, like the hub checkpoints (``preprocessor_config.json``, ``tokenizer*.json``).
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
