"""Several teachers (distillation.teachers): the config's sentences, the one-teacher equivalence, the launch layout,
the batches' source ids and the mixing math (weighted sums of each teacher's KD term, routing per source)."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.data import DataArgs, DataLoader
from lingua.loading.stream import active_sources
from lingua.distillation.args import DistillationArgs, OneTeacherArgs, TeacherArgs, teacher_title
from lingua.distillation.build import launch_teachers
from lingua.distillation.loss.fused import fused_linear_kd_loss
from lingua.distillation.loss.mixture import mixing_weights, source_routing, teacher_metrics
from lingua.distillation.loss.mixture import head_loss_path, teachers_head_loss


def mixed_head_loss(hidden, head, labels, outputs, weights, n_valid, alpha, args):
    """(loss, CE, statistics by name) on the path `args` picks."""
    loss, stats = teachers_head_loss(head_loss_path(args), hidden, head, labels, outputs, weights, n_valid, alpha, args)
    return loss, stats["ce"], stats
from lingua.distillation.outputs import TeacherOutputs
from lingua.errors import ConfigError, LaunchError
from lingua.parallel.launch_plan import DistributedArgs, LaunchPlan, TeacherLayout
from lingua.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[4]


def launch(args: TrainArgs) -> tuple[TeacherLayout, ...]:
    return launch_teachers(args.enable_distillation, args.distillation)


def kd_args(tmp_path, *overrides: str) -> TrainArgs:
    """The 2+1 CPU config with its data and teacher stubbed under tmp_path, plus `overrides`."""
    for source in ("pydocs", "code"):
        (tmp_path / "corpus" / source).mkdir(parents=True, exist_ok=True)
        (tmp_path / "corpus" / source / f"{source}.chunk.0.jsonl").write_text('{"text": "a"}\n')
    for name in ("t0", "t1"):
        (tmp_path / name).mkdir(exist_ok=True)
    return parse_args(TrainArgs, [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}",
                                  f"data.root_dir={tmp_path / 'corpus'}", "data.tokenizer.name=bytes",
                                  "data.tokenizer.path=null", "distillation.teacher_path=null", *overrides])


def teachers(tmp_path, *elements: str) -> str:
    return "distillation.teachers=[" + ", ".join(e.format(t0=tmp_path / "t0", t1=tmp_path / "t1")
                                                 for e in elements) + "]"


def refusal(args: TrainArgs, world_size: int = 4) -> str:
    with pytest.raises((ConfigError, LaunchError)) as err:
        args.validate(world_size=world_size)
    return str(err.value)


def test_one_teacher_in_the_list_is_teacher_path(tmp_path):
    listed = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}, n_teacher_ranks: 2, weight: 3.0}}"))
    listed.validate(world_size=4)
    plain = kd_args(tmp_path, f"distillation.teacher_path={tmp_path / 't0'}", "distillation.n_teacher_ranks=2")
    plain.validate(world_size=4)
    # One teacher is a list of one, whichever keys named it: the same teacher, the same launch, nothing folded back;
    # validated again (a dumped config), it stays that.
    assert plain.distillation.teachers == [TeacherArgs(path=str(tmp_path / "t0"), n_teacher_ranks=2)]
    assert listed.distillation.teachers == [TeacherArgs(path=str(tmp_path / "t0"), n_teacher_ranks=2, weight=3.0)]
    assert listed.distillation.teacher_path is None and plain.distillation.spelled_by_keys
    before = copy.deepcopy(plain.distillation)
    plain.validate(world_size=4)
    assert plain.distillation == before
    assert launch(listed) == launch(plain) == (TeacherLayout(2, 1, str(tmp_path / "t0")),)
    own, keys = listed.distillation.teacher_args(0), plain.distillation.teacher_args(0)
    assert dataclasses.replace(own, index=None) == keys  # its settings; only the keys that name it differ
    assert teacher_title(keys, 3) == "Teacher rank 3"
    assert teacher_title(own, 3) == f"Teacher 0 ({tmp_path / 't0'}) on rank 3"  # named as the user listed it


def test_several_teachers_lay_out_after_the_students(tmp_path):
    args = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}, n_teacher_ranks: 2}}", "{{path: {t1}, sources: [code]}}"),
                   "data.sources={pydocs: 1.0, code: 1.0}")
    args.validate(world_size=7)
    assert [t.ranks for t in launch(args)] == [2, 1]
    one = args.distillation.teacher_args(1)
    assert isinstance(one, OneTeacherArgs) and (one.teacher_path, one.n_teacher_ranks) == (str(tmp_path / "t1"), 1)
    assert teacher_title(one, 6) == f"Teacher 1 ({tmp_path / 't1'}) on rank 6"


def test_uld_with_several_teachers_and_a_cached_teacher_beside_an_online_one(tmp_path):
    """Refused while there were two copies of each road, both validate now: ULD for the cross-tokenizer teachers of
    several, and a cached teacher beside an online one (only the online one has ranks; the students read the cache)."""
    uld = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}}}", "{{path: {t1}, cross_tokenizer: true}}"),
                  "distillation.uld_weight=0.5")
    uld.validate(world_size=4)
    assert [t.ranks for t in launch(uld)] == [1, 1]
    mixed = kd_args(tmp_path, teachers(tmp_path, "{{cache_dir: {t0}}}", "{{path: {t1}}}"))
    mixed.validate(world_size=3)
    kd = mixed.distillation
    assert kd.source == "online" and kd.online_teachers() == [1]
    assert launch(mixed) == (TeacherLayout(1, 1, str(tmp_path / "t1")),)


@pytest.mark.parametrize("overrides,words", [
    (["distillation.teacher_path={t0}", "{{path: {t0}}}", "{{path: {t1}}}"],
     "set teacher_path=null or remove distillation.teachers"),
    (["{{path: {t0}, weight: 0.0}}", "{{path: {t1}}}"], "distillation.teachers[0].weight=0.0"),
    (["{{path: {t0}}}", "{{path: {t1}, sources: [nowhere]}}"], "'nowhere' is not in data.sources"),
    (["{{path: {t0}}}", "{{path: {t1}, sources: [code]}}", "data.sources={{pydocs: 1.0, code: 0.0}}"],
     "every source it lists has weight 0 in data.sources, so it would teach nothing"),
    (["{{path: {t0}}}", "{{path: /no/such/dir}}"], "distillation.teachers[1].path='/no/such/dir'; that directory does not exist"),
    (["{{path: {t0}}}", "{{path: {t1}, cross_tokenizer: true}}", "distillation.output=full"],
     "another tokenizer (distillation.teachers[1].cross_tokenizer=true) cannot give"),
    (["{{path: {t0}}}", "{{path: {t1}}}", "distillation.source=cache"],
     "distillation.source='cache'; with distillation.teachers every teacher names its cache"),
    (["{{cache_dir: {t0}}}", "{{cache_dir: {t1}}}", "distillation.cache_dir=/tmp"],
     "distillation.cache_dir='/tmp'; with distillation.teachers name each teacher's cache (teachers[i].cache_dir)"),
    (["{{path: {t0}, cache_dir: {t1}}}", "{{cache_dir: {t1}}}"],
     "a teacher runs online (path, on its own ranks) or from its cache (cache_dir); remove one of them"),
    (["{{path: {t0}, n_teacher_ranks: 3}}", "{{path: {t1}}}"], "teacher 0's 3 replica(s)"),
    (["{{path: {t0}}}", "{{path: {t1}}}", "distributed.teacher_placement=per_node"], "teacher_placement=last"),
    (["{{path: {t0}}}", "{{path: {t1}}}", "distillation.uld_weight=0.5"],
     "set distillation.cross_tokenizer=true (with several teachers, on one of them), or uld_weight=0"),
    (["{{path: {t0}}}", "{{path: {t1}}}", "distillation.n_teacher_ranks=2"],
     "distillation.n_teacher_ranks=2; with distillation.teachers set it per teacher (teachers[i].n_teacher_ranks)"),
    (["{{path: {t0}}}", "{{path: {t1}}}", "distillation.teacher_tokenizer={t0}"],
     "with distillation.teachers set it per teacher (teachers[i].tokenizer)"),
    (["{{path: {t0}, teacher_dtype: bf17}}", "{{path: {t1}}}"],
     "distillation.teachers[0].teacher_dtype='bf17'; use one of auto, bf16, fp32, fp16, or null"),
    (["{{path: {t0}}}", "{{path: {t1}, teacher_tp: 0}}"], "distillation.teachers[1].teacher_tp=0; use 1"),
    (["{{path: {t0}, n_teacher_ranks: 3, teacher_tp: 2}}", "{{path: {t1}}}"],
     "distillation.teachers[0].n_teacher_ranks=3; use a positive multiple of distillation.teachers[0].teacher_tp=2"),
    (["{{path: {t0}, n_teacher_ranks: 2}}", "{{path: {t1}}}", "distillation.teacher_tp=2"],
     "distillation.teachers[1].n_teacher_ranks=1; use a positive multiple of distillation.teacher_tp=2"),
    (["{{path: {t0}}}", "{{path: {t1}, n_teacher_ranks: 2, teacher_tp: 2, cross_tokenizer: true}}",
      "distillation.output=sampled"],
     "distillation.teachers[1].teacher_tp=2; distillation.teachers[1].cross_tokenizer=true with output=sampled draws "
     "from the teacher's probabilities added up per student id over its whole vocabulary, of which a tensor-parallel "
     "rank holds a slice; set teachers[1].teacher_tp=1, or output=topk"),
])
def test_each_bad_teacher_setting_is_one_sentence(tmp_path, overrides, words):
    listed = [o for o in overrides if o.startswith("{")]
    rest = [o.format(t0=tmp_path / "t0") for o in overrides if not o.startswith("{")]
    args = kd_args(tmp_path, teachers(tmp_path, *listed), *rest)
    sentence = refusal(args, world_size=5 if "n_teacher_ranks: 3}" in overrides[0] else 4)
    assert words in sentence and "\n" not in sentence, sentence


def test_each_teacher_may_have_its_own_dtype_and_tensor_parallelism(tmp_path):
    """teachers[i].teacher_dtype and teachers[i].teacher_tp replace the shared values for that teacher alone: a
    bf16 teacher sharded over 2 ranks beside an fp32 one on 1. The trainer's plan, stool's and the startup's count
    the ranks alike; sentences about a teacher's dtype name the key that set it."""
    from omegaconf import OmegaConf

    from lingua.distillation.args import dtype_setting
    from lingua.stool import launch_plan

    listed = teachers(tmp_path, "{{path: {t0}, n_teacher_ranks: 2, teacher_tp: 2, teacher_dtype: bf16}}", "{{path: {t1}}}")
    args = kd_args(tmp_path, listed, "distillation.teacher_dtype=fp32")
    args.validate(world_size=5)
    kd = args.distillation
    first, second = kd.teacher_args(0), kd.teacher_args(1)
    assert (first.teacher_dtype, first.teacher_tp, second.teacher_dtype, second.teacher_tp) == ("bf16", 2, "fp32", 1)
    assert (dtype_setting(first), dtype_setting(second)) == ("distillation.teachers[0].teacher_dtype",
                                                             "distillation.teacher_dtype")
    assert [t.tp for t in launch(args)] == [2, 1]
    plan = LaunchPlan.for_launch(args.distributed, 5, 5, launch(args))
    assert plan.replicas() == [([2, 3], [0, 1]), ([4], [0, 1])]
    assert "  teacher replica 0: global ranks 2-3 (node 0, local ranks 2-3), tensor-parallel over 2, serving " \
           "students 0-1" in plan.describe() and "  teacher: global rank 4 (node 0, local rank 4)" in plan.describe()
    cfg = OmegaConf.create({"enable_distillation": True, "distillation": {
        "teachers": [{"path": "a", "n_teacher_ranks": 2, "teacher_tp": 2}, {"path": "b"}]}})
    assert launch_plan(cfg, nodes=1, ntasks_per_node=5)[0].replicas() == plan.replicas()
    # The shared teacher_tp=2 with a teacher of its own teacher_tp=1: 2 + 2 + 1 ranks.
    shared = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}, n_teacher_ranks: 2}}",
                                        "{{path: {t1}, teacher_tp: 1}}"), "distillation.teacher_tp=2")
    shared.validate(world_size=5)
    assert [t.tp for t in launch(shared)] == [2, 1]
    # One teacher in the list runs with its own dtype and tensor parallelism, as one of two does.
    one = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}, n_teacher_ranks: 2, teacher_tp: 2, teacher_dtype: bf16}}"))
    one.validate(world_size=4)
    own = one.distillation.teacher_args(0)
    assert (own.teacher_tp, own.teacher_dtype) == (2, "bf16")
    assert launch(one) == (TeacherLayout(2, 2, str(tmp_path / "t0")),)
    with pytest.raises(ConfigError, match=r"distillation.teachers\[0\].teacher_dtype='fp8'; use one of auto"):
        kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}, teacher_dtype: fp8}}")).validate(world_size=2)
    one_cfg = OmegaConf.create({"enable_distillation": True, "distillation": {
        "teachers": [{"path": "a", "n_teacher_ranks": 2, "teacher_tp": 2}]}})
    assert launch_plan(one_cfg, nodes=1, ntasks_per_node=4)[0].replicas() == [([2, 3], [0, 1])]


