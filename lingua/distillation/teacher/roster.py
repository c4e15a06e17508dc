"""The launch's teachers (`distillation.teachers`, one or more): the checks of each before any process group,
and which teacher a teacher rank serves as.

    check_teachers_fit(args.distillation, args.data)               # positions, head counts, sources of each teacher
    kd, names = serving_args(args.distillation, topo)              # a teacher rank's own settings, every name
"""

from lingua.distillation.args import DistillationArgs, check_seq_len_fits_teacher, tp_setting
from lingua.distillation.loss.mixture import check_teacher_sources
from lingua.distillation.teacher.tensor_parallel import heads_problem, read_teacher_config
from lingua.errors import ConfigError


def check_teachers_fit(kd: DistillationArgs, data) -> None:
    """Every online teacher's positions fit data.seq_len and its heads divide by its teacher_tp (from its config.json
    when on disk; a hub teacher is checked at the handshake); every source a teacher lists is a data source."""
    for i in kd.online_teachers():  # a validated config: one teacher is a list of one
        teacher = kd.teacher_args(i)
        config = read_teacher_config(teacher.teacher_path)  # None: a hub teacher, or a missing one (its own error)
        if config is None:
            continue
        where = f"{teacher.teacher_path}/config.json"
        if not teacher.cross_tokenizer:  # a cross-tokenizer teacher's rows are cut to its positions
            check_seq_len_fits_teacher(data.seq_len, max_positions(config), f"max_position_embeddings in {where}")
        problem = heads_problem(config, teacher.teacher_tp, where, tp_setting(kd, i))
        if problem is not None:
            raise ConfigError(problem)
    check_teacher_sources(kd.teachers, data.sources)


def max_positions(config: dict) -> int:
    """`max_position_embeddings` of a config.json (its text config's for a multimodal one); 0 when unknown."""
    value = config.get("max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings"))
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def serving_args(kd: DistillationArgs, topo) -> tuple[DistillationArgs, tuple[str, ...]]:
    """(the settings this teacher rank serves with: its teacher's, the name of every teacher beside others)."""
    online = kd.online_teachers()  # the launch's teachers: those with ranks of their own
    names = tuple(f"teacher {i} ({kd.teachers[i].path})" for i in online) if len(kd.teachers) > 1 else ()
    return kd.teacher_args(online[topo.plan.teacher_of_bridge(topo.my_bridge)]), names
