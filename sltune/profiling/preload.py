"""Imported once by the trial fork server, so every trial starts with these already loaded."""

import torch.profiler  # noqa: F401
import transformers.masking_utils  # noqa: F401
from transformers import AutoModelForCausalLM  # noqa: F401
from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401
from transformers.models.mistral import modeling_mistral  # noqa: F401
from transformers.models.opt import modeling_opt  # noqa: F401
from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

import sltune.profiling.breakdown  # noqa: F401
import sltune.profiling.child  # noqa: F401
import sltune.runtime.engine  # noqa: F401

# What the fork server imported lives as long as it does: kept out of every collection, in the server and in each
# trial or spec check forked from it, a full collection there (a trial's, before its parity check) scans only
# its own objects: a thousandth of a second instead of 0.15 s over torch's and transformers' 380,000 objects.
import gc  # noqa: E402

gc.collect()
gc.freeze()
