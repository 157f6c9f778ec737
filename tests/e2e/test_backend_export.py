"""Issue #33 item 4: a job's pick exported in its own backend's format (best.yaml naming the backend, DeepSpeed's JSON,
accelerate's FSDP2 YAML) from the CLI and the API, and `sltune train --config best.yaml` training with whichever
backend won. The succeeded jobs are stored as the runner stores them (best, best_by_backend); DeepSpeed runs for
real on its CPU accelerator over gloo (in a subprocess: it picks its accelerator when imported), FSDP2 in this one."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from sltune import SpeedLoaderConfig
from sltune.store import Store
from sltune.tuning.report.result import export_yaml
from sltune.tuning.spec import TuningSpec
from tests.support.cli import sltune
from tests.support.servers import Services
from tests.support.specs import tiny_spec
from tests.support.deepspeed import needs_deepspeed

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {"tokens_per_s": 1000.0, "tokens_per_s_ci95": [900.0, 1100.0], "step_seconds": 0.1, "search_trials": 1,
           "confirm_trials": 0, "peak_device_bytes": 2_000_000, "peak_host_bytes": 400_000_000}
PREDICTED = {"peak_device_bytes": 2.1e6, "peak_host_bytes": 4.2e8, "step_seconds": 0.1, "tokens_per_s": 990.0,
             "fits": True, "over": []}
# the picks of a job that searched all three backends, as job_result gives them
CONFIGS = {
    "speedloader": {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 2, "activations": "recompute",
                    "schedule": "speedloader"},
    "deepspeed": {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": None, "activations": "recompute",
                  "schedule": None, "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "fsdp": {"sub_batch_size": 1, "num_sub_batches": 4, "num_live_blocks": None, "activations": "recompute",
             "schedule": None, "cpu_offload": True, "reshard_after_forward": True},
}
NUMBER = {"speedloader": 0, "deepspeed": 1, "fsdp": 2}
# accelerate's config keys (accelerate.commands.config.config_args.ClusterConfig, and the fsdp_config keys its
# `accelerate config` writes for FSDP2), for a machine without accelerate
ACCELERATE_KEYS = {"compute_environment", "debug", "distributed_type", "downcast_bf16", "enable_cpu_affinity",
                   "fsdp_config", "machine_rank", "main_training_function", "mixed_precision", "num_machines",
                   "num_processes", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
                   "use_cpu"}
FSDP2_KEYS = {"fsdp_version", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_offload_params",
              "fsdp_reshard_after_forward", "fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading",
              "fsdp_state_dict_type"}


def spec(optimizer: dict | None = None, **ds) -> TuningSpec:
    data = tiny_spec("backends")
    data["hardware"] = {"device_memory_limit": "64MiB"}
    data["search"].update(backend=["speedloader", "deepspeed", "fsdp"],
                          deepspeed={"zero_stage": [ds.get("zero_stage", 3)],
                                     "offload_optimizer": [ds.get("offload_optimizer", "cpu")],
                                     "offload_param": [ds.get("offload_param", "cpu")]},
                          fsdp={"cpu_offload": [True]})
    if optimizer:
        data["optimizer"] = optimizer
    return TuningSpec.model_validate(data)


def entry(backend: str, named: bool = True, **config) -> dict:
    return {"trial_number": NUMBER[backend], "from_trials": [NUMBER[backend]], **FIGURES,
            "config": {**CONFIGS[backend], **config, **({"backend": backend} if named else {})}}


def result(job_id: str, best: str = "fsdp", by_backend: bool = True, **ds) -> dict:
    out = {"job_id": job_id, "name": "backends", "strategy": "grid", "stop_reason": "every config ran",
           "wall_seconds": 60.0, "best": entry(best, named=by_backend, **(ds if best == "deepspeed" else {})),
           "predicted": PREDICTED, "binding_limit": "device", "models": {}, "depth": None,
           "margins": {"device": 0.05, "host": 0.05}, "space_size": 3, "search_space": {}, "confirmation": None,
           "confidence": "the best is faster than the runner-up", "trials": []}
    if by_backend:
        out["best_by_backend"] = {b: {**entry(b, **(ds if b == "deepspeed" else {})), "predicted": PREDICTED,
                                      "binding_limit": "device"} for b in CONFIGS}
    return out


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Three succeeded jobs in one SQLite store: all three backends searched (fsdp won); SpeedLoader alone, stored
    as before there were backends; a deepspeed ZeRO-2 pick tuned with SGD."""
    tmp = tmp_path_factory.mktemp("stored")
    db = f"sqlite:///{tmp / 'jobs.db'}"
    store = Store(db)
    specs = {"backends": spec(), "old": spec(),
             "sgd": spec({"name": "sgd", "lr": 0.05, "momentum": 0.9}, zero_stage=2, offload_optimizer="none",
                         offload_param="none")}
    results = {"backends": lambda j: result(j), "old": lambda j: result(j, best="speedloader", by_backend=False),
               "sgd": lambda j: result(j, best="deepspeed", zero_stage=2, offload_optimizer="none",
                                       offload_param="none")}
    ids = {}
    for name, s in specs.items():
        job = store.create_job(name, s.model_dump(mode="json"), s.digest(), {}, status="running")
        store.set_status(job.id, "succeeded", result=results[name](job.id))
        ids[name] = job.id
    return {"db": db, "tmp": tmp, "ids": ids, "specs": specs, "store": store}


