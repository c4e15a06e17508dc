"""The placement planner (apps/plan/): sizes, memory, layouts, the cache road, errors, the verdict, docs/planner_examples.md's
examples."""

import dataclasses
import json
import re
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

from apps.main.transformer import LMTransformer, num_parameters
from apps.plan.args import MAX_WAIT_SHARE, PLAN_VERSION, PlanArgs
from apps.plan.cli import main
from apps.plan.planner import Planner
from apps.plan.printing import format_plan, verdict_lines
from apps.plan.sizes import read_teacher_shape
from apps.plan.timing import Speeds, Timing, max_students_per_replica
from lingua.args import parse_args
from lingua.cli.entry import run_cli
from lingua.errors import ConfigError
from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, TeacherLayout

ROOT = Path(__file__).resolve().parents[4]
TEACHERS = ROOT / "configs" / "teachers"
DEBUG, LLAMA_1B = "configs/distill_exps/debug.yaml", "configs/llama_1B.yaml"
SMOLLM2, LLAMA_8B, LLAMA_70B = (f"configs/teachers/{name}.json" for name in ("smollm2_135m", "llama3_8b", "llama3_70b"))
# docs/planner_examples.md's worked examples, as the planner is run there.
EXAMPLES = {
    "smollm2": [f"config={DEBUG}", "world_size=8", f"teacher_config={SMOLLM2}"],
    "8b": [f"config={LLAMA_1B}", "world_size=64", f"teacher_config={LLAMA_8B}"],
    "70b": [f"config={LLAMA_1B}", "world_size=256", f"teacher_config={LLAMA_70B}"],
}
from lingua.distillation.cache.codec import planned_bytes_per_token

MEASURED_TOPK64_49K = 122.2  # B/token, docs/teacher_cache.md


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name paths relative to the checkout


def plan_of(argv: list[str]) -> dict:
    args = parse_args(PlanArgs, argv + ["out=null"])
    args.validate_plan()
    return Planner(args, next(a.split("=", 1)[1] for a in argv if a.startswith("config="))).plan()


def launch_plan_of(online: dict, gpus_per_node: int = 8, **mesh) -> LaunchPlan:
    """The trainer's LaunchPlan for the overrides the planner printed (`mesh`: the config's distributed settings)."""
    overrides = dict(item.split("=", 1) for item in online["overrides"].split())
    distributed = DistributedArgs(teacher_placement=overrides["distributed.teacher_placement"], **mesh)
    teacher = TeacherLayout(int(overrides["distillation.n_teacher_ranks"]), int(overrides["distillation.teacher_tp"]))
    return LaunchPlan.for_launch(distributed, online["world_size"], gpus_per_node, (teacher,))


# ---------------------------------------------------------------- sizes

@pytest.mark.parametrize("name, public_count", [("smollm2_135m", 134_515_008), ("llama3_8b", 8_030_261_248),
                                                ("llama3_70b", 70_553_706_496)])
def test_teacher_parameters_match_transformers_and_the_public_counts(name, public_count):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = TEACHERS / f"{name}.json"
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_json_file(path))
    assert read_teacher_shape(path).parameters() == sum(p.numel() for p in model.parameters()) == public_count


def test_biases_and_tensor_parallel_shares_are_counted(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((TEACHERS / "smollm2_135m.json").read_text())
    config.update(attention_bias=True, mlp_bias=True, num_attention_heads=8, num_key_value_heads=4, head_dim=72)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_json_file(tmp_path / "config.json"))
    shape = read_teacher_shape(tmp_path / "config.json")
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
    # Sharded t ways, every tensor but the norms and the o/down biases: t shares are the whole plus t - 1 copies.
    replicated = shape.layers * 4 * shape.hidden + shape.hidden
    for tp in (2, 4):
        assert tp * shape.parameters(tp) == shape.parameters() + (tp - 1) * replicated


@pytest.mark.parametrize("config, vocab, tied", [(LLAMA_1B, 128_256, False), (DEBUG, 49_152, False),
                                                 (DEBUG, 49_152, True), ("configs/debug_cpu.yaml", 258, False)])
def test_student_parameters_without_building_equal_the_built_model(config, vocab, tied):
    model_args = dataclasses.replace(parse_args(PlanArgs, [f"config={config}"]).model, vocab_size=vocab,
                                     tie_embeddings=tied)
    with torch.device("meta"):
        model = LMTransformer(model_args)
    assert num_parameters(model_args) == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- the time model