def test_a_teachers_own_teacher_tp_must_divide_its_heads(tmp_path):
    """Head counts are checked against each teacher's own teacher_tp, and the sentence names that key."""
    args = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}}}", "{{path: {t1}, n_teacher_ranks: 4, teacher_tp: 4}}"))
    (tmp_path / "t1" / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2,
                                                             "max_position_embeddings": 4096}))
    assert refusal(args, world_size=7).startswith("distillation.teachers[1].teacher_tp=4; the teacher has 6 "
                                                  "attention heads and 2 KV heads")


def test_an_unknown_teacher_key_names_the_element(tmp_path):
    with pytest.raises(ConfigError, match=r"Unknown config key 'distillation.teachers\[1\].wieght'"):
        kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}}}", "{{path: {t1}, wieght: 2}}"))


def test_the_launch_plan_gives_each_student_one_bridge_per_teacher():
    plan = LaunchPlan.for_launch(DistributedArgs(), 7, 7, (TeacherLayout(2), TeacherLayout(1)))
    assert plan.student_ranks == [0, 1, 2, 3] and plan.teacher_models == [[4, 5], [6]]
    assert plan.replicas() == [([4], [0, 1]), ([5], [2, 3]), ([6], [0, 1, 2, 3])]
    assert [plan.bridge_index(2, teacher) for teacher in (0, 1)] == [1, 2]
    assert [plan.bridge_index(rank) for rank in (4, 5, 6)] == [0, 1, 2]
    assert [plan.teacher_of_bridge(bridge) for bridge in range(3)] == [0, 0, 1]
    assert "  teacher 1: global ranks 6" in plan.describe()
    # One teacher: the same layout, its rank named "teacher" and no per-teacher line.
    one = LaunchPlan.for_launch(DistributedArgs(), 3, 3, (TeacherLayout(1, 1, "a"),))
    assert one.teacher_models == [[2]] and one.rank_words(2) == "teacher"
    assert not any(line.startswith("  teacher 0") for line in one.describe())


