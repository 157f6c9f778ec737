"""Generation (sltune.runtime.generate): the same tokens as transformers' own generate, on every family and schedule,
with the parameter and KV traffic the SpeedLoader schedule promises, and without transformers' deprecation
warnings."""

from __future__ import annotations

import warnings
from functools import cache

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime.kvcache import StagedHostKV
from sltune.runtime.memory import DeviceMemoryExceeded
from tests.support.runtime import PAD

PRESETS = ["llama-tiny", "llama-tiny-tied", "mistral-tiny", "qwen2-tiny", "gpt2-tiny", "opt-tiny"]
SCHEDULES = ["speedloader", "canonical", "resident"]
PLACEMENTS = [("speedloader", "host"), ("speedloader", "device"), ("canonical", "host"),
              ("resident", "device")]     # resident keeps its caches on the device whatever kv_cache says
K = {"speedloader": 3, "canonical": 1, "resident": 2}   # 3 of 4 layers: groups of unequal size
B, N = 2, 2
PROMPT, NEW = 10, 10          # 20 positions: past the sliding window (16) of mistral-tiny and qwen2-tiny


def prompts(rows: int = B * N, length: int = PROMPT, padded: bool = True, seed: int = 0):
    """Random prompts; padded: left padding of unequal length (one row unpadded), pad ids under the mask."""
    ids = torch.randint(3, 512, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if padded:
        for r in range(rows):
            mask[r, :(3 * r) % (length - 1)] = 0
        ids = ids.masked_fill(mask == 0, PAD)
    return ids, mask


def engine(preset: str, schedule: str = "speedloader", b: int = B, n: int = N, k: int = 1,
           tracking: str = "never", kv_cache: str = "host", weights: float = 0.0,
           limit: str | None = None) -> SpeedLoaderEngine:
    """tracking="never" by default: measuring device memory costs ~25 us per op, and only one test needs it."""
    cfg = SpeedLoaderConfig(sub_batch_size=b, num_sub_batches=n, num_live_blocks=k, schedule=schedule,
                            memory_tracking=tracking, kv_cache=kv_cache, weights_on_device=weights,
                            device_memory_limit=limit)
    return SpeedLoaderEngine(build(preset), cfg, optimizer=None)


@cache
def reference(preset: str, padded: bool, length: int = PROMPT, new: int = NEW, eos: int | None = None) -> torch.Tensor:
    ids, mask = prompts(length=length, padded=padded)
    kw = {} if eos is None else {"eos_token_id": eos}
    return build(preset).generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  pad_token_id=PAD, **kw)


@pytest.mark.parametrize("schedule,kv_cache", PLACEMENTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_transformers_with_left_padding(preset, schedule, kv_cache):
    ids, mask = prompts(padded=True)
    out = engine(preset, schedule, k=K[schedule], kv_cache=kv_cache).generate(
        ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD)
    expected = reference(preset, padded=True)
    assert out.dtype == torch.long and out.shape == expected.shape
    assert torch.equal(out, expected), f"{preset}/{schedule}/{kv_cache}:\n{out[:, PROMPT:]}\n{expected[:, PROMPT:]}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_tokens_equal_transformers_with_equal_length_prompts(preset, schedule):
    ids, _ = prompts(padded=False)
    out = engine(preset, schedule, k=K[schedule]).generate(ids, max_new_tokens=NEW, pad_token_id=PAD)
    assert torch.equal(out, reference(preset, padded=False))
    assert torch.equal(out[:, :PROMPT], ids)


@pytest.mark.parametrize("preset", ["mistral-tiny", "qwen2-tiny"])
def test_prompt_longer_than_the_sliding_window(preset):
    ids, mask = prompts(length=20, padded=True)
    out = engine(preset, n=N, k=1).generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD)
    assert torch.equal(out, reference(preset, padded=True, length=20, new=6))


def test_rows_that_reach_eos_continue_with_pad_as_in_transformers():
    ids, mask = prompts(padded=True)
    greedy = reference("llama-tiny", padded=True)
    eos = int(greedy[1, PROMPT + 2])          # row 1 ends after its third new token
    out = engine("llama-tiny", n=N).generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
                                             pad_token_id=PAD)
    assert torch.equal(out, reference("llama-tiny", padded=True, eos=eos))
    assert (out[1, PROMPT + 3:] == PAD).all()


def test_an_eos_outside_the_vocabulary_warns_and_generates_as_transformers_does():
    ids, mask = prompts(padded=True)
    eos = 512 + 5                             # llama-tiny's vocabulary is 512: no row can ever produce it
    with pytest.warns(UserWarning, match=r"eos_token_id 517 is not a token id in \[0, 512\)"):
        out = engine("llama-tiny").generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
                                            pad_token_id=PAD)
    assert torch.equal(out, reference("llama-tiny", padded=True, eos=eos))