def test_wait_share_from_the_teachers_load():
    assert Timing.of(0.9, prefetch=1).wait_share == 0 and Timing.of(0.9, prefetch=1).teacher_busy == 0.9
    slow = Timing.of(2.0, prefetch=1)  # the teacher takes twice the students' compute: they wait one C per C
    assert slow.wait_share == pytest.approx(0.5) and slow.teacher_busy == pytest.approx(1.0)
    assert Timing.of(0.9, prefetch=0).wait == pytest.approx(0.9 - 1 / 3)  # only the forward hides it
    speeds = Speeds(student=1000.0, teacher=300.0, source="measured")  # 3.33 teacher GPUs per student GPU
    for tp in (1, 2, 4, 8):
        most = max_students_per_replica(tp, speeds, prefetch=1)
        at_most = Timing.of(most * speeds.teacher_gpus_per_student_gpu / tp, prefetch=1)
        assert at_most.wait_share == pytest.approx(MAX_WAIT_SHARE)


# ---------------------------------------------------------------- docs/planner_examples.md's worked examples

def test_smollm2_teaching_the_debug_student_on_8_gpus():
    plan = plan_of(EXAMPLES["smollm2"])
    assert plan["teacher"]["parameters"] == 134_515_008 and plan["student"]["parameters"] == 73_933_312
    assert plan["speed"]["teacher_gpus_per_student_gpu"] == pytest.approx(0.991, abs=1e-3)
    online = plan["online"]
    assert online["keeps_up"] and (online["teacher_tp"], online["replicas"], online["students_per_bridge"]) == (1, 4, 1)
    assert online["wait_share"] == 0 and online["teacher_placement"] == "last"
    bridge, student_speed = online["bridge"], plan["speed"]["student_tokens_per_s_per_gpu"]
    assert (bridge["bytes_up_per_token"], bridge["bytes_down_per_token"]) == (4, 388)
    assert bridge["bytes_per_s"] == pytest.approx(392 * student_speed, rel=1e-6)  # one student, never waiting
    assert launch_plan_of(online).describe()[:6] == online["launch_plan"][:6]
    assert plan["teacher"]["teacher_tp_sizes"] == [1]  # 9 heads, 3 KV heads: no split inside a node of 8
    # The cache format v2's size as measured on the KD study's data (top-64 of the same 49k vocabulary).
    assert plan["cache"]["bytes_per_token"] == pytest.approx(MEASURED_TOPK64_49K, abs=0.1)
    # The road: online, the cache within 5% for one run; 74M students are not the study's 7M: the pilot first.
    assert plan["cache"]["cheaper"] == "online" and plan["recommendation"].startswith("pilot first (")
    assert "; to distill: online with teacher_tp=1 x 4 replica(s) beside 4 students (" in plan["recommendation"]


def test_llama3_8b_teaching_a_1b_student_on_64_gpus():
    plan = plan_of(EXAMPLES["8b"])
    assert plan["memory"]["min_teacher_tp"] == 1  # 15 GiB of weights fit; the logits chunk is most of the rest
    assert plan["speed"]["teacher_gpus_per_student_gpu"] == pytest.approx(1.47, abs=0.01)
    online = plan["online"]
    assert not online["keeps_up"] and "64 ranks do not split" in online["reason"]
    assert (online["teacher_tp"], online["replicas"], online["students_per_bridge"]) == (1, 32, 1)
    assert online["wait_share"] == pytest.approx(0.32, abs=0.01)
    smaller = plan["smaller_world_that_keeps_up"]
    assert (smaller["world_size"], smaller["teacher_tp"], smaller["replicas"], smaller["students_per_bridge"]) == \
        (48, 2, 16, 1)
    assert smaller["wait_share"] == 0 and launch_plan_of(smaller).replicas()[0] == ([16, 17], [0])
    assert plan["cache"]["cheaper"] == "cache" and plan["cache"]["break_even_runs"] < 1
    # v2 at a 128k vocabulary: each id's rank costs log2(128256) / log2(49152) of what it did at 49k.
    assert plan["cache"]["bytes_per_token"] == pytest.approx(
        planned_bytes_per_token("topk", 64, 128256, 2, 4096), abs=1e-3)
    assert MEASURED_TOPK64_49K < plan["cache"]["bytes_per_token"] < 4 * 4097 / 4096 + 2 + 64 * 6 + 4  # v1
    assert plan["recommendation"].startswith("pilot first (") and "; to distill: from a cache (written once with " \
        "teacher_tp=1: " in plan["recommendation"]


