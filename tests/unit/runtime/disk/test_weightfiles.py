"""param_offload disk (sltune.runtime.disk.weightfiles, sltune.runtime.disk.gradwindow): each unit's dtype copy in
a file, read ahead into a bounded window before every load and rewritten when the unit steps, and its gradients in
one of a few slots from their offload to their step (spilled to a file when the step needs every gradient first).
Training equals param_offload host (both under optimizer_offload disk) to the bit; the host holds a window of units,
not the model; a damaged weights file is one line naming it."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.models.presets import load_config
from sltune.runtime.disk.files import IntegrityError
from sltune.runtime.disk.gradwindow import SLOTS
from sltune.runtime.disk.layout import padded
from tests.support.reference import adamw

SEQ = 16


def engine_for(param, folder, preset="llama-tiny", clip=None, **knobs):
    knobs = {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1, "dtype": "bfloat16", **knobs}
    cfg = SpeedLoaderConfig(**knobs, optimizer_offload="disk", param_offload=param, offload_dir=str(folder))
    return SpeedLoaderEngine(build(preset, seed=0), cfg, optimizer=adamw, max_grad_norm=clip, track_grad_norm=True)


def batches(engine, steps=3):
    rows = engine.config.effective_batch_size
    return [torch.randint(3, 512, (rows, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(steps)]


def train(param, folder, steps=3, **kw):
    engine = engine_for(param, folder, **kw)
    return engine, [engine.train_step(x) for x in batches(engine, steps)]


def assert_same(host, disk):
    (a, a_res), (b, b_res) = host, disk
    assert [r.loss for r in a_res] == [r.loss for r in b_res]
    assert len({r.loss for r in a_res}) > 1                           # the weights did move
    assert [r.grad_norm for r in a_res] == [r.grad_norm for r in b_res]
    ours, theirs = a.state_dict(), b.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    for u, v in zip(a.units, b.units):                                # the dtype copies the device loads
        if u.host is not None:
            assert torch.equal(u.host, b.params.weight_values(v)), u.name


CASES = {
    "bf16-recompute": {},
    "bf16-offload": {"activations": "offload"},
    "fp32-recompute": {"dtype": "float32"},
    "fp32-offload": {"dtype": "float32", "activations": "offload"},
    "tied": {"preset": "llama-tiny-tied"},
    "clip": {"clip": 0.05},
    "clip-fp32": {"clip": 0.05, "dtype": "float32"},
    "fp16-scaled": {"dtype": "float16"},
    "clip-offload-tied": {"clip": 0.05, "activations": "offload", "preset": "llama-tiny-tied"},
    **{f"{family}-clip": {"preset": f"{family}-tiny", "clip": 0.05} for family in ("mistral", "qwen2", "gpt2", "opt")},
    "k2-canonical": {"num_live_blocks": 2, "schedule": "canonical"},
    "bf16-no-master": {"mixed_precision": False},
}


@pytest.mark.parametrize("case", CASES)
def test_disk_weights_equal_host_weights_bit_for_bit(tmp_path, case):
    knobs = CASES[case]
    host = train("host", tmp_path, **knobs)
    disk = train("disk", tmp_path, **knobs)
    assert_same(host, disk)
    engine, results = disk
    # nothing of the weights stays in host memory between steps: the units and the Parameters hold placeholders
    assert all(u.host.untyped_storage().nbytes() <= 4 for u in engine.units if u.host is not None)
    # nor of the gradients, but in the canonical schedule (it sums every micro-batch's on the host)
    canonical = knobs.get("schedule") == "canonical"
    assert (engine.params.grads is None) == canonical
    assert all((u.host_grad is not None) == (canonical and u.has_grads) for u in engine.units)
    assert not list(engine.disk.folder.glob("g*.bin*"))         # a deferred step's spill is gone once it commits
    assert all(p.untyped_storage().nbytes() <= 4 for p in engine.model.parameters())
    # the counters: the disk tier's blocks, plus each load's weights file and each stepped unit's new copy
    assert results[-1].io == engine.expected_io(SEQ)
    host_io = host[1][-1].io
    assert results[-1].io.disk_read_bytes > host_io.disk_read_bytes
    assert results[-1].io.param_load_bytes == host_io.param_load_bytes
    # the window is host memory, and the next unit's device buffer is taken when it activates, not when its read
    # starts: the device's measured peak is no higher (host mode holds the prefetched unit beside the live one)
    assert 0 < results[0].peak_device_bytes <= host[1][0].peak_device_bytes


def test_the_window_holds_a_few_units_not_the_model(tmp_path):
    config = load_config("llama-tiny").to_dict()
    config["num_hidden_layers"] = 16
    cfg = SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2, dtype="bfloat16", optimizer_offload="disk",
                            param_offload="disk", offload_dir=str(tmp_path))
    engine = SpeedLoaderEngine(build(config, seed=0), cfg, optimizer=adamw)
    for x in batches(engine, 2):
        engine.train_step(x)
    model_bytes = sum(u.nbytes for u in engine.units)
    largest = max(padded(u.nbytes) for u in engine.units)
    window = engine.weights.peak_window_bytes
    held = sum(u.host.untyped_storage().nbytes() for u in engine.units if u.host is not None)
    assert held <= 2 * len(engine.units)                          # placeholders: one value each
    # read one phase ahead (at most the last group and the head) + the unit being copied + one stepping + two
    # written behind: at most six units, whatever the depth
    assert 0 < window <= 6 * largest
    assert window * 2 < model_bytes
    assert engine.weights.window_bytes <= window
    # the gradients: the two largest units' float32 sums at most, not the model's
    grads = engine.params.grads
    sizes = sorted((padded(u.grad_numel * 4) for u in engine.units), reverse=True)
    assert grads.budget == sum(sizes[:SLOTS]) < sum(sizes) / 4
    assert 0 < grads.peak_bytes <= grads.budget
    # between steps none (the forward needs none): no buffer held, and no optimizer view keeping one alive
    assert grads.held_bytes == 0
    assert all(s.grad is None for b in engine.disk.blocks for s in b.items)
    assert all(s.grad is None for items in engine.params.stepped.values() for s in items)


@pytest.mark.parametrize("scale", [2.0 ** 16, float("inf")])
def test_float16_overflow_drops_the_spilled_gradients_as_host_mode_does(tmp_path, scale):
    """A deferred step spills every unit's gradients before the overflow check; an overflow (the loss times a scale
    float16 cannot hold) skips the step and the spill goes, and the next step equals param_offload host's."""
    runs = {}
    for param in ("host", "disk"):
        engine = engine_for(param, tmp_path / param, dtype="float16")
        data = batches(engine, 2)
        engine.scaler.scale = scale if scale != float("inf") else 3.0e38     # the loss overflows float16
        first = engine.train_step(data[0])
        engine.scaler.scale = 1024.0
        runs[param] = (engine, [first, engine.train_step(data[1])])
        assert first.skipped == (scale == float("inf")) and not runs[param][1][1].skipped
    (host, a), (disk, b) = runs["host"], runs["disk"]
    assert [(r.loss, r.skipped, repr(r.grad_norm)) for r in a] == [(r.loss, r.skipped, repr(r.grad_norm)) for r in b]
    ours, theirs = host.state_dict(), disk.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not list(disk.disk.folder.glob("g*.bin*"))


