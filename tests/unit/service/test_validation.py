"""Issue #31 M2, M4 and 8: what one POST /tune check may read and cost, 422s (exit 2 on the CLI) instead of
500s. In process: POST /tune's whole check is sltune.service.validation.check (what its pool runs)."""

import json
import shutil
import time

import pytest
import yaml

from tests.support.specs import admitted_spec, tiny_spec

SEARCH = {k: v for k, v in tiny_spec().items() if k != "model"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model saved as transformers does (config.json and model.safetensors)."""
    from sltune.models import build

    folder = tmp_path_factory.mktemp("saved") / "tiny"
    build("llama-tiny").save_pretrained(folder)
    return folder


@pytest.fixture
def models(tmp_path, saved):
    """A server's models_dir holding a copy of the tiny model, and a folder outside it with a file in it."""
    root = tmp_path / "models"
    shutil.copytree(saved, root / "tiny")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.safetensors").write_bytes(b"not for the server")
    return root


def verdict(data: dict, models_dir=None, **settings):
    from sltune.service.validation import check
    from sltune.settings import Settings

    return check(data, Settings(models_dir=models_dir, **settings))


def with_index(folder, weight_map) -> None:
    """The folder's weights as one shard listed by an index with this weight_map."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def copy(models, name: str):
    shutil.copytree(models / "tiny", models / name)
    return models / name


# -- M2: every file a job reads from a model folder lies inside models_dir --------------------------------------
def test_a_folder_whose_files_lead_outside_models_dir_is_refused_naming_model_path_not_the_path(models, tmp_path):
    secret = tmp_path / "outside" / "secret.safetensors"
    cases = {"dotdot": {"model.embed_tokens.weight": "../../outside/secret.safetensors"},
             "absolute": {"model.embed_tokens.weight": str(secret)},
             "absent": {"model.embed_tokens.weight": "/no/such/file.safetensors"}}   # probing for files: same answer
    for name, weight_map in cases.items():
        with_index(copy(models, name), weight_map)
    copy(models, "linked")
    (models / "linked" / "model.safetensors").unlink()
    (models / "linked" / "model.safetensors").symlink_to(secret)
    copy(models, "linked-config")
    (models / "linked-config" / "config.json").unlink()
    (models / "linked-config" / "config.json").symlink_to(models.parent / "outside" / "secret.safetensors")
    with_index(copy(models, "linked-shard"), {"model.embed_tokens.weight": "shard.safetensors"})
    (models / "linked-shard" / "shard.safetensors").symlink_to(secret)

    answers = {}
    for name in (*cases, "linked", "linked-config", "linked-shard"):
        errors = verdict({**SEARCH, "model": {"path": name}}, models).errors
        assert errors and [f for f, _ in errors] == ["model.path"], (name, errors)
        assert str(tmp_path) not in errors[0][1] and "secret" not in errors[0][1] and "/no/" not in errors[0][1]
        answers[name] = errors[0][1]
    assert answers["dotdot"] == answers["absolute"] == answers["absent"]
    assert "outside the model folder" in answers["dotdot"]
    assert "model.safetensors leads outside this server's models_dir" in answers["linked"]
    assert "config.json leads outside" in answers["linked-config"]
    assert "lists a shard that leads outside" in answers["linked-shard"]

    # a Hugging Face cache's layout, its snapshot's files symlinked to blobs inside models_dir, is read as it is
    hub = models / "hub"
    (hub / "blobs").mkdir(parents=True)
    (hub / "snapshots" / "rev").mkdir(parents=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy(models / "tiny" / file, hub / "blobs" / f"blob-{file}")
        (hub / "snapshots" / "rev" / file).symlink_to(f"../../blobs/blob-{file}")
    assert verdict({**SEARCH, "model": {"path": "hub/snapshots/rev"}}, models).job is not None


def test_the_cli_refuses_a_weight_map_naming_a_file_outside_the_folder(models, tmp_path, capsys):
    from sltune.cli.main import main
    from sltune.models.checkpoint import Checkpoint

    folder = copy(models, "escape")
    with_index(folder, {"model.embed_tokens.weight": "../../outside/secret.safetensors"})
    with pytest.raises(ValueError, match="outside the model folder"):
        Checkpoint(folder)                  # what `sltune train --model` and every trial read the weights with
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**SEARCH, "model": {"path": str(folder)}}))
    assert main(["plan", str(spec)]) == 2
    assert "model.path: its model.safetensors.index.json: the weight_map names 1 file(s) outside the model " \
           "folder" in capsys.readouterr().err
    assert Checkpoint(models / "tiny").has_weights          # a folder save_pretrained wrote reads as before


# -- M4: one check's cost is bounded, and a slow check holds no other ------------------------------------------
def test_a_world_size_above_what_the_server_runs_is_refused_before_any_prediction(monkeypatch):
    import os

    from sltune.settings import Settings

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    spec = tiny_spec()
    for ranks in (524289, 5, 5.0):
        spec["hardware"] = {**spec["hardware"], "world_size": ranks}
        start = time.perf_counter()
        errors = verdict(spec).errors
        assert time.perf_counter() - start < 1.0           # took 5-20 s: the predictions cost grows with the ranks
        assert errors == [("hardware.world_size", f"{ranks:g} is above this server's limit of 4 (a trial runs its "
                                                  "ranks on one machine: SLTUNE_MAX_WORLD_SIZE, by default the "
                                                  "server's cores); ask for at most 4")], errors
    two = {**spec, "hardware": {**spec["hardware"], "world_size": 2}}
    assert verdict(two).job["spec"]["hardware"]["world_size"] == 2
    assert verdict(two, max_world_size=1).errors[0][1].startswith("2 is above this server's limit of 1 ")
    with pytest.raises(ValueError, match="hardware.world_size: Input should be less than or equal to 1024"):
        admitted_spec({**spec, "hardware": {"world_size": 1025}})      # `sltune tune` too: one machine's ranks
    assert Settings().world_size_ceiling == 4 and Settings(max_world_size=8).world_size_ceiling == 8


def test_a_config_json_larger_than_any_config_is_refused_unread(models):
    base = json.loads((models / "tiny" / "config.json").read_text())
    (models / "big").mkdir()
    (models / "big" / "config.json").write_text(json.dumps({**base, "pad": list(range(300_000))}))   # 2.2 MiB
    start = time.perf_counter()
    errors = verdict({**SEARCH, "model": {"path": "big"}}, models).errors
    assert time.perf_counter() - start < 0.5               # a 70 MB one took 20 s
    assert errors == [("model.path", "its config.json: 2.2 MiB, larger than any transformers config.json (at most "
                                     "1.0 MiB); give the one save_pretrained writes")], errors


# -- 8: 422 naming the field (exit 2 on the CLI), never a 500 ---------------------------------------------------
def test_a_knob_past_what_torch_can_size_is_a_field_error():
    for knob in (2**64, [1, 2**64], {"min": 1, "max": 2**64}, 2**20 + 1):
        spec = tiny_spec(sub_batch_size=knob)
        errors = verdict(spec).errors
        assert errors == [("search.sub_batch_size", "values must be at most 1048576 (2**20), far more than any "
                                                    "step runs; lower it")], (knob, errors)
    assert verdict(tiny_spec(sub_batch_size=[1, 2])).job is not None


def test_a_config_json_nested_past_the_parser_and_an_index_whose_weight_map_is_a_list(models, tmp_path, capsys):
    from sltune.cli.main import main
    from sltune.models.checkpoint import Checkpoint

    (models / "deep").mkdir()
    (models / "deep" / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 3000 + "]" * 3000 + "}")
    with_index(copy(models, "listed"), ["model.embed_tokens.weight", "model-00001-of-00001.safetensors"])
    deep = verdict({**SEARCH, "model": {"path": "deep"}}, models).errors
    assert deep == [("model.path", "its config.json: nested deeper than any model config (about 1,000 levels "
                                   "stops the reader); give the config.json save_pretrained writes")], deep
    listed = verdict({**SEARCH, "model": {"path": "listed"}}, models).errors
    assert listed and listed[0][0] == "model.path" and "weight_map must map each tensor's name" in listed[0][1]
    for folder in ("deep", "listed"):
        with pytest.raises(ValueError):
            Checkpoint(models / folder)        # `sltune train --model`, and the trials
    for command, folder in (("tune", "deep"), ("plan", "listed")):
        spec = tmp_path / f"{folder}.yaml"
        spec.write_text(yaml.safe_dump({**SEARCH, "model": {"path": str(models / folder)}}))
        assert main([command, str(spec)]) == 2, command
        err = capsys.readouterr().err
        assert "model.path: its " in err and "RecursionError" not in err and "AttributeError" not in err, err
    for folder in ("deep", "listed"):       # train reads the folder's config itself before the Checkpoint
        assert main(["train", "--model", str(models / folder), "--steps", "1"]) == 2, folder
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert last.startswith("sltune train: error: ") and str(models / folder) in last and "Error" not in err, err
