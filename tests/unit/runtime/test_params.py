"""Parameters' device buffers (sltune.runtime.params): the pool reuses a released buffer only after the copy reading
it ends, as CUDA's caching allocator does (on the emulated device)."""

import torch

from sltune.runtime.memory import DeviceMemory
from sltune.runtime.params import BufferPool
from tests.support.runtime import copier


def test_a_released_buffer_is_reused_only_after_the_copy_reading_it_ends():
    """The pool plays CUDA's caching allocator: a buffer recorded on a stream waits for that stream's work."""
    c = copier()
    pool = BufferPool(c.device, DeviceMemory(), c.streams)
    buf = pool.acquire(4, torch.float32)
    buf.copy_(torch.arange(4.0))
    host = torch.zeros(4)
    c.to_host(buf, host, "grad_offload_bytes")            # still queued
    pool.release(buf)
    again = pool.acquire(4, torch.float32)
    assert again is buf and torch.equal(host, torch.arange(4.0))   # the reuse waited for the write-back
    again.fill_(7)
    c.synchronize()
    assert torch.equal(host, torch.arange(4.0))