def test_batches_say_which_source_each_row_comes_from(tmp_path):
    for source, letter in (("pydocs", "p"), ("code", "c")):
        (tmp_path / source).mkdir()
        lines = [json.dumps({"text": letter * 40}) for _ in range(20)]
        (tmp_path / source / f"{source}.chunk.0.jsonl").write_text("\n".join(lines) + "\n")
    args = DataArgs(root_dir=str(tmp_path), sources={"pydocs": 1.0, "off": 0.0, "code": 1.0}, batch_size=8,
                    seq_len=16, load_async=False, add_bos=False, add_eos=False)
    assert active_sources(args.sources) == ["pydocs", "code"]
    batch = next(iter(DataLoader(args, ByteTokenizer(), 0, 1)))
    ids = batch["source_ids"]
    assert ids.shape == (8,) and set(ids.tolist()) == {0, 1}
    for row, source in zip(batch["input_ids"], ids.tolist()):
        assert set(row.tolist()) == {ord("pc"[source])}


def topk_outputs(generator, B, S, V, k) -> TeacherOutputs:
    logits = torch.randn(B, S, V, generator=generator, dtype=torch.float64) * 2
    values, ids = logits.log_softmax(-1).topk(k)
    rest = torch.log1p(-values.exp().sum(-1).clamp(max=1 - 1e-9))
    return TeacherOutputs("topk", values.float(), ids.int(), rest.float())