def test_llama3_70b_teaching_a_1b_student_on_256_gpus():
    plan = plan_of(EXAMPLES["70b"])
    memory = plan["memory"]
    # The decoder over one row at a time (no KV cache): the 131 GiB of weights fit two 80 GB GPUs, barely.
    assert memory["min_teacher_tp"] == 2 and memory["one_student_request"][1]["total"] > memory["usable_gib"]
    assert memory["one_student_request"][2]["total"] < memory["usable_gib"]
    online = plan["online"]
    assert not online["keeps_up"] and "even one student per replica of teacher_tp=8" in online["reason"]
    assert (online["teacher_tp"], online["replicas"], online["students_per_bridge"], online["teacher_placement"]) == \
        (2, 64, 2, "last")
    assert online["wait_share"] == pytest.approx(0.92, abs=0.01)
    assert plan["smaller_world_that_keeps_up"] is None
    assert plan["cache"]["cheaper"] == "cache"
    # A stream per GPU training from the cache, the planned tokens split between them: 128 students online x
    # 60,000 steps x 4 x 4,096 tokens = 256 streams x 120,000 windows (in shards of 64 that divide them).
    writer = plan["cache"]["writer"]
    assert writer["overrides"] == "distillation.teacher_tp=2 streams=256 sequences_per_stream=120000 shard_sequences=64"
    assert writer["tokens"] == plan["cache"]["tokens_per_run"] and writer["train_steps"] == 30000


def test_the_cache_writer_splits_the_planned_windows_evenly_and_says_when_it_rounds():
    even = plan_of(EXAMPLES["smollm2"])["cache"]  # 4 students online x 1,000 steps x 8 rows: 8 streams x 4,000
    assert (even["writer"]["sequences_per_stream"], even["writer"]["shard_sequences"]) == (4000, 50)
    plan = plan_of(EXAMPLES["smollm2"] + ["tokens_per_run=1000000"])  # 977 windows of 1,024 over 8 streams: 123
    writer = plan["cache"]["writer"]
    assert (writer["sequences_per_stream"], writer["shard_sequences"], writer["tokens"]) == (123, 41, 8 * 123 * 1024)
    assert writer["train_steps"] is None  # 123 windows are not whole steps of 8 rows
    printed = "\n".join(format_plan(plan))
    assert "8 streams x 123 windows of 1,024 tokens = 1,007,616 tokens, the planned 1,000,000 rounded up" in printed
    # 127 windows a stream (a prime): shards of 1 window would batch every teacher forward by one; whole shards
    # of 64 instead, a window more per stream, said as rounding.
    prime = plan_of(EXAMPLES["smollm2"] + [f"tokens_per_run={8 * 127 * 1024}"])["cache"]["writer"]
    assert (prime["sequences_per_stream"], prime["shard_sequences"], prime["tokens"]) == (128, 64, 8 * 128 * 1024)
    # Behind a data wall the cache holds the 2M unique tokens once and training reads it 16.4 times (its 500 steps).
    walled = plan_of(EXAMPLES["smollm2"] + ["unique_tokens=2e6"])["cache"]
    assert (walled["cached_tokens"], walled["tokens_per_run"]) == (2_000_000, 32_768_000)
    assert walled["size_bytes"] == pytest.approx(2e6 * walled["bytes_per_token"], rel=1e-5)
    assert walled["teacher_pass_gpu_hours"] < plan_of(EXAMPLES["smollm2"])["cache"]["teacher_pass_gpu_hours"] / 16
    assert (walled["writer"]["sequences_per_stream"], walled["writer"]["tokens"], walled["writer"]["train_steps"]) == \
        (245, 8 * 245 * 1024, 500)


