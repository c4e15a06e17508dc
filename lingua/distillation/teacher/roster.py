"""The launch's teachers, one or several (`distillation.teachers`): the checks of each before any process group,
and which teacher a teacher rank serves as.

    check_teachers_fit(args.distillation, args.data)               # positions, head counts, sources of each teacher
    kd, names = serving_args(args.distillation, topo)              # a teacher rank's own settings, every name
"""

from lingua.distillation.args import DistillationArgs, check_seq_len_fits_teacher, tp_setting
from lingua.distillation.mixture import check_teacher_sources
from lingua.distillation.teacher.model import read_max_positions
from lingua.distillation.teacher.tensor_parallel import heads_problem, read_teacher_config
from lingua.errors import ConfigError


def each_teacher(kd: DistillationArgs) -> list[DistillationArgs]:
    """The settings of each teacher: the one of teacher_path, or each of distillation.teachers."""
    return [kd.teacher_args(i) for i in range(len(kd.teachers))] if kd.teachers else [kd]


def check_teachers_fit(kd: DistillationArgs, data) -> None:
    """Every teacher's positions fit data.seq_len and its heads divide by its teacher_tp (from its config.json when
    on disk; a hub teacher is checked at the handshake); every source a teacher lists is a data source."""
    for i, teacher in enumerate(each_teacher(kd)):
        if not teacher.teacher_path:
            continue
        # From its config.json when on disk (a missing teacher is its own error); cross-tokenizer rows are cut.
        max_positions = 0 if teacher.cross_tokenizer else read_max_positions(teacher.teacher_path)
        check_seq_len_fits_teacher(data.seq_len, max_positions or 0,
                                   f"max_position_embeddings in {teacher.teacher_path}/config.json")
        check_heads_divide(teacher.teacher_path, teacher.teacher_tp,
                           tp_setting(kd, i) if kd.teachers else "distillation.teacher_tp")
    check_teacher_sources(kd.teachers, data.sources)


def check_heads_divide(teacher_path: str, tp: int, key: str = "distillation.teacher_tp") -> None:
    """A tensor-parallel teacher's attention and KV head counts divide by its teacher_tp (set by `key`; from its
    config.json when it is on disk; a hub teacher is checked when it loads)."""
    config = read_teacher_config(teacher_path)
    if config is not None and (problem := heads_problem(config, tp, f"{teacher_path}/config.json", key)) is not None:
        raise ConfigError(problem)


def serving_args(kd: DistillationArgs, topo) -> tuple[DistillationArgs, tuple[str, ...]]:
    """(the settings this teacher rank serves with, the name of every teacher when there are several)."""
    if not kd.teachers:
        return kd, ()
    names = tuple(f"teacher {i} ({teacher.path})" for i, teacher in enumerate(kd.teachers))
    return kd.teacher_args(topo.plan.teacher_of_bridge(topo.my_bridge)), names