def test_seeded_sampling_is_reproducible_and_the_same_on_every_schedule():
    ids, mask = prompts(padded=True)

    def sample(schedule: str, seed: int) -> torch.Tensor:
        return engine("qwen2-tiny", schedule, k=K[schedule]).generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=40,
            generator=torch.Generator().manual_seed(seed), eos_token_id=[])

    first = sample("speedloader", 7)
    assert torch.equal(first, sample("speedloader", 7))
    assert torch.equal(first, sample("canonical", 7)) and torch.equal(first, sample("resident", 7))
    assert not torch.equal(first, sample("speedloader", 8))
    top1 = engine("qwen2-tiny").generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=1,
                                        generator=torch.Generator().manual_seed(0), pad_token_id=PAD)
    assert torch.equal(top1, reference("qwen2-tiny", padded=True))   # top_k=1 leaves only the argmax


def kv_bytes_per_position(eng: SpeedLoaderEngine, rows: int) -> int:
    """Keys and values of one position of every layer and row, float32: 2*L*b*N*kvh*d*e."""
    cfg = eng.lm.config
    return rows * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4


def decode_io(preset: str, schedule: str, n: int, k: int = 1, new: int = 4, tracking: str = "never",
              kv_cache: str = "host", staged: bool = False, weights: float = 0.0):
    """One generate call of n rows (b=1); staged: the StagedHostKV placement a CUDA device gets for `host`."""
    eng = engine(preset, schedule, b=1, n=n, k=k, tracking=tracking, kv_cache=kv_cache, weights=weights)
    if staged:
        eng.kv = StagedHostKV(eng.copier, eng.pool, eng.memory)
    ids, _ = prompts(rows=n, padded=False)
    out = eng.generate(ids, max_new_tokens=new, eos_token_id=[])
    return eng, eng.last_generation, out


@pytest.mark.parametrize("preset,k", [("llama-tiny", 1), ("llama-tiny-tied", 3), ("opt-tiny", 2)])
def test_parameter_loads_per_decode_step_do_not_grow_with_n(preset, k):
    eng, one, _ = decode_io(preset, "speedloader", n=1, k=k)
    _, four, _ = decode_io(preset, "speedloader", n=4, k=k)
    assert len(one.step_io) == len(four.step_io) == 4
    for step in range(1, 4):
        assert one.step_io[step].param_load_bytes == four.step_io[step].param_load_bytes == eng.param_bytes
    _, canon1, _ = decode_io(preset, "canonical", n=1, k=k)
    _, canon4, _ = decode_io(preset, "canonical", n=4, k=k, kv_cache="device")
    assert canon4.step_io[2].param_load_bytes == 4 * canon1.step_io[2].param_load_bytes == 4 * eng.param_bytes
    assert canon4.io.kv_load_bytes == canon4.io.kv_offload_bytes == 0


def test_kv_traffic_equals_the_documented_formulas():
    """host: the new positions go to the host, the past is never re-read (kv_offload = N*q*2*L*b*kvh*d*e,
    kv_load = 0); device: no KV traffic, the whole cache in device memory instead."""
    n, new = 4, 4
    eng, host, out = decode_io("llama-tiny", "speedloader", n=n, k=3, new=new, tracking="first")
    per_position = kv_bytes_per_position(eng, rows=n)
    assert [io.kv_offload_bytes for io in host.step_io] == [PROMPT * per_position] + [per_position] * (new - 1)
    assert host.io.kv_load_bytes == 0
    for step in range(1, new):
        assert host.step_io[step].act_offload_bytes == host.step_io[step].act_load_bytes > 0
    _, device, dev_out = decode_io("llama-tiny", "speedloader", n=n, k=3, new=new, tracking="first",
                                   kv_cache="device")
    assert device.io.kv_load_bytes == device.io.kv_offload_bytes == 0
    assert device.io.param_load_bytes == host.io.param_load_bytes > 0
    assert device.peak_device_bytes - host.peak_device_bytes == (PROMPT + new) * per_position
    _, resident, _ = decode_io("llama-tiny", "resident", n=n, k=3, new=new, tracking="first", kv_cache="host")
    assert resident.io.kv_load_bytes == resident.io.kv_offload_bytes == resident.io.param_load_bytes == 0
    assert host.peak_device_bytes < device.peak_device_bytes < resident.peak_device_bytes
    assert torch.equal(out, dev_out)


def test_staged_host_cache_loads_the_visible_past_and_writes_new_positions():
    """The placement `host` takes beside a CUDA device, run on the CPU: per step the past each layer
    attends to comes in (a sliding layer's at most window-1 positions) and the new position goes out."""
    n, new = 2, 12                       # past reaches 10 + 11 = 21 > window 16
    eng, stats, out = decode_io("mistral-tiny", "speedloader", n=n, new=new, staged=True)
    window = eng.lm.config.sliding_window
    per_position = kv_bytes_per_position(eng, rows=n)
    loaded = [io.kv_load_bytes for io in stats.step_io]
    assert loaded == [0] + [min(PROMPT + step - 1, window - 1) * per_position for step in range(1, new)]
    assert [io.kv_offload_bytes for io in stats.step_io] == [PROMPT * per_position] + [per_position] * (new - 1)
    _, _, delegated = decode_io("mistral-tiny", "speedloader", n=n, new=new)
    assert torch.equal(out, delegated)


