"""The Copier (sltune.runtime.transfer) on the emulated device: a copy is not done until something waits for it, and
an input's load does not queue behind the next unit's parameters."""

import torch

from tests.support.runtime import copier


def test_a_copy_is_not_done_until_something_waits_for_it():
    c = copier()
    src, out = torch.arange(6.0), torch.zeros(6)
    pending = c.to_device(src, "act_load_bytes", out=out)
    assert torch.equal(out, torch.zeros(6)) and not pending.event.query()
    assert torch.equal(pending.wait(), src)
    host = torch.zeros(6)
    back = c.to_host(src * 2, host, "act_offload_bytes")
    assert torch.equal(host, torch.zeros(6))
    assert torch.equal(back.wait(), src * 2)          # a device->host result waits on the device's stream


def test_an_input_load_does_not_queue_behind_the_next_units_parameters():
    """Finding 3: parameters have a stream of their own, so waiting for an activation does not wait for the
    next unit's (much larger) parameter copy issued before it."""
    c = copier()
    params = c.to_device(torch.ones(1 << 16), "param_load_bytes")
    act = c.to_device(torch.ones(8), "act_load_bytes")
    act.wait()
    assert not params.event.query()
    kv = c.to_device(torch.ones(8), "kv_load_bytes")
    kv.wait()
    assert not params.event.query()
    params.wait()
    assert params.event is None and torch.equal(params.tensor, torch.ones(1 << 16))