def test_routing_and_weights_per_source_and_alignment():
    listed = [TeacherArgs(path="a", weight=3.0, sources=["pydocs", "code"]), TeacherArgs(path="b", weight=1.0, sources=["code"]),
              TeacherArgs(path="c", sources=["web"])]
    routing = source_routing(listed, ["pydocs", "code", "books"])
    assert routing.tolist() == [[3.0, 0.0, 0.0], [3.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    aligned = torch.tensor([[1.0, 0.0, 1.0]] * 3)  # teacher 0 is cross-tokenizer: no target at position 1
    weights = mixing_weights(routing, torch.tensor([0, 1, 2]), [aligned, None, None], (3, 3))
    assert torch.stack(weights).tolist() == [
        [[1.0, 0.0, 1.0], [0.75, 0.0, 0.75], [0.0, 0.0, 0.0]],  # pydocs: teacher 0 alone (and CE at position 1)
        [[0.0, 0.0, 0.0], [0.25, 1.0, 0.25], [0.0, 0.0, 0.0]],  # code: 3:1, teacher 1 alone where 0 has no target
        [[0.0] * 3] * 3,  # teacher 2 teaches web, not a source here; books rows have no teacher: CE only
    ]


@pytest.mark.parametrize("fused", [True, False])
def test_the_mixed_loss_is_the_weighted_sum_of_each_teachers_kd(fused):
    generator = torch.Generator().manual_seed(0)
    B, S, D, V, k, alpha, T = 3, 5, 8, 40, 6, 0.4, 2.0
    hidden = torch.randn(B, S, D, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, D, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=generator)
    labels[0, :2] = -100
    outputs = [topk_outputs(generator, B, S, V, k) for _ in range(2)]
    routing = source_routing([TeacherArgs(weight=2.0), TeacherArgs(sources=["code"])], ["text", "code"]).double()
    weights = mixing_weights(routing, torch.tensor([0, 1, 1]), [None, None], (B, S))
    args = DistillationArgs(temperature=T, alpha=alpha, fused_loss=fused, divergence="rkl")
    n_valid = int((labels != -100).sum())
    loss, ce, stats = mixed_head_loss(hidden, head, labels, outputs, weights, n_valid, alpha, args)
    grads = torch.autograd.grad(loss, (hidden, head))
    # The expected: CE and each teacher's KD (weighted by its weights) from separate fused calls at alpha = 1/0.
    ce_only = fused_linear_kd_loss(hidden, head, labels, None, n_valid, 0.0, T)[0]
    kd_terms = [fused_linear_kd_loss(hidden, head, labels, out, n_valid, 1.0, T, "rkl", kd_weight=w)
                for out, w in zip(outputs, weights)]
    expected = (1 - alpha) * ce_only + alpha * sum(term for term, _ in kd_terms)
    expected_grads = torch.autograd.grad(expected, (hidden, head))
    # fused=False is the research path (autograd), checked against the fused calls: equal to float64's rounding of
    # two implementations; the statistics come back in fp32.
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12 if fused else 1e-7)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-9 if fused else 1e-5, atol=1e-12 if fused else 1e-7)
    assert ce.item() == pytest.approx(ce_only.item(), rel=1e-6)
    for i, (_, sums) in enumerate(kd_terms):  # each teacher's share of loss/kd, mass and agreement
        got = torch.stack([stats[name][i] for name in ("kd", "teacher_mass", "top1_agreement")])
        torch.testing.assert_close(got, sums[1:].double() / n_valid, rtol=1e-5, atol=1e-7)
    valid = labels != -100
    assert stats["weight"].tolist() == pytest.approx([float((w * valid).sum()) / n_valid for w in weights])
    # Row 0 (text) is teacher 0's alone; rows 1-2 (code) are 2:1; the weights of a taught position add to 1.
    assert weights[1][0].abs().sum() == 0 and torch.allclose(weights[0][1:] + weights[1][1:], torch.ones(2, S, dtype=torch.float64))
    metrics = teacher_metrics(stats, [False, True])
    assert set(metrics) == {f"kd/{i}/{name}" for i in (0, 1) for name in ("loss", "teacher_mass", "top1_agreement",
                                                                       "weight")} | {"kd/1/aligned"}