def test_the_planner_reads_a_config_with_the_trainers_defaults():
    """One function fills what a config leaves to the trainer, for the trainer and the planner alike: Lingua's
    configs leave model.max_seqlen at -1 (data.seq_len), and the planner no longer refuses them."""
    import apps.main.train
    import apps.plan.args
    from lingua.args import fill_training_defaults

    assert apps.main.train.fill_training_defaults is apps.plan.args.fill_training_defaults is fill_training_defaults
    args = parse_args(PlanArgs, EXAMPLES["8b"] + ["out=null", "model.max_seqlen=-1", "data.seq_len=2048"])
    args.validate_plan()
    assert args.model.max_seqlen == 2048
    with pytest.raises(ConfigError, match=r"^model.max_seqlen=1024; the model must fit data.seq_len=2048"):
        parse_args(PlanArgs, EXAMPLES["8b"] + ["out=null", "model.max_seqlen=1024", "data.seq_len=2048"]).validate_plan()


def test_measured_speeds_replace_the_cost_model():
    plan = plan_of(EXAMPLES["8b"] + ["teacher_tokens_per_s=40000", "student_tokens_per_s=10000"])
    assert plan["speed"]["teacher_gpus_per_student_gpu"] == 0.25
    assert plan["speed"]["source"] == "student and teacher measured"
    online = plan["online"]  # 4 students per teacher GPU keep up: one per node of 8 leaves 7, so last with 16 replicas
    assert online["keeps_up"]
    assert (online["teacher_tp"], online["replicas"], online["students_per_bridge"]) == (1, 16, 3)


# ---------------------------------------------------------------- scale

