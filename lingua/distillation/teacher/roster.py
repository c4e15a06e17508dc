"""The launch's teachers, one or several (`distillation.teachers`): the checks of each before any process group,
and which teacher a teacher rank serves as.

    check_teachers_fit(args.distillation, args.data)               # positions, head counts, sources of each teacher
    kd, names = serving_args(args.distillation, topo)              # a teacher rank's own settings, every name
"""

from lingua.distillation.args import DistillationArgs, check_seq_len_fits_teacher, tp_setting
from lingua.distillation.loss.mixture import check_teacher_sources
from lingua.distillation.teacher.model import read_max_positions
from lingua.distillation.teacher.tensor_parallel import heads_problem, read_teacher_config
from lingua.errors import ConfigError


def check_teachers_fit(kd: DistillationArgs, data) -> None:
    """Every online teacher's positions fit data.seq_len and its heads divide by its teacher_tp (from its config.json
    when on disk; a hub teacher is checked at the handshake); every source a teacher lists is a data source."""
    for i in kd.online_teachers():  # a validated config: one teacher is a list of one
        teacher = kd.teacher_args(i)
        # From its config.json when on disk (a missing teacher is its own error); cross-tokenizer rows are cut.
        max_positions = 0 if teacher.cross_tokenizer else read_max_positions(teacher.teacher_path)
        check_seq_len_fits_teacher(data.seq_len, max_positions or 0,
                                   f"max_position_embeddings in {teacher.teacher_path}/config.json")
        check_heads_divide(teacher.teacher_path, teacher.teacher_tp, tp_setting(kd, i))
    check_teacher_sources(kd.teachers, data.sources)


def check_heads_divide(teacher_path: str, tp: int, key: str = "distillation.teacher_tp") -> None:
    """A teacher's head counts divide by its teacher_tp (set by `key`), from its config.json when on disk."""
    config = read_teacher_config(teacher_path)
    if config is not None and (problem := heads_problem(config, tp, f"{teacher_path}/config.json", key)) is not None:
        raise ConfigError(problem)


def serving_args(kd: DistillationArgs, topo) -> tuple[DistillationArgs, tuple[str, ...]]:
    """(the settings this teacher rank serves with, the name of every teacher when there are several)."""
    if not kd.several_teachers:
        return kd, ()
    online = kd.online_teachers()  # the launch's teachers: those with ranks of their own
    names = tuple(f"teacher {i} ({kd.teachers[i].path})" for i in online)
    return kd.teacher_args(online[topo.plan.teacher_of_bridge(topo.my_bridge)]), names
