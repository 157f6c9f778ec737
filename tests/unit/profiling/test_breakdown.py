"""The CUDA breakdown on synthetic Kineto events (no GPU here): what a profiled step on a GPU reports, with
the answer computed by hand."""

import pytest

from sltune.profiling.breakdown import Event, attribute

MAIN, AUTOGRAD = 1, 2


def host(start, end, name, thread=MAIN):
    return Event(start, end, name, thread, False)


def dev(start, end, name):
    return Event(start, end, name, 0, True)


EVENTS = [
    # the step's thread: regions and operators
    host(0, 1000, "sltune.step"),
    host(40, 110, "sltune.all_gather.layers[0:1]"),
    host(100, 400, "sltune.compute.fwd"),
    host(110, 390, "aten::linear"),
    host(120, 380, "aten::mm"),
    # autograd's device thread runs the backward's operators
    host(490, 600, "autograd::engine::evaluate_function: MmBackward0", AUTOGRAD),
    host(500, 560, "aten::mm", AUTOGRAD),
    host(1200, 1300, "aten::mm", AUTOGRAD),                       # after the step: not counted
    # Kineto mirrors record_function regions on the device as user annotations: not kernels
    dev(0, 1000, "sltune.step"),
    dev(100, 400, "sltune.compute.fwd"),
    dev(40, 110, "sltune.all_gather.layers[0:1]"),
    # kernels
    dev(50, 100, "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"),
    dev(100, 300, "ampere_sgemm_128x64_nn"),
    dev(250, 350, "Memcpy HtoD (Pinned -> Device)"),
    dev(400, 450, "Memcpy DtoH (Device -> Pinned)"),
    dev(450, 470, "Memcpy DtoD (Device -> Device)"),
    dev(470, 480, "Memset (Device)"),
    dev(500, 600, "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"),
    dev(700, 780, "ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclWorkElem)"),
    dev(800, 820, "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"),
    dev(820, 830, "ncclDevKernel_Broadcast_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"),
    dev(990, 1100, "ampere_sgemm_32x32_tn"),                      # runs past the step: 10 ns inside
]


def test_device_kernels_are_classified_by_kind_and_the_runtimes_labels_are_not_kernels():
    bd = attribute(EVENTS)
    ns = {k: round(v * 1e9) for k, v in bd.seconds.items()}
    # by hand, in ns within [0, 1000]:
    #   compute  sgemm 100-300, DtoD 450-470, memset 470-480, fill 500-600, sgemm 990-1000 -> 200+20+10+100+10
    #   memcpy   HtoD 250-350, DtoH 400-450                                           -> 100+50
    #   all_gather 50-100; reduce_scatter 700-780; other: all-reduce 800-820, broadcast 820-830
    #   busy     50-350, 400-480, 500-600, 700-780, 800-830, 990-1000 -> 300+80+100+80+30+10 = 600; cpu = 400
    assert ns == {"compute": 340, "memcpy": 150, "cpu": 400, "all_gather": 50, "reduce_scatter": 80, "disk": 0,
                  "other": 30}
    total = 340 + 150 + 400 + 50 + 80 + 30
    assert bd.fractions["compute"] == pytest.approx(340 / total)
    assert bd.fractions["cpu"] == pytest.approx(400 / total)
    assert sum(bd.fractions.values()) == pytest.approx(1.0)
    assert bd.wall_seconds == pytest.approx(1000e-9)


def test_top_ops_include_the_backward_on_autograds_thread():
    ops = {op["name"]: op for op in attribute(EVENTS).top_ops}
    assert ops["aten::mm"]["count"] == 2                             # 120-380 forward, 500-560 backward
    assert round(ops["aten::mm"]["self_seconds"] * 1e9) == 260 + 60
    assert round(ops["autograd::engine::evaluate_function: MmBackward0"]["self_seconds"] * 1e9) == 110 - 60
    assert not any(name.startswith("sltune.") for name in ops)


def test_the_share_of_copy_time_hidden_under_compute():
    """Copies 250-350 and 400-450 (150 ns); compute kernels cover 250-300 of them: a third is hidden."""
    assert attribute(EVENTS).copy_hidden == pytest.approx(50 / 150)
    assert attribute([e for e in EVENTS if not e.name.startswith("Memcpy")]).copy_hidden is None
    assert attribute([e for e in EVENTS if not e.on_device]).copy_hidden is None     # the CPU: no device timeline