def cross_sampled_outputs(generator, B, S, V, k) -> TeacherOutputs:
    """A cross-tokenizer teacher's sampled targets: draws through a random map, unmapped draws as id -1."""
    from lingua.distillation.cross_tokenizer.targets import sample_student_ids
    from tests.unit.lingua.distillation.cross_tokenizer.test_targets import random_map

    return sample_student_ids(torch.randn(B, S, 2 * V, generator=generator) * 2, k, 1.0,
                              random_map(2 * V, V, generator), torch.float32, generator)


@pytest.mark.parametrize("make_outputs", [topk_outputs, cross_sampled_outputs])
@pytest.mark.parametrize("alpha", [0.3, 0.0])
def test_teachers_on_shared_gemms_equal_one_call_per_teacher(alpha, make_outputs):
    """The fused loss with more_teachers (one set of head GEMMs, weight_grad=accumulate) and the per-teacher calls
    it falls back to (vocab_blocks here) give the same loss, gradients and statistics; at alpha = 0 too, where the
    loss is CE alone and every teacher's KD is still measured (teachers 1+ once read 0 there); and for
    cross-tokenizer sampled targets, whose unmapped draws (id -1) add nothing."""
    generator = torch.Generator().manual_seed(1)
    B, S, D, V, k = 2, 7, 8, 50, 5
    hidden = torch.randn(B, S, D, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, D, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=generator)
    outputs = [make_outputs(generator, B, S, V, k) for _ in range(3)]
    weights = [torch.rand(B, S, generator=generator, dtype=torch.float64) for _ in range(3)]
    results = []
    for weight_grad in ("accumulate", "vocab_blocks"):
        args = DistillationArgs(alpha=alpha, loss_weight_grad=weight_grad, loss_chunk_size=4)
        loss, ce, stats = mixed_head_loss(hidden, head, labels, outputs, weights, B * S, alpha, args)
        results.append((loss, ce, stats, torch.autograd.grad(loss, (hidden, head))))
    (loss_a, ce_a, stats_a, grads_a), (loss_b, ce_b, stats_b, grads_b) = results
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-12)
    assert ce_a.item() == pytest.approx(ce_b.item(), rel=1e-6)
    assert list(stats_a) == list(stats_b)
    for name in stats_a:
        torch.testing.assert_close(stats_a[name], stats_b[name], rtol=1e-5, atol=1e-7)
    assert (stats_b["kd"] > 0).all()  # every teacher's KD, whatever alpha
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_sentences_about_a_teacher_name_it_by_index_and_path(tmp_path):
    """A teacher that failed to load (its handshake record), or a rank that stopped (the lost-peer sentence's
    words for it): with several teachers the sentence says which teacher, with one it reads as before."""
    from lingua.distillation.online.bridge import HandshakeRecord, agreed_settings, check_handshake
    from lingua.errors import TeacherError

    args = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}}}", "{{path: {t1}}}")).distillation
    failed = HandshakeRecord("teacher", 3, 0, 0, agreed_settings(args), loaded=False, message="no such file")
    student = HandshakeRecord("student", 0, 256, 0, agreed_settings(args), max_bsz=2, max_seqlen=8)
    with pytest.raises(TeacherError, match=rf"^Teacher 1 \({tmp_path / 't1'}\) on rank 3 failed to load: no such "):
        check_handshake([student, failed], args.teacher_args(1))
    with pytest.raises(TeacherError, match=r"^Teacher rank 3 failed to load: no such file"):
        check_handshake([student, failed], DistillationArgs(teacher_path="x"))
    plan = LaunchPlan.for_launch(DistributedArgs(), 5, 5, (TeacherLayout(2, 1, "a"), TeacherLayout(1, 1, "b")))
    assert [plan.rank_words(rank) for rank in range(5)] == ["student", "student", "teacher 0 (a)", "teacher 0 (a)",
                                                            "teacher 1 (b)"]
    assert LaunchPlan(3, 3, (TeacherLayout(1, 1, "a"),)).rank_words(2) == "teacher"


