"""Language instructions as observation rows: any length and any UTF-8 text comes back whole."""

import numpy as np
import pytest
import torch

from envs.base import (
    INSTRUCTION_BYTES,
    decode_instruction,
    encode_instruction,
    encode_instructions,
    instruction_width,
)

FRENCH_CHINESE = "Mets le bol noir sur l'assiette à côté du ramequin — 把碗放在盘子上"


def _straddling(char: str) -> str:
    """ASCII up to byte 127, then ``char`` (multi-byte): it straddles the old 128-byte cut."""
    text = "x" * 127 + char + " then stop"
    assert len(text[:127].encode()) == 127 and len(text[:128].encode()) > 128
    return text


def test_width_is_the_longest_rounded_up_to_64_and_at_least_128():
    assert instruction_width([]) == INSTRUCTION_BYTES == 128
    assert instruction_width(["push the cube"]) == 128
    assert instruction_width(["a" * 128]) == 128
    assert instruction_width(["a" * 129, "b"]) == 192
    assert instruction_width(["a" * 300]) == 320
    assert instruction_width(["é" * 100]) == 256  # bytes, not characters: 200 bytes


@pytest.mark.parametrize("text", ["p" * 300, FRENCH_CHINESE, _straddling("à"), _straddling("把"),
                                  FRENCH_CHINESE * 5])
def test_encode_then_decode_gives_the_whole_text(text):
    row = encode_instruction(text)
    assert row.dtype == np.uint8 and row.shape == (instruction_width([text]),)
    assert decode_instruction(row) == text
    assert decode_instruction(torch.from_numpy(row)) == text  # rows arrive as torch tensors


def test_a_text_wider_than_the_given_width_raises_instead_of_being_cut():
    with pytest.raises(ValueError, match="300 UTF-8 bytes .* 128 bytes"):
        encode_instruction("p" * 300, width=128)
    with pytest.raises(ValueError, match="129 UTF-8 bytes .* 128 bytes"):
        encode_instruction(_straddling("à")[:128], width=128)
    assert encode_instruction("p" * 300, width=384).shape == (384,)  # a wider field is fine


def test_nul_characters_are_refused_since_zero_bytes_are_the_padding():
    with pytest.raises(ValueError, match="NUL"):
        encode_instruction("push the cube\0")


def test_decoding_is_strict():
    """A row cut inside a character (what the old 128-byte cut made) raises, never decodes to other text."""
    row = np.zeros(128, dtype=np.uint8)
    row[:] = np.frombuffer(_straddling("à").encode()[:128], dtype=np.uint8)
    with pytest.raises(UnicodeDecodeError):
        decode_instruction(row)


def test_instructions_of_different_lengths_stack_at_one_width():
    texts = ["push the cube", "p" * 300, FRENCH_CHINESE]
    rows = encode_instructions(texts)
    assert rows.shape == (3, 320) and rows.dtype == np.uint8
    assert [decode_instruction(row) for row in rows] == texts


def test_a_vla_policy_reads_long_and_non_ascii_instructions_whole():
    from policies.vla.policy import instructions_of

    texts = [_straddling("把"), FRENCH_CHINESE]
    obs = {"rgb": torch.zeros(2, 8, 8, 3, dtype=torch.uint8),
           "instruction": torch.from_numpy(encode_instructions(texts))}
    assert instructions_of(obs, fallback="unused") == texts
