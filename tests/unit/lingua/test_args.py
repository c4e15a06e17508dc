"""Config parsing: files + dotted overrides into dataclasses, readable errors for bad keys."""

import dataclasses
import typing
from pathlib import Path

import pytest

from apps.main.train import TrainArgs
from lingua.distillation.build import launch_teachers
from lingua.args import dump_config, parse_args
from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, TeacherLayout

ROOT = Path(__file__).resolve().parents[3]


def stub_inputs(args: TrainArgs) -> None:
    """Empty stand-ins for the files a config names (relative to the cwd): data, tokenizer, teacher."""
    for source in args.data.sources:
        folder = Path(args.data.root_dir) / source
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{source}.chunk.0.jsonl").write_text('{"text": "a"}\n')
        (folder / f"{source}.val.jsonl").write_text('{"text": "a"}\n')
    tokenizer = args.data.tokenizer
    if tokenizer.path:
        path = Path(tokenizer.path)
        path.mkdir(parents=True, exist_ok=True) if tokenizer.name == "hf" else \
            (path.parent.mkdir(parents=True, exist_ok=True), path.write_text(""))


def test_every_shipped_config_validates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the configs name their data relative to the repository root
    for config in sorted((ROOT / "configs").rglob("*.yaml")):
        args = parse_args(TrainArgs, [f"config={config}"])
        stub_inputs(args)
        args.distillation.validate(enabled=args.enable_distillation)  # its teachers, read once (again below)
        args.validate(world_size=sum(t.ranks for t in launch_teachers(args.enable_distillation, args.distillation)) + 2)
        assert args.steps >= 1, config


def test_overrides_reach_nested_fields():
    args = parse_args(TrainArgs, [f"config={ROOT / 'configs/debug_cpu.yaml'}", "steps=7", "optim.lr=0.5",
                                  "data.sources={a: 0.25, b: 0.75}", "distillation.k=3"])
    assert args.steps == 7 and args.optim.lr == 0.5 and args.distillation.k == 3
    # A map given whole replaces the file's map: the file's pydocs source is gone (docs/configuration.md).
    assert args.data.sources == {"a": 0.25, "b": 0.75}
    assert args.model.dim == 128  # from the file


DEBUG_CPU = f"config={ROOT / 'configs/debug_cpu.yaml'}"


@pytest.mark.parametrize("overrides, sources", [
    (["data.sources={code: 1.0}"], {"code": 1.0}),  # the spelling: the file's source need not exist
    (["data.sources.code=0.5"], {"pydocs": 1.0, "code": 0.5}),  # dotted: one key added, the others kept
    (["data.sources.pydocs=0"], {"pydocs": 0.0}),  # dotted: one key changed
    (["data.sources={code: 1.0}", "data.sources.web=0.5"], {"code": 1.0, "web": 0.5}),  # replace, then add
    (["data.sources.web=0.5", "data.sources={code: 1.0}"], {"web": 0.5, "code": 1.0}),  # the command line's keys
    (["data.sources={}"], {}),
])
def test_a_map_given_whole_replaces_the_files_and_dotted_keys_merge(overrides, sources):
    assert parse_args(TrainArgs, [DEBUG_CPU, *overrides]).data.sources == sources


def test_a_section_given_whole_still_merges_key_by_key():
    args = parse_args(TrainArgs, [DEBUG_CPU, "model={n_layers: 3}", "data={seq_len: 64}"])
    assert args.model.n_layers == 3 and args.model.dim == 128 and args.data.seq_len == 64
    assert args.data.sources == {"pydocs": 1.0}  # data's map kept: only data.sources={...} replaces it


@pytest.mark.parametrize("override, key, level, valid", [
    ("stepz=3", "stepz", "", "steps"),
    ("optim.lrr=1", "optim.lrr", "optim", "lr"),
    ("data.tokenizer.nam=hf", "data.tokenizer.nam", "data.tokenizer", "name"),
])
def test_unknown_key_names_the_key_and_the_valid_ones(override, key, level, valid):
    with pytest.raises(ValueError) as err:
        parse_args(TrainArgs, [override])
    message = str(err.value)
    intro = f"Unknown config key '{key}'. Valid keys{' under ' + level if level else ''} are: "
    assert message.startswith(intro), message
    # The listed keys are exactly that level's fields, sorted (the bad key itself contains "lr", "steps"...).
    level_args = TrainArgs
    for name in filter(None, level.split(".")):
        level_args = typing.get_type_hints(level_args)[name]
    listed = message[len(intro):].removesuffix(".").split(", ")
    assert listed == sorted(f.name for f in dataclasses.fields(level_args)) and valid in listed, message


