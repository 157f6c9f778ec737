"""SpeedLoaderConfig (sltune.config): validation messages, the YAML a tuning job exports, and each knob declared in
one place."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import sltune
from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.cli.main import main
from sltune.models import build
from sltune.profiling.schema import TrialSpec
from tests.support.reference import adamw


def test_yaml_round_trip_with_report_sections(tmp_path):
    cfg = SpeedLoaderConfig(sub_batch_size=4, num_sub_batches=8, num_live_blocks=2, device_memory_limit="1GiB")
    path = tmp_path / "best.yaml"
    cfg.to_yaml(path, measured={"tokens_per_s": 123.4}, provenance={"job_id": "abc"})
    data = yaml.safe_load(path.read_text())
    assert data["effective_batch_size"] == 32 and data["measured"]["tokens_per_s"] == 123.4
    assert SpeedLoaderConfig.from_yaml(path) == cfg


def test_from_yaml_names_a_misspelt_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sub_batch_size: 2\nnum_live_block: 3\n")
    with pytest.raises(ValueError, match=r"bad.yaml: num_live_block: unknown field.*num_live_blocks"):
        SpeedLoaderConfig.from_yaml(path)


def test_from_yaml_checks_the_effective_batch(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sub_batch_size: 2\nnum_sub_batches: 4\neffective_batch_size: 16\n")
    with pytest.raises(ValueError, match="effective_batch_size 16 != sub_batch_size"):
        SpeedLoaderConfig.from_yaml(path)


def test_bad_sizes_say_how_to_write_them():
    with pytest.raises(ValueError, match="2GiB"):
        SpeedLoaderConfig(device_memory_limit="two gigs")
    with pytest.raises(ValueError, match="schedule"):
        SpeedLoaderConfig(schedule="zero3")


def test_to_yaml_rejects_unknown_sections():
    with pytest.raises(ValueError, match="unknown sections"):
        SpeedLoaderConfig().to_yaml(extra={"x": 1})


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.5, 0, -3, "0.1B", "inf GiB"])
def test_sizes_must_be_whole_positive_bytes(value):
    with pytest.raises(ValueError, match="device_memory_limit"):
        SpeedLoaderConfig(device_memory_limit=value)


# -- each knob declared once ----------------------------------------------------------------------------------------
ADDED = '''
    test_knob: Annotated[int, Knob()] = Field(3, ge=1, description="a knob a test adds, in this one place")
    test_engine_knob: Annotated[str, Knob(speedloader=True)] = Field(
        "plain", description="a knob of SpeedLoader's engine alone, added by a test")

'''
ADDED_BACKEND = '''    test_fsdp_knob: bool | None = backend_knob(
        "fsdp", False, search=(False, True), doc="a knob of the fsdp backend a test adds")
'''
ONE_PLACE = '''
import importlib.util, json, sys
import sltune
assert sltune.__file__.startswith(sys.argv[1]), sltune.__file__       # the copy with the added knobs
from sltune.cli import common, profile
from sltune.cli.flags import given
from sltune.cli.main import parser
from sltune.config import SpeedLoaderConfig
from sltune.profiling.schema import SPEEDLOADER_ONLY, TrialConfig, TrialSpec
from sltune.tuning.spec import TuningSpec

found = {}
top = parser()
spec = TrialSpec(**given(top.parse_args(["profile", "--test-knob", "5", "--test-engine-knob", "fast"]), profile.KNOBS))
found["profile flag -> trial spec"] = (spec.test_knob, spec.test_engine_knob)
found["trial result"] = TrialConfig.model_validate(spec.knobs()).model_dump(include={"test_knob", "test_engine_knob"})
other = TrialSpec(backend="fsdp", test_knob=6)
found["another backend's result"] = TrialConfig.model_validate(other.knobs()).model_dump(
    include={"test_knob", "test_engine_knob"})
try:
    TrialSpec(backend="fsdp", test_engine_knob="fast")
except ValueError as err:
    found["another backend refuses"] = "test_engine_knob: 'fast' is SpeedLoader's" in str(err)
found["speedloader only"] = SPEEDLOADER_ONLY.get("test_engine_knob")
cfg = common.config_from_args(top.parse_args(["train", "--test-knob", "7"]))
found["train flag -> best.yaml"] = "test_knob: 7" in cfg.to_yaml()
found["best.yaml -> config"] = SpeedLoaderConfig.from_dict({"test_knob": 8}).test_knob
try:
    common.config_from_args(top.parse_args(["train", "--test-knob", "0"]))
except ValueError as err:
    found["a bad value names the flag"] = str(err)
fsdp = TrialSpec(**given(top.parse_args(["profile", "--backend", "fsdp", "--test-fsdp-knob"]), profile.KNOBS))
found["backend knob: flag -> trial spec -> result"] = [fsdp.test_fsdp_knob, TrialConfig.model_validate(
    fsdp.knobs()).test_fsdp_knob, TrialSpec(backend="fsdp").test_fsdp_knob]
try:
    TrialSpec(backend="deepspeed", test_fsdp_knob=True)
except ValueError as err:
    found["another backend refuses it"] = "test_fsdp_knob: an fsdp knob; add backend fsdp" in str(err)
search = TuningSpec.model_validate({"model": {"preset": "llama-tiny"}, "search": {"backend": "fsdp"}}).search
found["a search sweeps it"] = [len(search.backend_variants("fsdp")), TuningSpec.model_validate(
    {"model": {"preset": "llama-tiny"}, "search": {"backend": "fsdp", "fsdp": {"test_fsdp_knob": True}}}
).search.fsdp.test_fsdp_knob]
hook_spec = importlib.util.spec_from_file_location("reference_hook", sys.argv[2])
hook = importlib.util.module_from_spec(hook_spec)
hook_spec.loader.exec_module(hook)
found["docs"] = ["| `test_knob` |" in hook.config(), "| `test_knob` |" in hook.trial_result(),
                 "`--test-knob` | a knob a test adds, in this one place (default: 3)" in hook.cli(),
                 "`--test-knob` | a knob a test adds, in this one place (default: the --config file's, else 3)"
                 in hook.cli(), "a knob of the fsdp backend a test adds; a value or a list, default [false, true]"
                 in hook.spec()]
print(json.dumps(found))
'''


def test_a_knob_declared_in_one_place_is_a_flag_a_trial_field_a_result_field_and_documented(tmp_path):
    """The house's rule for knobs: declared once, in RuntimeKnobs (a backend's, in BackendKnobs), everything else
    derived. A copy of the package gets two knobs added to RuntimeKnobs and one to BackendKnobs, and nowhere else;
    `profile` and `train` take them as flags, a trial's spec runs them and its result records them (None for
    SpeedLoader's own under another backend, which refuses another value; the backend's knob its default when left
    out, refused under another backend), best.yaml writes and reads them, a job's search sweeps the backend's knob
    over its declared values, and the reference pages document them."""
    root = Path(sltune.__file__).parents[1]
    shutil.copytree(root / "sltune", tmp_path / "sltune", ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "sltune" / "config.py"
    text = config.read_text()
    anchor = '    @field_validator("device")\n'
    assert text.count(anchor) == 1, "RuntimeKnobs' first validator moved: add the knobs before another line"
    config.write_text(text.replace(anchor, ADDED + anchor))
    knobs = tmp_path / "sltune" / "backend_knobs.py"
    text = knobs.read_text()
    anchor = "\n\n# what follows from the declarations above"
    assert text.count(anchor) == 1, "BackendKnobs' last field moved: add the backend knob after another line"
    knobs.write_text(text.replace(anchor, "\n" + ADDED_BACKEND.rstrip("\n") + anchor))
    run = subprocess.run([sys.executable, "-c", ONE_PLACE, str(tmp_path),
                          str(root / "docs" / "hooks" / "reference.py")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "COLUMNS": "100"})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {
        "profile flag -> trial spec": [5, "fast"],
        "trial result": {"test_knob": 5, "test_engine_knob": "fast"},
        "another backend's result": {"test_knob": 6, "test_engine_knob": None},
        "another backend refuses": True,
        "speedloader only": "plain",
        "train flag -> best.yaml": True,
        "best.yaml -> config": 8,
        "a bad value names the flag": "--test-knob: Input should be greater than or equal to 1",
        "backend knob: flag -> trial spec -> result": [True, True, False],
        "another backend refuses it": True,
        "a search sweeps it": [4, [True]],
        "docs": [True, True, True, True, True],
    }


def test_bad_knobs_are_one_line_naming_the_fix(tmp_path, capsys):
    for knobs, fix in [({}, "offload_dir: param_offload disk keeps the weights' files there; give a directory"),
                       ({"offload_dir": "x", "schedule": "resident"},
                        "param_offload disk: the resident schedule keeps every weight on the device; use param_offload "
                        "host")]:
        with pytest.raises(ValueError) as err:
            SpeedLoaderConfig.from_dict({"param_offload": "disk", **knobs})
        assert "\n" not in str(err.value) and fix in str(err.value)
    cfg = SpeedLoaderConfig(param_offload="disk", offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="add optimizer_offload disk"):
        SpeedLoaderEngine(build("llama-tiny", seed=0), cfg, optimizer=adamw)
    with pytest.raises(ValueError, match="add optimizer_offload disk"):
        TrialSpec(model="llama-tiny", param_offload="disk", offload_dir=str(tmp_path))
    TrialSpec(model="llama-tiny", mode="generate", param_offload="disk", offload_dir=str(tmp_path))   # fine alone
    knobs = ["--steps", "1", "--seq-len", "8"]
    assert main(["train", *knobs, "--param-offload", "disk", "--offload-dir", str(tmp_path)]) == 2
    assert main(["profile", "--param-offload", "disk", "--offload-dir", str(tmp_path)]) == 2
    assert main(["profile", "--param-offload", "disk", "--optimizer-offload", "disk"]) == 2
    assert main(["profile", "--param-offload", "disk", "--optimizer-offload", "disk", "--offload-dir", str(tmp_path),
                 "--schedule", "resident"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert err == [
        "sltune train: error: --param-offload disk: training steps each unit's weights file with its optimizer "
        "block; add --optimizer-offload disk",
        "sltune profile: error: --param-offload disk: training steps each unit's weights file with its optimizer "
        "block; add --optimizer-offload disk",
        "sltune profile: error: --offload-dir: --optimizer-offload disk keeps the optimizer's files there; give a "
        "directory on a local disk (--offload-dir DIR)",
        "sltune profile: error: --optimizer-offload disk: the resident schedule steps its optimizer on the device; "
        "use --optimizer-offload host, or --schedule speedloader or canonical; --param-offload disk: the resident "
        "schedule keeps every weight on the device; use --param-offload host, or --schedule speedloader or canonical",
    ]


@pytest.mark.parametrize("field", ["sub_batch_size", "num_sub_batches", "num_live_blocks"])
def test_knobs_below_one_name_the_field(field):
    with pytest.raises(ValueError, match=field):
        SpeedLoaderConfig(**{field: 0})


def test_unknown_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        SpeedLoaderConfig(dtype="float8")
    with pytest.raises(ValueError, match="not a torch device"):
        SpeedLoaderConfig(device="gpu0")


def test_limit_accepts_human_sizes():
    assert SpeedLoaderConfig(device_memory_limit="2GiB").device_memory_limit == 2 * 1024**3
    assert SpeedLoaderConfig(device_memory_limit="1.5 GB").device_memory_limit == 1_500_000_000