def test_the_cache_writer_refuses_several_teachers_and_takes_a_one_teacher_list(tmp_path):
    from apps.main.teacher_cache import TeacherCacheArgs

    overrides = [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}", f"data.root_dir={tmp_path / 'corpus'}",
                 "data.tokenizer.name=bytes", "data.tokenizer.path=null", "distillation.teacher_path=null",
                 f"cache_dir={tmp_path / 'cache'}"]
    kd_args(tmp_path)  # the stubs
    several = parse_args(TeacherCacheArgs, overrides + [teachers(tmp_path, "{{path: {t0}}}", "{{path: {t1}}}")])
    with pytest.raises(ConfigError, match=r"the cache writer runs one teacher: write each teacher's cache"):
        several.validate(world_size=1)
    one = parse_args(TeacherCacheArgs, overrides + [teachers(tmp_path, "{{path: {t1}}}")])
    one.validate(world_size=1)  # the writer runs the settings of its one listed teacher
    assert one.distillation.teacher_path == str(tmp_path / "t1")


def test_a_refused_bridge_does_not_skip_the_next_ones_exchange(tmp_path, monkeypatch):
    """A student exchanges its records on every bridge before it checks any: teacher 0 refused must not leave
    teacher 1 waiting in an exchange the student skipped; then every rank shares the verdicts and raises."""
    from types import SimpleNamespace

    from lingua.distillation.online import bridge
    from lingua.distillation.online.bridge import HandshakeRecord, agreed_settings
    from lingua.errors import TeacherError

    args = kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}}}", "{{path: {t1}}}")).distillation
    settings = agreed_settings(args)
    student = HandshakeRecord("student", 0, 256, 7, settings, max_bsz=2, max_seqlen=8)
    teacher_records = {0: HandshakeRecord("teacher", 2, 0, 0, settings, loaded=False, message="broken"),
                       1: HandshakeRecord("teacher", 3, 256, 7, settings)}
    exchanged = []

    def exchange(view, mine):
        exchanged.append(view.teacher_view)
        return [mine, teacher_records[view.teacher_view]]

    def all_gather_object(out, verdict, group):
        out[:] = [verdict] + [None] * (len(out) - 1)

    monkeypatch.setattr(bridge, "exchange_records", exchange)
    monkeypatch.setattr(bridge.dist, "all_gather_object", all_gather_object)
    topo = SimpleNamespace(world_size=4, teacher_ranks=[2, 3])
    views = [SimpleNamespace(teacher_view=i) for i in (0, 1)]
    with pytest.raises(TeacherError, match=r"^Teacher 0 \(.*t0\) on rank 2 failed to load: broken"):
        bridge.agreed_handshakes(topo, [(view, student, args.teacher_args(i)) for i, view in enumerate(views)])
    assert exchanged == [0, 1]


