"""Host buffers the device copies from and to (sltune.runtime.pinned): each large one pinned at its own size, not
rounded up to a power of two, and unpinned with its last view."""

import gc
import math

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.pinned import IN_PLACE_FROM, PAGE
from tests.support.reference import adamw
from tests.support.runtime import batch
from tests.support.runtime import emulated  # noqa: F401 - a fixture its tests ask for by name


def test_host_buffers_are_pinned_at_their_own_size(emulated):
    """Finding 5: torch's pinned allocator rounds each buffer up to a power of two (up to twice the memory);
    the runtime pins each large buffer's own pages, and counts them."""
    model = build({"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704,
                   "num_hidden_layers": 1, "num_attention_heads": 4}, seed=0)
    eng = SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2, num_live_blocks=1,
                            schedule="canonical"), optimizer=adamw)
    eng.train_step(batch(2, 8))
    host = eng.copier.host
    buffers = [t for u in eng.units for t in (u.host, u.host_grad) if t is not None]
    buffers += eng.copier.staging
    large = [t.numel() * t.element_size() for t in buffers if t.numel() * t.element_size() >= IN_PLACE_FROM]
    assert len(large) >= 5
    exact = sum(-(-n // PAGE) * PAGE for n in large)
    assert host.pinned_bytes == host.peak_pinned_bytes == exact == sum(host.pinner.ranges.values())
    assert exact < 1.01 * sum(large) and sum(2 ** math.ceil(math.log2(n)) for n in large) > 1.2 * exact
    del eng, model, buffers
    gc.collect()
    assert host.pinned_bytes == 0 and host.pinner.ranges == {}      # unpinned with the last view
