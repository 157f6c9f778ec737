"""What train_step is given (sltune.runtime.inputs): bad input fails early with a message that says what to
change."""

import pytest
import torch

from tests.support.runtime import engine


def test_batch_rows_must_be_b_times_n():
    with pytest.raises(ValueError, match=r"6 rows but sub_batch_size\*num_sub_batches = 2\*4 = 8"):
        engine(sub_batch_size=2, num_sub_batches=4).train_step(torch.zeros(6, 8, dtype=torch.long))


def test_token_ids_and_lengths_are_checked():
    eng = engine()
    with pytest.raises(ValueError, match=r"token ids in \[0, 512\)"):
        eng.train_step(torch.full((1, 8), 600))
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        eng.train_step(torch.zeros(1, 600, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D LongTensor"):
        eng.train_step(torch.zeros(8))


def test_labels_and_masks_are_checked():
    eng = engine(sub_batch_size=1, num_sub_batches=2)
    ids = torch.randint(3, 512, (2, 8))
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 512\) or -100"):
        eng.train_step(ids, labels=torch.full_like(ids, 700))
    with pytest.raises(ValueError, match="every next-token label is -100"):
        eng.train_step(ids, labels=torch.full_like(ids, -100))
    with pytest.raises(ValueError, match="attention_mask must hold 0"):
        eng.train_step(ids, attention_mask=torch.full_like(ids, 2))
    with pytest.raises(ValueError, match=r"got a 1-D torch.int64 tensor of shape \(8,\)"):
        eng.train_step(torch.zeros(8, dtype=torch.long))