@pytest.mark.parametrize("world", [1024, 16384])
def test_plans_of_a_thousand_and_sixteen_thousand_ranks(world):
    teacher_bound = plan_of([f"config={LLAMA_1B}", f"world_size={world}", f"teacher_config={LLAMA_8B}"])
    assert all(len({r // 8 for r in ranks}) == 1 for ranks, _ in launch_plan_of(teacher_bound["online"]).replicas())
    assert teacher_bound["smaller_world_that_keeps_up"]["world_size"] == world // 24 * 24
    # A teacher 7 students keep busy: one replica per node, every bridge inside its node.
    per_node = plan_of([f"config={LLAMA_1B}", f"world_size={world}", f"teacher_config={LLAMA_8B}",
                        "teacher_tokens_per_s=10000", "student_tokens_per_s=1000"])["online"]
    assert per_node["keeps_up"] and per_node["teacher_placement"] == "per_node" and per_node["bridges_inside_nodes"]
    assert (per_node["replicas"], per_node["students_per_bridge"]) == (world // 8, 7)
    assert all({r // 8 for r in ranks + students} == {ranks[0] // 8}
               for ranks, students in launch_plan_of(per_node).replicas())


def planning_cost(world: int) -> tuple[float, int]:
    """(CPU seconds, best of 3; peak bytes allocated) of planning the 8B example on `world` ranks."""
    args = parse_args(PlanArgs, [f"config={LLAMA_1B}", f"world_size={world}", f"teacher_config={LLAMA_8B}", "out=null"])
    seconds = float("inf")
    for _ in range(3):
        start = time.process_time()
        Planner(args).plan()
        seconds = min(seconds, time.process_time() - start)
    tracemalloc.start()
    Planner(args).plan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


def test_planning_time_and_memory_grow_linearly_with_the_world():
    """16x the ranks: linear work is ~16x (a few fixed costs make it less), quadratic 256x; CPU time, not wall time."""
    (small_s, small_bytes), (large_s, large_bytes) = planning_cost(1024), planning_cost(16384)
    assert large_s < 64 * max(small_s, 1e-3), (small_s, large_s)
    assert large_bytes < 64 * small_bytes, (small_bytes, large_bytes)


# ---------------------------------------------------------------- the command line

def run(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["apps.plan", *argv])
    code = 0
    try:
        run_cli(main)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_prints_and_writes_the_plan(tmp_path, monkeypatch, capsys):
    out = tmp_path / "plans" / "smollm2.json"
    code, printed, _ = run(EXAMPLES["smollm2"] + [f"out={out}"], monkeypatch, capsys)
    assert code == 0 and printed.endswith(f"wrote {out}\n")
    written = json.loads(out.read_text())
    assert printed.splitlines()[:-1] == format_plan(written)
    assert written["online"]["replicas"] == 4 and written["inputs"]["config"] == DEBUG
    code, _, _ = run(EXAMPLES["8b"] + [f"out={out}"], monkeypatch, capsys)  # a plan of ours is replaced
    assert code == 0 and json.loads(out.read_text())["inputs"]["world_size"] == 64
    assert json.loads(out.read_text())["version"] == PLAN_VERSION == 2  # cache.writer, the verdict: its keys
    out.write_text(json.dumps({**written, "version": 1}))  # an earlier version's plan is ours too
    code, _, _ = run(EXAMPLES["smollm2"] + [f"out={out}"], monkeypatch, capsys)
    assert code == 0 and json.loads(out.read_text())["version"] == PLAN_VERSION


def test_the_default_plan_prints_only_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where a default out= would land
    code, printed, _ = run([f"config={ROOT / DEBUG}", "world_size=8", f"teacher_config={ROOT / SMOLLM2}"],
                           monkeypatch, capsys)
    assert code == 0 and printed.startswith("answer: ") and "wrote" not in printed
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, sentence", [
    (["world_size=0"], "error: world_size=0; pass the GPUs of the launch, at least 2"),
    (["world_size=12"], "error: world_size=12; plan whole nodes: a multiple of gpus_per_node=8"),
    (["mfu=1.5"], "error: mfu=1.5; use a share of the peak in (0, 1]."),
    (["gpu_mem_gib=-80"], "error: gpu_mem_gib=-80.0; use a positive number."),
    (["student_tokens_per_s=nan"], "error: student_tokens_per_s=nan; use measured tokens/s per GPU"),
    (["planned_runs=0"], "error: planned_runs=0; use 1 or more runs."),
    (["world_size_=8"], "error: Unknown config key 'world_size_'."),
    (["teacher_config=/no/such/config.json"],
     "error: The teacher's config /no/such/config.json does not exist; pass teacher_config=<its config.json>"),
    (["distillation.k=0"], "error: distillation.k=0; use a positive number of ids"),
    (["data.seq_len=10000", "model.max_seqlen=10000"],
     "error: data.seq_len=10000; the teacher supports at most 8192 positions (max_position_embeddings in "
     "configs/teachers/smollm2_135m.json)"),
])
def test_bad_input_is_one_sentence(argv, sentence, monkeypatch, capsys, tmp_path):
    code, printed, err = run(EXAMPLES["smollm2"] + [f"out={tmp_path / 'plan.json'}"] + argv, monkeypatch, capsys)
    assert code == 2 and err.startswith(sentence) and err.count("\n") == 1 and printed == ""
    assert not (tmp_path / "plan.json").exists()


def test_a_config_without_a_teacher_names_the_fix(monkeypatch, capsys):
    code, _, err = run([f"config={LLAMA_1B}", "world_size=8", "out=null"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: teacher_config=null; the config names no distillation.teacher_path: "
                                        "pass teacher_config=<the teacher's config.json>")
    code, _, err = run([f"config={LLAMA_1B}", "world_size=8", "out=null", "distillation.teacher_path=/no/teacher"],
                       monkeypatch, capsys)
    assert code == 2 and err.startswith("error: The teacher's config /no/teacher/config.json does not exist")


def test_several_teachers_take_one_teacher_config_each(monkeypatch, capsys):
    """A config of several teachers is planned per teacher (tests/unit/apps/plan/test_teachers.py): one teacher_config
    for all of them is one sentence, not a plan that counts one."""
    config = ROOT / "configs/distill_exps/two_teachers_cpu.yaml"
    code, printed, err = run([f"config={config}", "world_size=8", "out=null", "teacher_config=" + SMOLLM2],
                             monkeypatch, capsys)
    assert code == 2 and printed == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: teacher_config='{SMOLLM2}'; with distillation.teachers give one value per teacher "
                          f"in teacher_configs"), err


def test_a_teacher_config_without_the_sizes_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    code, _, err = run(EXAMPLES["smollm2"][:2] + [f"teacher_config={tmp_path / 'config.json'}", "out=null"],
                       monkeypatch, capsys)
    assert code == 2 and "has num_attention_heads=null; the planner needs hidden_size" in err


def test_a_file_that_is_not_a_plan_is_never_overwritten(tmp_path, monkeypatch, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    code, printed, err = run(EXAMPLES["smollm2"] + [f"out={notes}"], monkeypatch, capsys)
    assert code == 2 and err.startswith(f"error: out={notes} exists and is not a plan written by apps.plan")
    assert notes.read_text() == '{"mine": true}\n'


# ---------------------------------------------------------------- docs/planner_examples.md shows what the planner prints

def docs_planner_blocks() -> list[tuple[list[str], str]]:
    """(argv, printed lines) of every `$ python -m apps.plan ...` in a code block of docs/planner_examples.md (the
    README's Big teachers section, moved) that starts with one."""
    text = (ROOT / "docs" / "planner_examples.md").read_text()
    blocks = re.findall(r"```\n(\$ python -m apps\.plan .*?)```", text, re.S)
    commands = [part for block in blocks for part in re.split(r"(?m)^(?=\$ python -m apps\.plan )", block) if part]
    return [(part.split("\n", 1)[0].split()[4:], part.split("\n", 1)[1]) for part in commands]


def test_the_docs_show_the_planners_own_output():
    blocks = docs_planner_blocks()
    assert len(blocks) == 6  # the three worked examples, then their verdicts behind a data wall
    for argv, printed in blocks:
        assert "out=null" in argv
        plan = plan_of([a for a in argv if a != "out=null"])
        expected = [f"answer: {plan['recommendation']}", *verdict_lines(plan["verdict"])] if "show=verdict" in argv \
            else format_plan(plan)
        assert printed.splitlines() == expected, argv
    assert [argv for argv, _ in blocks[3:]] == [[*argv[:-1], a, "show=verdict", "out=null"] for (argv, _), a in
                                                zip(blocks[:3], ("unique_tokens=2e6", "unique_tokens=2e9",
                                                                 "unique_tokens=8e9"))]


@pytest.mark.slow
def test_the_real_smollm2_teacher_plans_like_its_shipped_sizes(smollm2_teacher):
    """The converted SmolLM2 checkpoint's config.json gives the plan configs/teachers/smollm2_135m.json gives."""
    from_checkpoint = plan_of([f"config={DEBUG}", "world_size=8", f"distillation.teacher_path={smollm2_teacher}"])
    shipped = plan_of(EXAMPLES["smollm2"])
    for key in ("teacher", "student", "speed", "online", "cache"):
        assert from_checkpoint[key] == shipped[key], key


def test_a_teacher_no_node_holds_is_neither_road():
    plan = plan_of(EXAMPLES["70b"] + ["gpu_mem_gib=16"])  # 17.5 GB of weights per rank at TP 8
    assert plan["memory"]["min_teacher_tp"] is None and "cache" not in plan
    assert plan["online"]["reason"].startswith("the teacher does not fit: at teacher_tp=8")
    assert plan["recommendation"].startswith("neither road: the teacher does not fit")


def test_the_configs_mesh_settings_bound_the_layouts():
    # Students in multiples of 3: one student per teacher (4 + 4) is refused, 6 students + 2 teachers is the best left.
    plan = plan_of(EXAMPLES["smollm2"] + ["distributed.dp_replicate=-1", "distributed.dp_shard=3"])
    online = plan["online"]
    assert not online["keeps_up"] and online["reason"].startswith(
        "the launch plan refuses the layouts that would: 4 training ranks cannot be split into dp_shard=3 groups")
    assert (online["students"], online["replicas"]) == (6, 2)
    assert launch_plan_of(online, dp_replicate=-1, dp_shard=3).mesh_dims == (2, 3)
    plan = plan_of(EXAMPLES["smollm2"] + ["distributed.dp_shard=3"])  # exactly 3 students: no split of 8 ranks
    assert plan["online"]["reason"].startswith("the launch plan refuses every split of 8 ranks, the first with: Mesh")


# ---------------------------------------------------------------- a teacher of another tokenizer

def test_a_cross_tokenizer_teacher_is_counted_in_its_own_tokens_per_student_token():
    """teacher_tokens_per_student_token (apps.bench.alignment_cost's column) scales the teacher's work per
    student token: its measured speed divides by it; the cost model counts its forward at its own row length."""
    # Lingua's tokenizer is not here: its vocabulary given (the plan needs it, and one sentence asks for it).
    measured = EXAMPLES["8b"] + ["teacher_tokens_per_s=40000", "student_tokens_per_s=10000",
                                 "distillation.cross_tokenizer=true", "model.vocab_size=128256"]
    same, double = [plan_of(measured + [f"teacher_tokens_per_student_token={r}"]) for r in (1, 2)]
    assert (same["speed"]["teacher_gpus_per_student_gpu"], double["speed"]["teacher_gpus_per_student_gpu"]) == (0.25,
                                                                                                                0.5)
    assert double["speed"]["source"] == "student and teacher measured; the teacher at 2 of its tokens per student " \
        "token (given)"
    assert double["inputs"]["teacher_tokens_per_student_token"] == 2.0
    modelled = [plan_of(EXAMPLES["8b"] + ["distillation.cross_tokenizer=true", "model.vocab_size=128256",
                                          f"teacher_tokens_per_student_token={r}"]) for r in (1, 0.5)]
    ratio = modelled[1]["speed"]["teacher_tokens_per_s_per_gpu"] / modelled[0]["speed"]["teacher_tokens_per_s_per_gpu"]
    assert 2.0 <= ratio < 2.2  # half the tokens, each in a row half as long (less attention per token)


def test_a_cross_tokenizer_student_is_planned_as_the_trainer_builds_it():
    """distillation.cross_tokenizer=true keeps the config's tokenizer: the planned student has that tokenizer's
    vocabulary and the parameter count the trainer logs, from the trainer's own tokenizer and model build (the byte
    tokenizer's 258 words; the teacher's 49,152 would plan a 13M student where the trainer builds 0.5M)."""
    from apps.main.train import TrainArgs, init_tokenizer

    training = [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}", "data.tokenizer.name=bytes",
                "data.tokenizer.path=null", "distillation.cross_tokenizer=true"]
    plan = plan_of(training + ["world_size=8", f"teacher_config={SMOLLM2}", "teacher_tokens_per_student_token=0.3"])
    trainer_args = parse_args(TrainArgs, training)
    init_tokenizer(trainer_args)  # the trainer's: model.vocab_size from the data tokenizer
    with torch.device("meta"):
        built = sum(p.numel() for p in LMTransformer(trainer_args.model).parameters())  # what train() logs
    assert plan["student"]["vocab"] == trainer_args.model.vocab_size == 258
    assert plan["student"]["parameters"] == built < 1e6
    assert plan["teacher"]["vocab"] == 49_152  # the teacher keeps its own
    # On the teacher's tokenizer (no cross_tokenizer) the student takes the teacher's vocabulary, as the trainer does.
    shared = plan_of([f"config={DEBUG}", "world_size=8", f"teacher_config={SMOLLM2}"])
    assert shared["student"]["vocab"] == 49_152


def test_a_cross_tokenizer_student_whose_tokenizer_is_not_here_is_one_sentence(monkeypatch, capsys):
    code, printed, err = run(EXAMPLES["8b"] + ["distillation.cross_tokenizer=true", "teacher_tokens_per_student_token=1"],
                             monkeypatch, capsys)
    assert code == 2 and printed == "" and err == (
        "error: distillation.cross_tokenizer=true keeps the students' own tokenizer, whose vocabulary the plan needs, "
        "but data.tokenizer.path=tokenizers/cl_toplang_128k.tiktoken is not on this machine; point "
        "data.tokenizer.path at a copy of it, or pass model.vocab_size=<its vocabulary>.\n")


@pytest.mark.parametrize("argv, sentence", [
    (["teacher_tokens_per_student_token=1.1"],
     "error: teacher_tokens_per_student_token=1.1; a student on the teacher's tokenizer has one teacher token per "
     "student token; leave it at 1, or set distillation.cross_tokenizer=true."),
    (["teacher_tokens_per_student_token=-1", "distillation.cross_tokenizer=true"],
     "error: teacher_tokens_per_student_token=-1.0; use the measured ratio"),
    (["distillation.cross_tokenizer=true", "data.tokenizer.name=tiktoken", "data.tokenizer.path=/no/such.tiktoken"],
     "error: distillation.cross_tokenizer=true: the plan needs the teacher's tokens per student token on your data "
     "and the students' (data.tokenizer.path) tokenizer is not here to measure it; pass "
     "teacher_tokens_per_student_token=<ratio> (python -m apps.bench.alignment_cost prints it), or both tokenizers."),
])
def test_a_bad_teacher_tokens_per_student_token_is_one_sentence(argv, sentence, monkeypatch, capsys, tmp_path):
    code, printed, err = run(EXAMPLES["smollm2"] + [f"out={tmp_path / 'plan.json'}"] + argv, monkeypatch, capsys)
    assert code == 2 and err.startswith(sentence) and err.count("\n") == 1 and printed == ""
