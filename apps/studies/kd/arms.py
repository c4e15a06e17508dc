"""The study's arms (`ARMS`, `CACHES`), one training run (`Run`), and the checks of its inputs."""

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from apps.main.train import TrainArgs
from lingua.args import parse_args
from lingua.distillation.teacher.model import check_teacher_dir
from lingua.loading.documents import list_val_files
from lingua.errors import ConfigError, DataError


CONFIG = "configs/distill_exps/kd_study.yaml"
CLOZE_TASK = "pydocs_cloze"
EVAL_TIMEOUT_S = 1800.0
POLL_S = 2.0


@dataclass(frozen=True)
class Arm:
    overrides: tuple[str, ...]  # the arm's own training settings (on top of the config and shared overrides)
    cache: Optional[str] = None  # the teacher cache it trains from (a CACHES key); None: raw corpus, no teacher
    multiple: int = 1  # its tokens, in multiples of the KD arms' (steps x multiple)

    @property
    def is_ce(self) -> bool:
        return self.cache is None


CE_ONLY = ("enable_distillation=false",)
ARMS = {
    "ce": Arm(CE_ONLY),
    "ce_2x": Arm(CE_ONLY, multiple=2),
    "ce_4x": Arm(CE_ONLY, multiple=4),
    "kd_topk64": Arm(("distillation.alpha=0.5",), cache="topk64"),
    "kd_topk64_lr": Arm(("distillation.alpha=0.5", "distillation.alpha_schedule=lr"), cache="topk64"),
    "kd_sampled64": Arm(("distillation.alpha=0.5",), cache="sampled64"),
}
CACHES = {
    "topk64": ("distillation.output=topk", "distillation.k=64"),
    "sampled64": ("distillation.output=sampled", "distillation.k=64"),
}
CONDITIONAL_ARM = "ce_4x"  # run by `--ce-multiples auto` only when the 2x budget does not reach a KD result


@dataclass
class Run:
    arm: str
    seed: int
    dump_dir: Path
    overrides: list[str]  # everything after config=: shared, the arm's, its cache's, steps
    steps: int = 0
    cache_dir: Optional[Path] = None
    timeout_s: float = 3600.0
    stage: str = "train"  # "train", then "cloze" (the downstream eval of its final checkpoint)
    wall_s: Optional[float] = None  # seconds the training took, once finished
    started_at: float = 0.0  # perf_counter() when the current stage was launched
    started_unix: float = 0.0
    process: Optional[subprocess.Popen] = field(default=None, repr=False)


@dataclass(frozen=True)
class WallArm:
    """An arm of the data-wall mode (wall.py): every one reads a cache, the CE arms only its tokens (alpha = 0)."""

    overrides: tuple[str, ...]
    cache: str
    is_ce: bool


WALL_ARMS = {
    "ce": WallArm(("distillation.alpha=0.0",), "topk64", True),
    "ce_wd10x": WallArm(("distillation.alpha=0.0", "optim.weight_decay=1.0"), "topk64", True),
    "kd_topk64": WallArm(("distillation.alpha=0.5",), "topk64", False),
    "kd_sampled64": WallArm(("distillation.alpha=0.5",), "sampled64", False),
}


@dataclass
class WallRun(Run):
    epochs: int = 1  # reads of the U unique tokens


# ---- inputs


def study_args(config: str, overrides: list[str]) -> TrainArgs:
    """The training config every run shares (readable errors for a bad override come from here)."""
    return parse_args(TrainArgs, [f"config={config}", *overrides])


def check_inputs(args: TrainArgs) -> None:
    if args.heldout.every < 1 or args.steps % args.heldout.every:
        raise ConfigError(f"heldout.every={args.heldout.every} must divide steps={args.steps} so every run ends on an "
                          f"evaluation.")
    if not any(list_val_files(args.data.root_dir, source) for source in args.data.sources):
        raise DataError(f"no held-out *.val.jsonl under {args.data.root_dir}; run `python -m "
                        f"setup.prepare_corpus` (or `bash setup/demo.sh`, which also prepares the teacher).")
    check_teacher_dir(args.distillation.teacher_path)


def parse_multiples(text: str) -> Optional[list[int]]:
    """`auto` -> None (1x and 2x, 4x when needed); else the CE multiples to run, e.g. "1,2,4"."""
    if text.strip() == "auto":
        return None
    multiples = sorted({int(m) for m in text.split(",") if m.strip()})
    known = {arm.multiple for arm in ARMS.values() if arm.is_ce}
    if not multiples or set(multiples) - known:
        raise ConfigError(f"--ce-multiples {text!r}: use auto or a comma list of {', '.join(map(str, sorted(known)))}.")
    return multiples


def ce_arm_wanted(name: str, multiples: Optional[list[int]]) -> bool:
    """Phase one's CE arms: the forced multiples, or (auto) every CE arm but the conditional one."""
    arm = ARMS[name]
    return arm.multiple in multiples if multiples is not None else name != CONDITIONAL_ARM
