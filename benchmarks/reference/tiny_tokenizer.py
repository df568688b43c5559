"""A 32,000-piece Llama-2-shaped SentencePiece tokenizer, trained here (runs in the reference venv).

Llama-2's own tokenizer cannot be downloaded here, and OpenVLA's code depends on its layout:
``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, byte-fallback pieces 3-258, the lone word-boundary piece
"\u2581" at id **29871** (``predict_action`` appends it by number), the 256 action tokens at
ids 31744-31999 (``vocab_size - 64 - bin``), and ``<PAD>`` added as id 32000. This module trains
a small BPE model with Llama-2's normaliser settings (identity normalisation, a dummy prefix,
whitespace kept, digits split, byte fallback) on robot-instruction text, then fills the
vocabulary to 32,000 with single CJK / Hangul characters (as Llama-2's high ids are) and puts
"\u2581" at 29871. Single characters create no BPE merges, so they never change how text
tokenizes.
"""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm

# transformers' copy of the proto (sentencepiece's own one clashes with it in one process)
from transformers.utils import sentencepiece_model_pb2_new as sp_pb2

VOCAB_SIZE = 32000
EMPTY_PIECE_ID = 29871
WORD_BOUNDARY = "\u2581"

CORPUS = [
    "In: What action should the robot take to {}?\nOut: ",
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "pick up the black bowl next to the ramekin and place it on the plate",
    "pick up the black bowl from table center and place it on the plate",
    "pick up the black bowl on the cookie box and place it on the plate",
    "pick up the black bowl in the top drawer of the wooden cabinet and place it on the plate",
    "pick up the alphabet soup and place it in the basket",
    "open the middle drawer of the cabinet", "put the bowl on the stove", "turn on the stove",
    "put both the alphabet soup and the tomato sauce in the basket",
    "push the cube to the goal region", "pick up the cube and move it to the goal",
    "stack the red cube on the green cube", "pull the cube to the goal region",
    "The robot arm moves the gripper 12 cm to the left, then 3.5 cm down, and closes it.",
]


def _train_small_model() -> sp_pb2.ModelProto:
    text = "\n".join(line.format(task) for line in CORPUS[:1] for task in CORPUS[1:]) + "\n" + "\n".join(CORPUS)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines() * 20), model_writer=model, model_type="bpe",
        vocab_size=600, hard_vocab_limit=False, character_coverage=1.0, byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    proto = sp_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    return proto


def _filler_characters():
    for start, end in ((0x4E00, 0x9FFF), (0xAC00, 0xD7A3)):
        yield from (chr(c) for c in range(start, end + 1))


def build_sentencepiece_model() -> bytes:
    """Serialized ``tokenizer.model``: 32,000 pieces, "\u2581" at 29871."""
    proto = _train_small_model()
    pieces = [p for p in proto.pieces if p.piece != WORD_BOUNDARY]
    boundary = next(p for p in proto.pieces if p.piece == WORD_BOUNDARY)
    used = {p.piece for p in proto.pieces}
    filler = (c for c in _filler_characters() if c not in used)
    lowest = min(p.score for p in pieces)
    out = sp_pb2.ModelProto()
    out.CopyFrom(proto)
    del out.pieces[:]
    for piece in pieces:
        out.pieces.add().CopyFrom(piece)
    while len(out.pieces) < VOCAB_SIZE:
        if len(out.pieces) == EMPTY_PIECE_ID:
            out.pieces.add().CopyFrom(boundary)
            continue
        lowest -= 1.0
        out.pieces.add(piece=next(filler), score=lowest, type=sp_pb2.ModelProto.SentencePiece.NORMAL)
    out.trainer_spec.vocab_size = VOCAB_SIZE
    return out.SerializeToString()


def save_llama_tokenizer(directory: Path):
    """Write ``tokenizer.model``, ``tokenizer.json`` and the configs as openvla-7b ships them
    (Llama-2 tokenizer, ``legacy=False``, ``<PAD>`` = 32000, right padding); returns the fast tokenizer."""
    from transformers import LlamaTokenizer, LlamaTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    scratch = directory / "_sp"
    scratch.mkdir(exist_ok=True)
    (scratch / "tokenizer.model").write_bytes(build_sentencepiece_model())
    slow = LlamaTokenizer(str(scratch / "tokenizer.model"), legacy=False, add_bos_token=True, add_eos_token=False)
    assert slow.convert_ids_to_tokens(EMPTY_PIECE_ID) == WORD_BOUNDARY
    slow.save_pretrained(scratch)
    fast = LlamaTokenizerFast.from_pretrained(scratch, legacy=False, from_slow=True)
    fast.add_special_tokens({"pad_token": "<PAD>"})
    fast.padding_side = "right"
    fast.model_max_length = 2048
    fast.save_pretrained(directory)
    for f in scratch.iterdir():
        f.unlink()
    scratch.rmdir()
    assert fast.pad_token_id == 32000 and fast.bos_token_id == 1 and fast.eos_token_id == 2
    return fast
