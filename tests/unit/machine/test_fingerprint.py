"""A machine's fingerprint tells apart CPUs a hypervisor names alike but whose instructions differ: the same
"AMD EPYC" ran bfloat16 matmuls at 1-2 GFLOP/s without AVX-512 and at 420-435 with avx512_bf16, so the rates
stored for one must not stand for the other."""

from __future__ import annotations

from sltune.machine.fingerprint import Fingerprint, isa
from sltune.store import Store
from sltune.tuning.cost.stored_rates import rates_key, stored_rates
from sltune.tuning.cost.workload import workload_of
from tests.support.rates import rates_for
from tests.support.specs import admitted_spec

# /proc/cpuinfo of the two 2-core VMs the project ran on (their flags lines, shortened to what differs and a few more)
AVX2 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse4_2 fma avx f16c avx2 smep bmi2 sha_ni\n\nprocessor\t: 1\nflags\t\t: fpu\n")
AVX512 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
          "flags\t\t: fpu sse4_2 fma avx f16c avx2 smep avx512f avx512dq avx512_bf16 avx512_vnni avx_vnni\n")
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes sve sve2 bf16 i8mm asimddp\n"


def machine(cpuinfo: str, tmp_path) -> Fingerprint:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    return Fingerprint(cpu="AMD EPYC", isa=isa(str(path)), cores=2, memory_bytes=24 << 30, torch="2.13.0+cpu")


def test_two_cpus_named_alike_with_other_instructions_are_two_machines(tmp_path):
    avx2, avx512 = machine(AVX2, tmp_path), machine(AVX512, tmp_path)
    assert avx2.isa == ("avx", "avx2", "f16c", "fma")                  # not smep, which is no vector instruction
    assert avx512.isa == ("avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512dq", "avx512f", "avx_vnni", "f16c",
                          "fma")
    assert avx2.key != avx512.key
    assert avx2.describe().startswith("AMD EPYC (avx2), 2 cores")
    assert avx512.describe().startswith("AMD EPYC (avx512_bf16/avx512f/avx2), 2 cores")
    assert machine(ARM, tmp_path).isa == ("asimd", "asimddp", "bf16", "i8mm", "sve", "sve2")
    assert isa(str(tmp_path / "missing")) == ()


def test_this_machine_s_fingerprint_carries_its_flags():
    here = Fingerprint.here()
    assert here.isa == isa()
    flags = open("/proc/cpuinfo").read()
    assert ("avx2" in flags) == ("avx2" in here.isa)


def test_rates_stored_under_another_instruction_set_are_not_this_machine_s(tmp_path):
    spec = admitted_spec({"name": "isa", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32}})
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    here = Fingerprint.here()
    other = here.model_copy(update={"isa": tuple(sorted({*here.isa, "avx512_bf16", "amx_bf16"}))})
    key = rates_key(workload_of(spec).key, "how")
    store.save_rates(other.key, key, rates_for(seq=32, fingerprint=other).model_dump(mode="json"))
    assert stored_rates(store, spec) is None
    store.save_rates(here.key, key, rates_for(seq=32, fingerprint=here).model_dump(mode="json"))
    assert stored_rates(store, spec).fingerprint == here
    # a fingerprint stored before the flags were part of it still reads, as another machine's: calibrated again
    old = Fingerprint.model_validate({k: v for k, v in here.model_dump(mode="json").items() if k != "isa"})
    assert here.isa and old.isa == () and old.key != here.key