def test_a_one_teacher_list_refuses_the_keys_it_would_override(tmp_path):
    """A one-element list sets its own n_teacher_ranks: a top-level value beside it would be silently ignored, so
    it is one sentence."""
    with pytest.raises(ConfigError, match="distillation.n_teacher_ranks=2; with distillation.teachers set it per"):
        kd_args(tmp_path, teachers(tmp_path, "{{path: {t0}}}"), "distillation.n_teacher_ranks=2").validate(world_size=4)


def test_each_cross_tokenizer_teacher_gets_the_label_past_each_window():
    """Every teacher is asked every micro-batch; a cross-tokenizer one also gets each row's label past the window
    (its last position aligns through it, as with one teacher), a same-tokenizer one does not."""
    from types import SimpleNamespace

    from lingua.distillation.online.distiller import OnlineDistiller

    class Client:
        def __init__(self, kd_weight):
            self.spec, self.device, self.calls = SimpleNamespace(doc_boundaries=True, kd_weight=kd_weight), "cpu", []
            self.teacher_heldout_ce = self.teacher_heldout_bpb = None

        def submit(self, *args):
            self.calls.append(args)
            return len(self.calls)

    clients = [Client(False), Client(True)]
    args = DistillationArgs(teachers=[TeacherArgs(path="a"), TeacherArgs(path="b", cross_tokenizer=True)])
    distiller = OnlineDistiller(args, clients, 0, torch.ones(1, 2), [(None, None)] * 2)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
             "doc_ids": torch.zeros(2, 4, dtype=torch.long), "source_ids": torch.zeros(2, dtype=torch.int32)}
    source_ids, handles, cached = distiller.submit(batch, 3, 1)
    assert handles == [1, 1] and source_ids is batch["source_ids"] and cached == []
    (same,), (cross,) = clients[0].calls, clients[1].calls
    assert same[4] is None and cross[4].tolist() == [4, 8]
    assert same[3] is batch["doc_ids"] and cross[1:3] == (3, 1)


def test_stool_lays_out_several_teachers_as_the_trainer_does():
    """stool's plan counts each listed teacher's ranks (not the one-teacher n_teacher_ranks), so its printout and
    its refusals match the trainer's: two teachers of 2 ranks each with teacher_tp=2 is a valid plan."""
    from omegaconf import OmegaConf

    from lingua.stool import launch_plan

    cfg = OmegaConf.create({"enable_distillation": True, "distillation": {
        "teacher_tp": 2, "teachers": [{"path": "a", "n_teacher_ranks": 2}, {"path": "b", "n_teacher_ranks": 2}]}})
    plan, placement = launch_plan(cfg, nodes=1, ntasks_per_node=8)
    assert placement is None and plan.teacher_models == [[4, 5], [6, 7]] and plan.student_ranks == [0, 1, 2, 3]
    two_nodes, placement = launch_plan(OmegaConf.create({"enable_distillation": True, "distillation": {
        "teachers": [{"path": "a"}, {"path": "b"}]}}), nodes=2, ntasks_per_node=2)
    assert placement is None and two_nodes.teacher_models == [[2], [3]]


