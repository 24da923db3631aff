"""A step's inputs as the model reads them: where each token's K/V is written, which rows are decodes,
and the refusal to write into a quantised block."""
from __future__ import annotations

import pytest
import torch

from bie_trt.kernels.step_inputs import SeqInput, StepMetadata, write_blocks

B = 4


def test_a_mixed_step_places_every_token():
    decode = SeqInput(torch.tensor([5]), 6, [3, 8])                       # position 6: block 8, offset 2
    chunk = SeqInput(torch.tensor([1, 2, 3]), 6, [-1, 2, 9], all_logits=True)   # positions 6..8
    meta = StepMetadata.build([decode, chunk], B, torch.device("cpu"))
    assert meta.positions.tolist() == [6, 6, 7, 8]
    assert meta.slot_blocks.tolist() == [8, 2, 2, 9] and meta.slot_offsets.tolist() == [2, 2, 3, 0]
    assert meta.decode_rows.tolist() == [0] and meta.decode_lens.tolist() == [7]
    assert meta.decode_tables.tolist() == [[3, 8]]
    assert [(start, n, table.tolist()) for start, n, table in meta.prefills] == [(1, 3, [-1, 2, 9])]
    assert meta.logit_rows.tolist() == [0, 1, 2, 3] and meta.logit_counts == [1, 3]
    assert not meta.all_decode


def test_a_write_into_a_quantised_block_is_refused():
    assert write_blocks([0, 1, 2], [4, 8], B) == [1, 2]
    with pytest.raises(RuntimeError, match="quantised KV block"):
        write_blocks([-1, 1], [3, 4], B)
    with pytest.raises(RuntimeError, match="quantised KV block"):
        StepMetadata.build([SeqInput(torch.tensor([1]), 2, [-3])], B, torch.device("cpu"))
