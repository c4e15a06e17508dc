"""Streaming a tensor-parallel teacher's shards from its safetensors files (lingua/distillation/teacher/tensor_parallel.py),
in-process on a 1-rank gloo group: what is read, when it falls back to loading the whole teacher, and how a
damaged checkpoint is reported. The 2-rank comparison with host slicing is tests/dist/test_teacher_tp.py."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingua.distillation.args import DistillationArgs
from lingua.distillation.teacher.model import TeacherModel
from lingua.distillation.teacher.tensor_parallel import CheckpointTensors
from lingua.errors import DataError
from setup.make_tiny_teacher import make_tiny_teacher

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tied_sharded_teacher(tmp_path_factory):
    """A tied-head tiny teacher saved as several safetensors files and an index."""
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tied", seed=1, tie_embeddings=True,
                             max_shard_size="40KB")


def teacher(path, group) -> TeacherModel:
    return TeacherModel(DistillationArgs(teacher_path=str(path), teacher_dtype="fp32"), CPU, tp_group=group)


def hidden_and_logits(model: TeacherModel, tokens):
    hidden = model.hidden_states(tokens)
    return hidden, model.logits(hidden)


@pytest.mark.parametrize("which", ["single_file", "index"])
def test_a_streamed_replica_reads_every_tensor_once_and_computes_what_the_whole_teacher_does(
        which, tiny_teacher, tied_sharded_teacher, train_group):
    path = tiny_teacher if which == "single_file" else tied_sharded_teacher
    streamed, whole = teacher(path, train_group), TeacherModel(DistillationArgs(teacher_path=str(path),
                                                                               teacher_dtype="fp32"), CPU)
    assert streamed.checkpoint is not None
    # One rank holds every shard: it read every tensor once (the files are the tensors plus their headers).
    tensor_bytes = sum(p.numel() * 4 for p in whole.model.parameters())
    assert streamed.checkpoint.read_bytes == tensor_bytes
    assert tensor_bytes < streamed.checkpoint.total_bytes < tensor_bytes + 40_000
    tokens = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    for got, want in zip(hidden_and_logits(streamed, tokens), hidden_and_logits(whole, tokens)):
        assert torch.equal(got, want)
    tied = which == "index"
    assert (streamed.model.get_output_embeddings().weight is streamed.model.get_input_embeddings().weight) == tied


def test_a_checkpoint_without_safetensors_or_with_other_names_is_loaded_whole_with_a_warning(
        tiny_teacher, train_group, tmp_path, monkeypatch, caplog):
    empty = tmp_path / "empty"
    empty.mkdir()
    found, reason = CheckpointTensors.find(empty)
    assert found is None and reason == f"{empty} has no model.safetensors or model.safetensors.index.json"
    (empty / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "model-1.safetensors"}}')
    found, reason = CheckpointTensors.find(empty)
    assert found is None and reason.endswith("model.safetensors.index.json lists files that are not there "
                                             "(model-1.safetensors)")
    # Tensor names the model does not have (a renaming transformers applies while loading): the whole teacher
    # is loaded on the host and sliced there, and the warning names the first unmatched tensor.
    monkeypatch.setattr(CheckpointTensors, "unmatched", lambda self, model: ["model.decoder.embed.weight"])
    with caplog.at_level(logging.WARNING, logger="lingua.distillation.teacher.model"):
        fallback = teacher(tiny_teacher, train_group)
    assert fallback.checkpoint is None and fallback.shard.vocab == 512
    assert ("each rank of the replica loaded the whole teacher on its host to keep its shard, because 1 of the "
            "model's tensors have no tensor of that name in the checkpoint (e.g. model.decoder.embed.weight)"
            in caplog.text)


def test_a_truncated_file_of_a_sharded_checkpoint_is_one_sentence(tied_sharded_teacher, train_group, tmp_path):
    damaged = tmp_path / "data" / "teachers" / "damaged"  # under data/teachers/: the demo's commands apply
    shutil.copytree(tied_sharded_teacher, damaged)
    last = sorted(damaged.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with pytest.raises(DataError) as err:
        teacher(damaged, train_group)
    assert str(err.value).startswith(f"teacher directory '{damaged}' could not be loaded (")
    assert "`python -m setup.prepare_teacher" in str(err.value)


def test_a_tied_config_whose_checkpoint_holds_its_own_head_keeps_that_head(tiny_teacher, train_group, tmp_path, caplog):
    """from_pretrained unties a head the checkpoint holds apart; streaming would tie it, so it loads whole."""
    untied_file = tmp_path / "tied_config"
    shutil.copytree(tiny_teacher, untied_file)
    config = json.loads((untied_file / "config.json").read_text())
    (untied_file / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with caplog.at_level(logging.WARNING, logger="lingua.distillation.teacher.model"):
        loaded = teacher(untied_file, train_group)
    assert loaded.checkpoint is None
    assert "the config ties lm_head.weight but the checkpoint holds a tensor of its own for it" in caplog.text
    head = load_file(untied_file / "model.safetensors")["lm_head.weight"]
    assert torch.equal(loaded.model.get_output_embeddings().weight.full_tensor(), head)


def test_a_checkpoint_tensor_of_another_shape_than_its_config_says_is_one_sentence(tiny_teacher, train_group,
                                                                                  tmp_path):
    damaged = tmp_path / "reshaped"
    shutil.copytree(tiny_teacher, damaged)
    tensors = load_file(damaged / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DataError, match=r"the teacher checkpoint's model\.norm\.weight in .*model\.safetensors is "
                                        r"F32 \[65\], but the model's config makes it float32 \[64\]"):
        teacher(damaged, train_group)