def test_each_teachers_held_out_reference_is_logged_under_its_index():
    """The teachers' own held-out CE and bits per byte (each bridge's handshake carries its teacher's) go into the
    first eval row as eval/<i>/teacher_loss and eval/<i>/teacher_bpb, as kd/<i>/...; a cross-tokenizer teacher has
    bits per byte only. One teacher keeps eval/teacher_loss and eval/teacher_bpb."""
    from types import SimpleNamespace

    from lingua.distillation.cache.distiller import CacheDistiller
    from lingua.distillation.distiller import Distiller
    from lingua.distillation.online.distiller import OnlineDistiller

    clients = [SimpleNamespace(device="cpu", teacher_heldout_ce=2.5, teacher_heldout_bpb=3.5),
               SimpleNamespace(device="cpu", teacher_heldout_ce=None, teacher_heldout_bpb=4.25)]
    args = DistillationArgs(teachers=[TeacherArgs(path="a"), TeacherArgs(path="b", cross_tokenizer=True)])
    several = OnlineDistiller(args, clients, 0, torch.ones(1, 2), [(None, None)] * 2)
    assert several.teacher_heldout_row() == {"eval/0/teacher_loss": 2.5, "eval/0/teacher_bpb": 3.5,
                                             "eval/1/teacher_bpb": 4.25}
    one = CacheDistiller(DistillationArgs(teachers=[TeacherArgs(cache_dir="a")]), heldout=[(2.5, 3.5)])  # eval/...
    assert one.teacher_heldout_row() == {"eval/teacher_loss": 2.5, "eval/teacher_bpb": 3.5}
    assert Distiller(DistillationArgs()).teacher_heldout_row() == {}  # CE only, or no eval asked of the teacher


def test_a_validated_config_read_again_keeps_its_lone_teacher(tmp_path):
    """The dumped config of a validated run holds teacher_path and its list of one: the trainer reads it as the same
    run, and the cache writer takes it as its one teacher; a lone cached teacher checks no checkpoint."""
    from apps.main.teacher_cache import TeacherCacheArgs

    args = kd_args(tmp_path, f"distillation.teacher_path={tmp_path / 't0'}")
    args.validate(world_size=3)
    dumped = parse_args(TrainArgs, [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}",
                                    f"data.root_dir={tmp_path / 'corpus'}", "data.tokenizer.name=bytes",
                                    "data.tokenizer.path=null", f"distillation.teacher_path={tmp_path / 't0'}",
                                    f"distillation.teachers=[{{path: {tmp_path / 't0'}}}]"])
    dumped.validate(world_size=3)
    assert dumped.distillation == args.distillation and [t.ranks for t in launch(dumped)] == [1]
    writer = parse_args(TeacherCacheArgs, [f"config={ROOT / 'configs/distill_exps/debug_cpu.yaml'}",
                                           f"data.root_dir={tmp_path / 'corpus'}", "data.tokenizer.name=bytes",
                                           "data.tokenizer.path=null", f"distillation.teacher_path={tmp_path / 't0'}",
                                           f"distillation.teachers=[{{path: {tmp_path / 't0'}}}]",
                                           f"cache_dir={tmp_path / 'cache'}"])
    writer.validate(world_size=1)
    cached = kd_args(tmp_path, "distillation.teacher_path=/no/such/teacher", "distillation.source=cache",
                     f"distillation.cache_dir={tmp_path / 'cache'}")
    cached.validate(world_size=2)  # the teacher's checkpoint is not read: its cache holds its outputs
    assert cached.distillation.teachers == [TeacherArgs(cache_dir=str(tmp_path / "cache"))]


def test_one_teacher_that_teaches_some_sources_is_named_as_one_and_still_routed():
    """A list of one with `sources` is one teacher: the one-teacher metric names (kd/*, eval/*; no kd/0/*), while its
    KD weight still follows the sources it teaches (a row of another source takes CE alone)."""
    from types import SimpleNamespace

    from lingua.distillation.cache.distiller import CacheDistiller

    args = DistillationArgs(teachers=[TeacherArgs(cache_dir="a", sources=["code"])])
    one = CacheDistiller(args, source_routing(args.teachers, ["pydocs", "code"]), heldout=[(2.5, 3.5)])
    assert one.teacher_heldout_row() == {"eval/teacher_loss": 2.5, "eval/teacher_bpb": 3.5}
    (weight,) = one._weights(torch.tensor([0, 1]), [SimpleNamespace(kd_weight=None)],
                             torch.zeros(2, 3, dtype=torch.long), torch.device("cpu"))
    assert weight.tolist() == [[0.0] * 3, [1.0] * 3]  # pydocs untaught, code taught
    one.alpha = 0.5
    one.kd_stats = {name: torch.tensor(1.0) for name in ("kd", "teacher_mass", "top1_agreement")}
    one.stats = {"ce": torch.tensor(2.0, dtype=torch.float64), **{name: torch.ones(1) for name in
                 ("kd", "teacher_mass", "top1_agreement", "weight", "aligned")}}
    assert not any(key.startswith(("kd/0/", "eval/0/")) for key in one.step_metrics())
    alone = CacheDistiller(DistillationArgs(teachers=[TeacherArgs(cache_dir="a")]), heldout=[(None, None)])
    assert alone._weights(None, [SimpleNamespace(kd_weight=None)], torch.zeros(2, 3), torch.device("cpu")) == [None]