def export(stored, name: str, *flags: str) -> subprocess.CompletedProcess:
    return sltune("export", stored["ids"][name], "--db", stored["db"], *flags)


def without_time(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("created_at:"))


def test_best_yaml_names_the_backend_and_its_knobs_and_a_speedloader_pick_is_as_before(stored, tmp_path):
    out = tmp_path / "best.yaml"
    cli = export(stored, "backends", "--out", str(out))      # the overall best: fsdp's
    assert cli.returncode == 0, cli.stderr
    data = yaml.safe_load(out.read_text())
    assert list(data)[:3] == ["backend", "cpu_offload", "reshard_after_forward"] and data["backend"] == "fsdp"
    cfg = SpeedLoaderConfig.from_yaml(out)
    assert (cfg.backend, cfg.cpu_offload, cfg.reshard_after_forward, cfg.sub_batch_size, cfg.num_sub_batches) == \
        ("fsdp", True, True, 1, 4)
    assert data["provenance"]["trial_number"] == 2 and data["confidence"] and data["predicted"] == PREDICTED

    ds = yaml.safe_load(export(stored, "backends", "--backend", "deepspeed").stdout)
    assert {k: ds[k] for k in ("backend", "zero_stage", "offload_optimizer", "offload_param")} == \
        {"backend": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}
    assert "cpu_offload" not in ds and ds["provenance"]["trial_number"] == 1 and "confidence" not in ds

    # a speedloader pick's best.yaml is the file a job of SpeedLoader alone exports, byte for byte
    picked = export(stored, "backends", "--backend", "speedloader")
    assert picked.returncode == 0, picked.stderr
    s = stored["specs"]["backends"]
    alone = {**result(stored["ids"]["backends"], best="speedloader", by_backend=False), "confidence": None,
             "predicted": PREDICTED}
    assert without_time(picked.stdout) == without_time(export_yaml(s, alone))
    assert "backend" not in yaml.safe_load(picked.stdout)
    old = export(stored, "old")
    assert old.returncode == 0 and "backend" not in yaml.safe_load(old.stdout) and "num_live_blocks: 2" in old.stdout


def test_a_format_or_backend_that_does_not_fit_is_refused_in_one_line(stored):
    for flags, named in ((["--format", "ds_config"], ["--format accelerate", "--backend deepspeed"]),
                         (["--backend", "fsdp", "--format", "ds_config"], ["--format accelerate"]),
                         (["--backend", "speedloader", "--format", "accelerate"], ["--format yaml", "--backend fsdp"]),
                         (["--backend", "deepspeed", "--format", "accelerate"], ["--format ds_config"])):
        cli = export(stored, "backends", *flags)
        assert cli.returncode == 2 and cli.stdout == "", (flags, cli.stderr)
        assert cli.stderr.count("\n") == 1 and all(n in cli.stderr for n in named), cli.stderr
    cli = export(stored, "old", "--backend", "fsdp")       # a job from before backends: SpeedLoader's pick only
    assert cli.returncode == 2 and "has no fsdp pick" in cli.stderr and "--backend speedloader" in cli.stderr
    for fmt, other in (("ds_config", "deepspeed"), ("accelerate", "fsdp")):   # no hint at a pick the job lacks
        cli = export(stored, "old", "--format", fmt)
        assert cli.returncode == 2 and cli.stderr.count("\n") == 1 and "--format yaml" in cli.stderr, cli.stderr
        assert f"--backend {other}" not in cli.stderr and f"the job has no {other} pick (its picks: speedloader)" \
            in cli.stderr, cli.stderr