@pytest.mark.parametrize("override, message", [
    ("steps=many", "Invalid value for steps: Value 'many' of type 'str' could not be converted to Integer; "
                   "set steps to an integer."),
    ("data.sources={a: {b: 1}}", "data.sources={'a': {'b': 1}} has the wrong type; set data.sources to a mapping "
                                 "of names to numbers."),
    ("data.eval_sources=[a, [b]]", "data.eval_sources=['a', ['b']] has the wrong type; set data.eval_sources to "
                                   "a list of strings or null."),
    ("logging.wandb.tags=5", "Invalid value for logging.wandb.tags: Invalid value assigned: AnyNode is not a "
                             "ListConfig, TupleConfig, list, or tuple; set logging.wandb.tags to a list of strings "
                             "or null."),
    ("model=3", "Invalid value for model: Merge error: int is not a subclass of LMTransformerArgs. value: 3; set "
                "model to a mapping of LMTransformerArgs keys."),
    ("logging.wandb.tags.0=0", "Invalid value for logging.wandb.tags: Cannot merge incompatible container types; "
                               "set logging.wandb.tags to a list of strings or null."),
    ("steps", "Override 'steps' has no '='; write key=value (e.g. steps=20), without dashes (--help lists the keys)."),
    ("dump_dir=${", "Invalid value for dump_dir: no viable alternative at input '${'; set dump_dir to a string."),
    ("a=[1,", "Could not parse the overrides (while parsing a flow node did not find expected node content in "
              "\"<unicode string>\", line 2, column 1); write key=value, with YAML values (lists [a, b], mappings {a: 1})."),
    ("config=[a.yaml]", "config=['a.yaml']; pass config=<path to a .yaml file>."),
])
def test_wrong_type_is_a_sentence(override, message):
    with pytest.raises(ValueError) as err:
        parse_args(TrainArgs, [override])
    assert str(err.value) == message


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_args(TrainArgs, ["config=nope.yaml"])


def test_resolved_config_round_trips(tmp_path):
    args = parse_args(TrainArgs, [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}", "steps=3"])
    dump_config(args, tmp_path / "config.yaml")
    again = parse_args(TrainArgs, [f"config={tmp_path / 'config.yaml'}"])
    assert again == args


@pytest.mark.parametrize("replicate, shard, n, expected", [
    (1, -1, 7, (1, 7)), (2, -1, 4, (2, 2)), (-1, 2, 6, (3, 2)), (2, 2, 4, (2, 2)),
])
def test_mesh_dims_infer_minus_one(replicate, shard, n, expected):
    assert LaunchPlan(n, n, dp_replicate=replicate, dp_shard=shard).mesh_dims == expected


@pytest.mark.parametrize("replicate, shard, n, message", [
    (1, 2, 3, "but there are 3 training ranks"),
    (-1, 4, 6, "cannot be split into dp_shard=4"),
    (-1, -1, 4, "only one of distributed.dp_replicate / distributed.dp_shard may be -1"),
    (0, 1, 4, "distributed.dp_replicate=0; use a positive size or -1 to infer it."),
])
def test_mesh_dims_that_do_not_fit_are_rejected(replicate, shard, n, message):
    with pytest.raises(ValueError, match=message):
        LaunchPlan.for_launch(DistributedArgs(dp_replicate=replicate, dp_shard=shard), n, n)


def roles(world: int, n_teachers: int, placement: str, local_world: int) -> tuple[list[int], list[int]]:
    plan = LaunchPlan(world, local_world, (TeacherLayout(n_teachers),) if n_teachers else (), placement)
    return plan.student_ranks, plan.teacher_ranks


def test_roles_last_ranks_and_per_node():
    assert roles(8, 1, "last", 8) == (list(range(7)), [7])
    assert roles(3, 0, "last", 3) == ([0, 1, 2], [])
    assert roles(8, 2, "per_node", 4) == ([0, 1, 2, 4, 5, 6], [3, 7])
    with pytest.raises(ValueError, match="cannot be split evenly among 2 teachers"):
        roles(7, 2, "last", 7)
    with pytest.raises(ValueError, match="at least one student rank"):
        roles(1, 1, "last", 1)
    with pytest.raises(ValueError, match=r"distributed.teacher_placement='middle'; use one of last, per_node\."):
        LaunchPlan.for_launch(DistributedArgs(teacher_placement="middle"), 4, 4, (TeacherLayout(1),))


def test_launch_plan_bridges_mesh_and_description():
    plan = LaunchPlan(8, 4, (TeacherLayout(2),), teacher_placement="per_node", dp_replicate=2)
    assert plan.bridges() == [(3, [0, 1, 2]), (7, [4, 5, 6])]
    assert [plan.bridge_index(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [plan.role(r) for r in (2, 3)] == ["student", "teacher"]
    assert plan.mesh_dims == (2, 3) and plan.mesh_grid() == [[0, 1, 2], [4, 5, 6]]
    assert LaunchPlan(4, 4, fsdp_type="no_shard").mesh_grid() == [[0], [1], [2], [3]]  # replicated everywhere
    assert plan.describe() == [
        "ranks: 2 node(s) x 4 task(s) = 8 ranks (block distribution: node i holds ranks 4*i..)",
        "distillation: 2 teacher rank(s), placement per_node",
        "  teacher: global rank 3 (node 0, local rank 3)", "  teacher: global rank 7 (node 1, local rank 3)",
        "  students: global ranks 0-2,4-6"]
    assert LaunchPlan(3, 3).bridges() == [] and LaunchPlan(3, 3).bridge_index(0) == -1
    with pytest.raises(ValueError, match="distributed.fsdp_type='hybrid'; use one of full_shard, no_shard."):
        LaunchPlan.for_launch(DistributedArgs(fsdp_type="hybrid"), 4, 4)