@pytest.mark.parametrize("kept", [0.0, 0.5])
def test_generation_streams_weights_from_disk(tmp_path, kept):
    prompts = torch.randint(3, 512, (4, 6), generator=torch.Generator().manual_seed(0))
    out = {}
    for param in ("host", "disk"):
        cfg = SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=2, num_live_blocks=2, param_offload=param,
                                weights_on_device=kept, offload_dir=str(tmp_path) if param == "disk" else None)
        engine = SpeedLoaderEngine(build("llama-tiny", seed=0), cfg)
        out[param] = engine.generate(prompts, max_new_tokens=4, eos_token_id=[])
    assert torch.equal(out["host"], out["disk"])
    assert engine.weights.window_bytes <= engine.weights.peak_window_bytes < sum(u.nbytes for u in engine.units)


@pytest.mark.parametrize("dtype, clip", [("bfloat16", None), ("float32", None), ("bfloat16", 0.05)])
def test_a_failed_step_leaves_the_weights_files_as_they_were(tmp_path, dtype, clip):
    """Stepped during the backward (bf16), or after it from the spilled gradients (fp32: no master; clipping)."""
    clean, clean_res = train("disk", tmp_path, steps=3, dtype=dtype, clip=clip)
    engine = engine_for("disk", tmp_path, dtype=dtype, clip=clip)
    data = batches(engine, 3)
    results = [engine.train_step(data[0])]
    step, calls = engine.optimizer.step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:         # part-way through the units
            raise RuntimeError("injected")
        return step(*args, **kwargs)

    engine.optimizer.step = failing
    with pytest.raises(RuntimeError, match="injected"):
        engine.train_step(data[1])
    engine.optimizer.step = step
    results += [engine.train_step(x) for x in data[1:]]
    assert [r.loss for r in results] == [r.loss for r in clean_res]
    ours, theirs = engine.state_dict(), clean.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    leftovers = sorted(p.name for p in engine.weights.folder.glob("w*"))
    assert len(leftovers) == len([u for u in engine.units if u.host is not None])     # one version each
    assert not list(engine.weights.folder.glob("g*"))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_weights_file_is_one_line_naming_it(tmp_path, damage):
    engine, _ = train("disk", tmp_path, steps=1)
    path = engine.weights.path_of(engine.groups[1].unit)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[:len(data) // 2]))
    before = engine.state_dict()
    with pytest.raises(IntegrityError) as err:
        engine.train_step(batches(engine, 1)[0])
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "layers[1:2]" in message
    assert ("checksum mismatch" if damage == "flip" else "unreadable") in message
    # the failed step changed nothing: the masters are the committed ones
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