def test_the_accelerate_config_is_fsdp2_wrapping_the_decoder_layer(stored, tmp_path):
    out = tmp_path / "accelerate.yaml"
    cli = export(stored, "backends", "--backend", "fsdp", "--format", "accelerate", "--out", str(out))
    assert cli.returncode == 0, cli.stderr
    text = out.read_text()
    data = yaml.safe_load(text)
    assert "gradient_accumulation_steps=4" in text and "batch_size=1" in text       # what the file cannot hold
    assert data["distributed_type"] == "FSDP" and data["num_processes"] == 1 and data["mixed_precision"] == "no"
    fsdp = data["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"      # the model's _no_split_modules
    assert fsdp["fsdp_offload_params"] is True and fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_activation_checkpointing"] is True
    if importlib.util.find_spec("accelerate") is None:      # CI installs no accelerate: its documented keys
        assert set(data) == ACCELERATE_KEYS and set(fsdp) == FSDP2_KEYS
        return
    code = ("import os, sys\n"          # accelerate's own loader, launch arguments and FSDP plugin, in a process
            "from accelerate.commands.config.config_args import load_config_from_file\n"
            "from accelerate.commands.launch import launch_command_parser, _validate_launch_command\n"
            "from accelerate.utils.launch import prepare_multi_gpu_env\n"
            "assert load_config_from_file(sys.argv[1]).fsdp_config['fsdp_version'] == 2\n"
            "args, _, _ = _validate_launch_command(launch_command_parser().parse_args(\n"
            "    ['--config_file', sys.argv[1], 'train.py']))\n"
            "os.environ.update(prepare_multi_gpu_env(args))\n"
            "from accelerate.utils import FullyShardedDataParallelPlugin\n"
            "p = FullyShardedDataParallelPlugin()\n"
            "print(p.fsdp_version, p.transformer_cls_names_to_wrap, type(p.cpu_offload).__name__,\n"
            "      p.reshard_after_forward, p.activation_checkpointing)\n")
    run = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["2", "['LlamaDecoderLayer']", "CPUOffloadPolicy", "True", "True"], run.stdout


# DeepSpeed in its own process: the exported JSON as deepspeed.initialize(model=..., model_parameters=..., config=...)
# takes it, one optimizer step; then `train --config` of a deepspeed best.yaml through the loop, its saved folder
# against the backend's own model
DEEPSPEED = r"""
import json, os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
import torch
import torch.distributed as dist
configs, best_yaml, save = sys.argv[1:-2], sys.argv[-2], sys.argv[-1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
import deepspeed
from sltune.models import build
out = {"steps": []}
for path in configs:
    config = json.load(open(path))
    model = build("llama-tiny", seed=0)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config)
    b, n = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    ids = torch.randint(0, 512, (b * n, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for i in range(n + 1):          # N micro-batches: one optimizer step; then the first again
        mb = ids[(i % n) * b:(i % n + 1) * b]
        loss = engine(input_ids=mb, labels=mb).loss
        losses.append(float(loss.detach()))
        if i < n:
            engine.backward(loss)
            engine.step()
    out["steps"].append({"global_steps": engine.global_steps, "lr": scheduler.get_last_lr(),
                         "optimizer": type(optimizer.optimizer).__name__, "losses": losses})
    engine.destroy()
from transformers import AutoModelForCausalLM
from sltune.config import SpeedLoaderConfig
from sltune.training.loop import TrainJob, run
from sltune.training.optimizer import OptimizerConfig
import yaml
cfg = SpeedLoaderConfig.from_yaml(best_yaml)
report = run(TrainJob(model="llama-tiny", config=cfg, optimizer=OptimizerConfig.from_dict(
    yaml.safe_load(open(best_yaml))["optimizer"]), seq_len=16, steps=2, save=save))
ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
module = report.engine.backend.engine.module
module.eval()
with torch.no_grad():
    ours = module(input_ids=ids).logits
    theirs = AutoModelForCausalLM.from_pretrained(save).eval()(input_ids=ids).logits
out["train"] = {"equal": bool(torch.equal(ours, theirs)), "max_diff": float((ours - theirs).abs().max()),
                "losses": [s["loss"] for s in report.steps]}
print("RESULT " + json.dumps(out))
"""


@needs_deepspeed
def test_the_ds_config_trains_with_deepspeed_initialize_and_train_config_saves_its_weights(stored, tmp_path):
    from tests.support.servers import free_port

    paths = []
    for name, flags in (("backends", ["--backend", "deepspeed"]), ("sgd", [])):
        path = tmp_path / f"{name}.json"
        cli = export(stored, name, *flags, "--format", "ds_config", "--out", str(path))
        assert cli.returncode == 0, cli.stderr
        paths.append(path)
    stage3, sgd = (json.loads(p.read_text()) for p in paths)
    assert stage3["zero_optimization"]["stage"] == 3 and stage3["train_micro_batch_size_per_gpu"] == 2
    assert stage3["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert stage3["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert stage3["gradient_accumulation_steps"] == 2 and "bf16" not in stage3 and "fp16" not in stage3
    assert stage3["optimizer"]["type"] == "AdamW" and stage3["scheduler"]["type"] == "WarmupLR"
    assert sgd["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 64 * 64}
    assert sgd["optimizer"] == {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}}
    best = tmp_path / "ds.yaml"
    assert export(stored, "backends", "--backend", "deepspeed", "--out", str(best)).returncode == 0
    run = subprocess.run([sys.executable, "-c", DEEPSPEED, *map(str, paths), str(best), str(tmp_path / "saved")],
                         capture_output=True, text=True, timeout=400, cwd=ROOT, check=False,
                         env={**os.environ, "PORT": str(free_port())})
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for step, lr, optimizer in zip(out["steps"], (1e-3, 0.05), ("DeepSpeedCPUAdam", "SGD")):
        assert step["global_steps"] == 1 and step["lr"] == [lr] and step["optimizer"] == optimizer, step
        assert step["losses"][-1] < step["losses"][0], step      # the step moved the weights, downhill
    assert out["train"]["equal"], out["train"]      # ZeRO-3's partitions gathered into the saved folder


@needs_deepspeed
def test_a_deepspeed_run_saves_in_its_compute_dtype_and_keeps_no_resume_state(tmp_path):
    """From a float32 folder in bfloat16, `--save` wrote float32 (the source's dtype, widening bfloat16 values) and
    left checkpoint-N/ and training_state/ behind though the run says it does not resume: the folder it leaves is
    the Hugging Face folder alone, in the dtype DeepSpeed computed in, which transformers loads."""
    from safetensors import safe_open

    from sltune.models import build

    source = tmp_path / "source"
    build("llama-tiny", seed=0).save_pretrained(source)          # float32
    best = tmp_path / "best.yaml"
    SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16", backend="deepspeed",
                      zero_stage=2, offload_optimizer="cpu").to_yaml(
        best, workload={"mode": "train", "seq_len": 16, "world_size": 1},
        provenance={"job_id": "j", "model": {"path": str(source), "dtype": "bfloat16"}})
    out = tmp_path / "out"
    r = sltune("train", "--config", str(best), "--model", str(source), "--steps", "3", "--save", str(out),
               "--save-every", "1", process=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "does not resume, so it keeps no resume state or periodic checkpoints" in r.stdout
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == \
        ["config.json", "generation_config.json", "model.safetensors"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 4      # a folder to start from


@pytest.fixture
def clean_environ():
    """FSDP2 in this process: the process group it starts sets the rank variables; put them back after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_train_config_with_an_fsdp_pick_saves_a_folder_transformers_loads_and_resumes_exactly(stored, tmp_path,
                                                                                               clean_environ):
    from safetensors.torch import load_file

    from sltune.training.loop import TrainJob, run
    from sltune.training.optimizer import OptimizerConfig

    best = tmp_path / "best.yaml"
    assert export(stored, "backends", "--out", str(best)).returncode == 0       # fsdp won
    cfg = SpeedLoaderConfig.from_yaml(best)
    straight = tmp_path / "straight"
    report = run(TrainJob(model="llama-tiny", config=cfg, optimizer=OptimizerConfig.from_dict(
        yaml.safe_load(best.read_text())["optimizer"]), seq_len=16, steps=3, save=str(straight)))
    try:
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours = report.engine.model(input_ids=ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(straight).eval()
        with torch.no_grad():
            assert torch.equal(ours, loaded(input_ids=ids).logits)      # the folder is the backend's model
    finally:
        report.engine.close()
    assert loaded.config.use_cache is True          # the model's own, not the training run's

    # the CLI: two steps, then a resume to the third equals the three straight
    folder = tmp_path / "cli"
    cli = sltune("train", "--config", str(best), "--seq-len", "16", "--steps", "2", "--save", str(folder), "--json")
    assert cli.returncode == 0, cli.stderr[-3000:]
    summary = json.loads(cli.stdout)
    assert summary["config"]["backend"] == "fsdp" and summary["config"]["cpu_offload"] is True
    resumed = sltune("train", "--config", str(best), "--seq-len", "16", "--steps", "3", "--save", str(folder),
                     "--resume", str(folder), "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["first_step"] == 3
    a, b = load_file(straight / "model.safetensors"), load_file(folder / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # what cannot resume says so in one line, before anything is built
    sl = tmp_path / "sl.yaml"
    assert export(stored, "backends", "--backend", "speedloader", "--out", str(sl)).returncode == 0
    other = sltune("train", "--config", str(sl), "--seq-len", "16", "--steps", "4", "--resume", str(folder))
    assert other.returncode == 2 and "saved by a fsdp run" in other.stderr, other.stderr
    ds = tmp_path / "ds.yaml"
    assert export(stored, "backends", "--backend", "deepspeed", "--out", str(ds)).returncode == 0
    refused = sltune("train", "--config", str(ds), "--steps", "4", "--resume", str(folder))
    assert refused.returncode == 2 and "a deepspeed run cannot resume" in refused.stderr
    assert f"--model {folder}" in refused.stderr


def test_the_api_serves_each_format_with_its_media_type(stored, tmp_path):
    services = Services(stored["tmp"], stored["db"])
    try:
        services.serve()
        job = stored["ids"]["backends"]
        with services.client(token=None) as c:
            r = c.get(f"/jobs/{job}/config.yaml")
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/yaml")
            assert yaml.safe_load(r.text)["backend"] == "fsdp"
            r = c.get(f"/jobs/{job}/config.yaml", params={"backend": "deepspeed", "format": "ds_config"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
            assert r.json()["zero_optimization"]["stage"] == 3
            r = c.get(f"/jobs/{job}/config.yaml", params={"backend": "fsdp", "format": "accelerate"})
            assert r.headers["content-type"].startswith("application/yaml")
            assert yaml.safe_load(r.text)["fsdp_config"]["fsdp_version"] == 2
            r = c.get(f"/jobs/{job}/config.yaml", params={"format": "ds_config"})     # the best is fsdp's
            assert r.status_code == 422
            assert r.json()["detail"][0]["loc"] == ["query", "format"] and "format accelerate" in r.text
            r = c.get(f"/jobs/{stored['ids']['old']}/config.yaml", params={"backend": "fsdp"})
            assert r.status_code == 404 and "has no fsdp pick" in r.json()["detail"]
            assert c.get(f"/jobs/{job}/config.yaml", params={"format": "toml"}).status_code == 422
            doc = c.get("/openapi.json").json()["paths"]["/jobs/{job_id}/config.yaml"]["get"]
            assert {p["name"] for p in doc["parameters"]} == {"job_id", "backend", "format"}
            assert list(doc["responses"]["200"]["content"]) == ["application/yaml", "application/json"]
        out = tmp_path / "ds.json"
        cli = sltune("export", job, "--server", services.url, "--backend", "deepspeed", "--format", "ds_config",
                     "--out", str(out))
        assert cli.returncode == 0 and json.loads(out.read_text())["gradient_accumulation_steps"] == 2, cli.stderr
    finally:
        services.stop()
