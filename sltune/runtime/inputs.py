"""The checks of what train_step, evaluate and generate are given (token ids, labels, attention masks, prompts):
bad input fails before anything is loaded, with a message that says what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sltune.config import SpeedLoaderConfig

IGNORE_INDEX = -100


def check_ids(input_ids: Any, config: "SpeedLoaderConfig", model_config: Any, what: str,
              extra_tokens: int = 0) -> None:
    """b*N rows of token ids that fit the model (`model_config`: its transformers config): the checks training
    and generation share."""
    rows = config.sub_batch_size * config.num_sub_batches
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = (f"a {input_ids.dim()}-D {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
               if torch.is_tensor(input_ids) else type(input_ids).__name__)
        raise ValueError(f"input_ids must be a 2-D LongTensor [rows, {what}], got {got}")
    if input_ids.shape[0] != rows:
        raise ValueError(
            f"input_ids has {input_ids.shape[0]} rows but sub_batch_size*num_sub_batches = "
            f"{config.sub_batch_size}*{config.num_sub_batches} = {rows}; pass {rows} rows or change num_sub_batches"
        )
    total = input_ids.shape[1] + extra_tokens
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and total > max_pos:
        tokens = "prompt_len + max_new_tokens" if extra_tokens else "seq_len"
        raise ValueError(f"{tokens} = {total} exceeds the model's max_position_embeddings {max_pos}")
    vocab = model_config.vocab_size
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(f"input_ids must be token ids in [0, {vocab}); got values in "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")


def check_batch(input_ids: Any, labels: Any, attention_mask: Any, config: "SpeedLoaderConfig", model_config: Any,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A training or evaluation batch on the device: ids, labels (the ids if None) with some next-token label to
    learn from, and a 0/1 mask or None."""
    check_ids(input_ids, config, model_config, "seq_len")
    if input_ids.shape[1] < 2:
        raise ValueError("input_ids needs at least 2 tokens per row to have a next-token loss")
    if labels is None:
        labels = input_ids
    elif not torch.is_tensor(labels) or labels.shape != input_ids.shape:
        got = tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__
        raise ValueError(f"labels {got} must have input_ids' shape {tuple(input_ids.shape)}")
    vocab = model_config.vocab_size
    used = labels[:, 1:][labels[:, 1:] != IGNORE_INDEX]
    if used.numel() == 0:
        raise ValueError(f"labels: every next-token label is {IGNORE_INDEX} (ignored), so there is nothing to "
                         "train on; pass labels with some real token ids")
    if int(used.min()) < 0 or int(used.max()) >= vocab:
        raise ValueError(f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored); got values in "
                         f"[{int(used.min())}, {int(used.max())}]")
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
            got = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
            raise ValueError(f"attention_mask {got} must have input_ids' shape {tuple(input_ids.shape)}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    return (input_ids.to(device, torch.long), labels.to(device, torch.long),
            None if attention_mask is None else attention_mask.to(device))


def check_prompt(input_ids: Any, attention_mask: Any, max_new_tokens: Any, config: "SpeedLoaderConfig",
                 model_config: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids and a 0/1 mask (all ones if None) on the device, left padding checked."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_ids(input_ids, config, model_config, "prompt_len", extra_tokens=max_new_tokens)
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids needs at least 1 prompt token per row")
    if attention_mask is None:
        mask = torch.ones(input_ids.shape, dtype=torch.long)
    else:
        if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
            got = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
            raise ValueError(f"attention_mask {got} must be a tensor shaped like input_ids "
                             f"{tuple(input_ids.shape)}")
        mask = attention_mask.long()
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
        if not bool(mask[:, -1].all()):
            raise ValueError("attention_mask: every row's last prompt position must be a token; pad prompts on "
                             "the left (tokenizer.padding_side = 'left')")
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
            raise ValueError("attention_mask has padding after a token; pad prompts on the left only "
                             "(tokenizer.padding_side = 'left')")
    return input_ids.to(device, torch.long), mask.to(device)