KEPT = [("speedloader", 0.5, "host"), ("speedloader", 1.0, "device"), ("canonical", 0.5, "host")]


@pytest.mark.parametrize("schedule,weights,kv_cache", KEPT)
@pytest.mark.parametrize("preset", PRESETS)
def test_weights_kept_on_the_device_give_the_same_tokens(preset, schedule, weights, kv_cache):
    ids, mask = prompts(padded=True)
    eng = engine(preset, schedule, k=K[schedule], kv_cache=kv_cache, weights=weights)
    assert eng.kept_units, "the share keeps at least one unit"
    out = eng.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD)
    assert torch.equal(out, reference(preset, padded=True)), f"{preset}/{schedule}/{weights}"
    for unit in eng.units:          # after the call every unit is back home, no device buffer held
        assert unit.dev is None and all(p.data.data_ptr() != 0 for p in unit.params)
    assert eng.memory.live == 0


@pytest.mark.parametrize("preset,k", [("llama-tiny", 1), ("llama-tiny-tied", 3)])
def test_kept_weights_load_once_per_call_and_cost_their_bytes_in_device_memory(preset, k):
    """param_load over a call of T steps: speedloader sum_u P_u + (T-1)*streamed, canonical kept +
    T*N*streamed; the device peak grows by what is kept."""
    n, new = 3, 4
    eng, none, out = decode_io(preset, "speedloader", n=n, k=k, new=new, tracking="first")
    for share in (0.5, 1.0):
        kept_eng, kept, kept_out = decode_io(preset, "speedloader", n=n, k=k, new=new, tracking="first",
                                             weights=share)
        kept_bytes = sum(u.nbytes for u in kept_eng.kept_units)
        assert 0 < kept_bytes <= share * eng.param_bytes
        assert [io.param_load_bytes for io in kept.step_io] == \
            [eng.param_bytes] + [eng.param_bytes - kept_bytes] * (new - 1)
        assert torch.equal(out, kept_out)
        # the kept units are all live at once; at share 0 the one live unit was already counted
        assert kept.peak_device_bytes > kept_bytes
        assert 0 < kept.peak_device_bytes - none.peak_device_bytes <= kept_bytes
        _, canon, _ = decode_io(preset, "canonical", n=n, k=k, new=new, weights=share)
        assert canon.io.param_load_bytes == kept_bytes + new * n * (eng.param_bytes - kept_bytes)
    assert kept.step_io[-1].param_load_bytes == 0      # share 1: after the prefill nothing moves


def test_a_share_of_weights_over_the_device_limit_fails_cleanly_and_the_engine_recovers():
    ids, _ = prompts(padded=False)
    probe = engine("llama-tiny", tracking="first", weights=1.0)
    probe.generate(ids, max_new_tokens=2)
    need = probe.last_generation.peak_device_bytes
    eng = engine("llama-tiny", tracking="first", weights=1.0, limit=str(need * 3 // 4))
    with pytest.raises(DeviceMemoryExceeded, match="device memory limit exceeded"):
        eng.generate(ids, max_new_tokens=2)
    assert all(u.dev is None for u in eng.units) and eng.memory.live == 0
    streamed = SpeedLoaderEngine(eng.model, eng.config.replace(weights_on_device=0.0), optimizer=None)
    assert torch.equal(streamed.generate(ids, max_new_tokens=2), probe.generate(ids, max_new_tokens=2))


def test_wrong_row_count_and_bad_prompts_are_clear_errors():
    eng = engine("llama-tiny", b=2, n=2)
    with pytest.raises(ValueError, match=r"input_ids has 3 rows but sub_batch_size\*num_sub_batches = 2\*2 = 4"):
        eng.generate(torch.randint(3, 512, (3, 5)))
    ids = torch.randint(3, 512, (4, 5))
    right_padded = torch.ones_like(ids)
    right_padded[0, -2:] = 0
    with pytest.raises(ValueError, match="pad prompts on the left"):
        eng.generate(ids, attention_mask=right_padded)
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        eng.generate(ids, max_new_tokens=510)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        eng.generate(ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        eng.generate(ids, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="optimizer=None and can only generate"):
        eng.train_step(ids)


@pytest.mark.parametrize("preset", ["llama-tiny", "mistral-tiny", "qwen2-tiny", "gpt2-tiny", "opt-tiny"])
def test_engine_generate_emits_no_future_or_deprecation_warning(preset):
    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
    from sltune.models import build

    engine = SpeedLoaderEngine(build(preset), SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2,
                                                                num_live_blocks=1), optimizer=None)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=0)
    assert out.shape == (2, 8)
    loud = [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert loud == []
