"""Writes examples/rates/a100-pcie4-nvme.json, the rates of a GPU server this project cannot measure, for `sltune plan
SPEC --machine examples/rates/a100-pcie4-nvme.json` (a what-if). Every figure is a published peak times an assumed
efficiency: examples/rates/README.md gives each one's source. Run it again after changing an assumption:

    python examples/rates/make_a100.py [OUT.json]
"""

import sys
from datetime import datetime, timezone

from sltune.machine.fingerprint import Fingerprint
from sltune.machine.rates import AttentionRate, DecodeAttentionRate, MachineRates, MatmulRate, Rate


def r(median: float, unit: str, spread: float = 0.1) -> Rate:
    """A figure as a rate: no samples behind it, so an interval of +-10% stands for what a real machine varies."""
    return Rate(median=median, low=median * (1 - spread), high=median * (1 + spread), samples=1, unit=unit)


PEAK = {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}   # A100 datasheet, dense (fp32 without TF32)
EFFICIENCY = {128: 0.35, 512: 0.55, 2048: 0.7, 8192: 0.75}             # assumed: a GEMM's share of peak by rows
SHAPES = [(512, 512), (896, 896), (896, 4864), (4864, 896), (1024, 1024), (2048, 2048), (2048, 8192),
          (8192, 2048), (4096, 4096), (4096, 11008), (11008, 4096), (4096, 32000), (896, 151936)]
matmul = [MatmulRate(rows=rows, k=k, n=n, dtype=d, flops=r(PEAK[d] * eff, "FLOP"))
          for d in PEAK for (k, n) in SHAPES for rows, eff in EFFICIENCY.items()]
attention = [AttentionRate(batch=b, heads=32, seq=2048, head_dim=128, dtype=d, flops=r(PEAK[d] * eff, "FLOP"))
             for d in PEAK for b, eff in ((1, 0.35), (8, 0.5))]               # FlashAttention-2 reaches ~0.5-0.7
HBM = 1555e9 * 0.8                                                           # datasheet; 80% achieved, assumed
# generation's decode step reads every weight (and the keys and values) once for a few rows: bound by HBM, not the
# tensor cores. A matmul of r rows moves k x n x itemsize bytes for 2 x r x k x n FLOP; attention 4 FLOP a position
# and head dim for 2 x itemsize bytes
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
matmul += [MatmulRate(rows=rows, k=k, n=n, dtype=d, flops=r(min(PEAK[d] * 0.35, 2 * rows * HBM / ITEMSIZE[d]), "FLOP"))
           for d in PEAK for (k, n) in SHAPES for rows in (1, 8, 32)]
decode_attention = [DecodeAttentionRate(batch=b, heads=32, past=2048, head_dim=128, dtype=d,
                                        flops=r(2 * HBM / ITEMSIZE[d], "FLOP")) for d in PEAK for b in (1, 8)]
elementwise = {d: r(HBM / (3 * s), "elements") for d, s in (("bfloat16", 2), ("float16", 2), ("float32", 4))}
norm = {d: r(HBM / (2 * s), "elements") for d, s in (("bfloat16", 2), ("float16", 2), ("float32", 4))}
DDR = 204.8e9 * 0.6            # 8 channels of DDR4-3200 (EPYC 7003 datasheet); 60% achieved, assumed
optimizer = {"torch.adamw": r(DDR / 28, "elements"), "deepspeed.cpu_adam": r(DDR / 28, "elements")}
copies = {"h2d.pinned": r(25e9, "bytes"), "d2h.pinned": r(25e9, "bytes"),      # PCIe 4.0 x16: 32 GB/s a direction
          "h2d.pageable": r(12e9, "bytes"), "d2h.pageable": r(12e9, "bytes")}
disk = {"read": r(7.45e9, "bytes"), "write": r(6.9e9, "bytes")}               # Samsung 990 PRO datasheet


rates = MachineRates(
    fingerprint=Fingerprint(cpu="example: AMD EPYC 7003 host with NVIDIA A100 40GB PCIe and a PCIe 4.0 NVMe "
                                "(published figures, examples/rates/README.md)",
                            isa=("avx", "avx2", "f16c", "fma"),          # Zen 3: AVX2 and FMA, no AVX-512
                            cores=32, memory_bytes=512 << 30, gpus=("NVIDIA A100-PCIE-40GB",), torch="example"),
    measured_at=datetime(2026, 11, 29, tzinfo=timezone.utc), seconds=0.0, device="cuda:0", threads=32,
    matmul=matmul, attention=attention, decode_attention=decode_attention, elementwise=elementwise, norm=norm,
    optimizer=optimizer, copies=copies, disk=disk, disk_direct=True, op_overhead=r(1e5, "ops"))

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "examples/rates/a100-pcie4-nvme.json"
    rates.save(out)
    print(f"{out}: {len(matmul)} matmuls, {len(attention)} attention shapes")
