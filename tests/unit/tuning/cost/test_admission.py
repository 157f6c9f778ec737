"""Admitting a spec (sltune.tuning.cost.admission): a backend not installed here or missing what its offload needs,
and a share of kept weights that cannot fit, refused before any trial."""

import importlib.util

import pytest

from sltune.tuning.cost.shape import shape_of
from sltune.tuning.search.state import SearchState
from sltune.tuning.search.trials import trial_spec
from sltune.tuning.space import Candidate, SearchSpace
from sltune.tuning.spec import TuningSpec
from tests.support.backend_specs import SHAPE, ds
from tests.support.deepspeed import needs_deepspeed
from tests.support.specs import admitted_spec as admitted, parse


def test_a_share_whose_kept_weights_cannot_fit_is_over_the_device_limit_before_any_trial():
    shape = shape_of("llama-tiny")
    spec = parse(workload={"mode": "generate"}, hardware={"device_memory_limit": 900_000},
                 search={"sub_batch_size": 1, "num_sub_batches": 1, "num_live_blocks": [1, 4], "kv_cache": "host"})
    with pytest.raises(ValueError) as refused:          # llama-tiny's 1001728 parameter bytes, all kept
        parse(workload=spec.workload.model_dump(), hardware={"device_memory_limit": 900_000},
              search={"weights_on_device": 1})
    assert str(refused.value) == (
        "spec: search.weights_on_device: every share keeps more on the device than hardware.device_memory_limit "
        "878.9 KiB holds: the least, 1 at num_live_blocks=1, needs 978.2 KiB (1001728 bytes) with the largest unit "
        "still streamed in; add a smaller share (0 keeps none) or raise the limit")
    state = SearchState(spec, shape, SearchSpace(spec, shape))
    assert not state.fits                                           # no trial, no fit: known from the shape
    assert state.predict(Candidate(1, 1, 1, kv_cache="host", weights_on_device=1.0)).over == ["device"]
    assert state.predict(Candidate(1, 1, 1, kv_cache="host", weights_on_device=0.5)).fits       # 632064 bytes at least
    # one group of all 4 layers does not fit in half, and streamed in it lands beside the kept embedding and head
    assert state.predict(Candidate(1, 1, 4, kv_cache="host", weights_on_device=0.5)).over == ["device"]
    assert state.predict(Candidate(1, 1, 4, kv_cache="host", weights_on_device=0.0)).fits


@needs_deepspeed
def test_nvme_without_libaio_is_refused_at_admission_and_a_trial_without_its_folder_when_it_is_built(monkeypatch):
    from sltune import backend_knobs as knobs

    nvme = {"name": "nvme", "model": {"preset": "llama-tiny"},
            "search": {"backend": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": ["none", "nvme"]}}}
    monkeypatch.setattr(knobs, "libaio_found", lambda: False)
    with pytest.raises(ValueError, match=r"^spec: search\.deepspeed\.offload_optimizer: nvme needs libaio for "
                                         r"DeepSpeed's async I/O \(apt-get install libaio-dev"):
        admitted(nvme)
    spec = TuningSpec.parse(nvme)         # parsing reads no machine: a stored job is read back anywhere
    c = ds(1, 1, stage=3, opt="nvme")
    assert c in SearchSpace(spec, SHAPE) and c.writes_files
    with pytest.raises(ValueError, match=r"search\.deepspeed\.offload_optimizer nvme needs the runner's offload "
                                         r"folder for its trial \(offload_dir\)"):
        trial_spec(spec, c, None)


def test_a_backend_that_is_not_installed_is_refused_at_admission(monkeypatch):
    from sltune.tuning.cost import admission

    real = importlib.util.find_spec
    monkeypatch.setattr(admission.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    with pytest.raises(ValueError, match=r"search\.backend: deepspeed is not installed here; install it with `bash "
                                         r"scripts/install\.sh backends`, or drop deepspeed from search\.backend"):
        admitted({"name": "x", "model": {"preset": "llama-tiny"}, "search": {"backend": ["speedloader", "deepspeed"]}})


def test_the_ray_executor_without_ray_installed_is_refused_at_admission_saying_how_to_install_it(monkeypatch):
    from sltune.tuning.cost import admission

    real = importlib.util.find_spec
    monkeypatch.setattr(admission.importlib.util, "find_spec", lambda name: None if name == "ray" else real(name))
    with pytest.raises(ValueError, match=r"hardware\.executor: ray is not installed here; install it with `pip "
                                         r"install -e '\.\[ray\]'`, or use hardware\.executor local"):
        admitted({"name": "x", "model": {"preset": "llama-tiny"}, "hardware": {"executor": "ray"}})
