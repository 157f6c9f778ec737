"""The probes and `calibrate` (sltune.machine.calibrate): this machine's rates at a model's own shapes, each a median
with its spread, within a time budget, in the workload's dtype."""

from sltune.machine import MachineRates, Workload, calibrate

SMALL = Workload(matmuls=((64, 96), (64, 256)), rows=(16, 64), hidden=64, heads=2, head_dim=32, seq_len=16,
                 param_numels=(4096, 64))


def test_every_rate_is_a_median_between_its_slowest_and_fastest_sample(tmp_path):
    """(A budget of 2 s cut attention's 4 rows to 2 in CI beside other work: each probe's first call must take at most a
    fifth of its share.)"""
    rates = calibrate(SMALL, budget_s=5, offload_dir=tmp_path)
    every = ([m.flops for m in rates.matmul] + [a.flops for a in rates.attention] + list(rates.elementwise.values())
             + list(rates.norm.values()) + list(rates.optimizer.values()) + list(rates.copies.values())
             + list(rates.disk.values()) + [rates.op_overhead])
    assert len(every) == 8 + 2 + 1 + 1 + 1 + 2 + 2 + 1        # matmuls: 4 forward, 4 weight gradients
    assert all(r.low <= r.median <= r.high and r.samples >= 3 for r in every)
    forward = {(16, 64, 96), (64, 64, 96), (16, 64, 256), (64, 64, 256)}
    weight_grads = {(n, rows, k) for rows, k, n in forward}         # n x rows @ rows x k: reduced over the rows
    assert {(m.rows, m.k, m.n) for m in rates.matmul} == forward | weight_grads
    assert [a.batch for a in rates.attention] == [1, 4]                  # rows / seq_len
    assert set(rates.disk) == {"write", "read"} and set(rates.copies) == {"host", "host.fresh"}
    assert not list(tmp_path.iterdir())                                  # the disk probe's folder is gone
    assert MachineRates.model_validate_json(rates.model_dump_json()) == rates


def test_a_matmul_too_slow_for_its_share_of_the_budget_is_timed_on_fewer_rows_and_says_so():
    """4096 x 2048 @ 2048 x 2048 is 34 GFLOP, a third of a second or more on any CPU: a 0.1 s budget cannot hold it,
    so fewer rows are timed and the entry names them, and a second row count cut to the same size is not timed
    twice. The whole takes a warm-up and 3 samples per probe: a second or two, not the full matmul's."""
    rates = calibrate(Workload(matmuls=((2048, 2048),), rows=(2048, 4096), hidden=256, heads=2, head_dim=128,
                               seq_len=64, param_numels=(4096,)), budget_s=0.1)
    (m,) = [m for m in rates.matmul if (m.k, m.n) == (2048, 2048)]
    assert 8 <= m.rows < 2048
    # the weight's gradient over 4096 rows (2048 x 4096 @ 4096 x 2048), cut the same way
    assert {(m.k, m.n) for m in rates.matmul} == {(2048, 2048), (4096, 2048)}
    assert rates.seconds < 10


def test_a_generate_workload_times_its_decode_steps_and_no_backward():
    """At a generate spec's workload: the matmuls at the decode steps' rows too (a sub-batch's rows), attention of one
    position over kv_len, and no weight gradient (generation has no backward). Its key is its own; a training
    workload's is what it was before the generation fields existed."""
    import dataclasses
    import hashlib
    import json

    generate = dataclasses.replace(SMALL, decode_rows=(1, 4), kv_len=24)
    rates = calibrate(generate, budget_s=5)
    timed = {(m.rows, m.k, m.n) for m in rates.matmul}
    # the decode steps' rows for every weight; the prefill's rows too, on fewer where a busy machine's share of the
    # budget cannot hold them (CI beside other work cut 16 and 64 rows to 8); never a weight's gradient (n, rows, k)
    assert {(r, k, n) for r in (1, 4) for k, n in SMALL.matmuls} <= timed
    assert {(k, n) for _, k, n in timed} == set(SMALL.matmuls) and all(rows <= 64 for rows, _, _ in timed)
    assert [(a.batch, a.past) for a in rates.decode_attention] == [(1, 24), (4, 24)]
    assert all(a.flops.low <= a.flops.median <= a.flops.high for a in rates.decode_attention)
    assert generate.key != SMALL.key
    fields = {k: v for k, v in dataclasses.asdict(SMALL).items() if k not in ("decode_rows", "kv_len")}
    assert SMALL.key == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def test_the_rates_are_the_dtype_s_own():
    """A bfloat16 matmul is not a float32 one (on a CPU without bf16 instructions a hundredth of its rate): the
    workload's dtype is what is timed, and it keys the stored rates apart."""
    bf16 = Workload(matmuls=((64, 64),), rows=(16,), hidden=64, heads=2, head_dim=32, seq_len=16, dtype="bfloat16")
    rates = calibrate(bf16, budget_s=1)
    assert {m.dtype for m in rates.matmul} == {"bfloat16"} and set(rates.norm) == {"bfloat16"}
    assert bf16.key != Workload(**{**bf16.__dict__, "dtype": "float32"}).key


def test_elementwise_work_is_timed_on_inputs_no_call_read_since_the_ring_came_round():
    """The elementwise and norm probes read a new stretch of RING_BYTES each call, as a step reads its activations
    from memory (one pair of tensors used again and again is read from the cache: 2-3x faster on 2 cores)."""
    import torch

    from sltune.machine.probes import RING_BYTES, cold_inputs

    sets = cold_inputs(2, 64, 96, torch.float32, torch.device("cpu"))
    tensors = [t for s in sets for t in s]
    assert all(len(s) == 2 and t.shape == (64, 96) for s in sets for t in s)
    assert sum(t.numel() * t.element_size() for t in tensors) >= RING_BYTES - 2 * 64 * 96 * 4
    starts = sorted(t.data_ptr() for t in tensors)
    assert all(b - a >= 64 * 96 * 4 for a, b in zip(starts, starts[1:]))        # none overlaps another
