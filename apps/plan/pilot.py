"""`python -m apps.plan.pilot`: the multiplier of the planner's two pilot runs, as a results.json for kd_measurement=.

    python -m apps.plan.pilot ce=dumps/x_pilot_ce kd=dumps/x_pilot_kd out=dumps/x_pilot.json
    python -m apps.plan ... kd_measurement=dumps/x_pilot.json      # the plan is then measured here

A plan outside what was measured prints two pilot runs (evidence.pilot_commands): CE-only on every GPU to twice
the KD run's tokens, evaluating held-out CE often (`heldout.every`), and KD with the planned layout. This reads
both runs' held-out CE (the in-loop rows `eval/loss` of metrics.jsonl, else the checkpoint evals' rows of
metrics.validation.jsonl, the same source for both) and the tokens they trained (the training rows' `tokens`, every
student's), and computes the token multiplier as apps.studies.kd does (`interpolate_multiplier`): the CE
tokens at which the CE curve reaches the KD run's final held-out CE, linear in log(tokens) between the two evals
that bracket it, over the KD run's tokens; a bound where CE never reaches it ("at_least" its last eval's
multiple) or KD is worse than CE's first eval ("at_most" that one's). The results.json has the one-pass study's
shape (setup, arms, compute) with `mode: "pilot"`: verdict.read_measurement reads it, evidence.measured_settings
parses the KD run's own config.yaml for its settings, and its tokens are compared with the pilot's KD tokens of
the plan (a twentieth of the run, evidence.pilot_steps), not the whole run's.

One caveat the reader should know: kd_study reads each CE budget's final (a whole lr schedule each); a pilot reads
one CE run's curve, whose evals before its end come at a higher lr than a run of that length would end with. That
reads CE slightly worse at KD's tokens, so a pilot's multiplier leans towards KD.
"""

import dataclasses
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from apps.studies.kd.results import interpolate_multiplier, spread, token_multiplier
from apps.main.eval import METRICS_VALIDATION
from apps.main.train import TrainArgs
from apps.main.transformer import num_parameters
from apps.plan.sizes import read_teacher_shape, student_flops_per_token
from lingua.args import parse_args, to_dict
from lingua.cli.entry import run_cli
from lingua.errors import ConfigError, DataError, MissingPathError
from lingua.run.dump_dir import RunDir, eval_rows, read_jsonl, train_rows

# Keys the two pilots may set differently: the planner's pilot commands set them (the teacher, the layout, the
# length, how often to evaluate, where to write); every other key must be the same for the curves to compare.
# data.batch_size: the CE-only pilot takes the KD pilot's global batch on every GPU (per rank: fewer rows).
MAY_DIFFER = ("name", "dump_dir", "steps", "enable_distillation", "distillation", "distributed", "heldout.every",
              "data.batch_size",
              "checkpoint", "logging", "profiling", "eval", "async_eval_gpus", "probe_freq", "exit_after_steps",
              "preemption_grace_s")
MAY_DIFFER_PREFIXES = tuple(f"{key}." for key in MAY_DIFFER)
MUST_MATCH = ("distributed.model_dtype", "distributed.matmul_allow_tf32")  # the numerics, whatever the layout


@dataclasses.dataclass
class PilotArgs:
    """The two pilot runs the planner prints, and where to write their measurement."""

    ce: str = ""  # dump_dir of the CE-only pilot (enable_distillation=false, frequent heldout.every)
    kd: str = ""  # dump_dir of the KD pilot (the planned layout)
    out: str = "pilot_results.json"  # the results.json to write, for `python -m apps.plan kd_measurement=<out>`
    teacher_config: Optional[str] = None  # the teacher's config.json; default <the KD run's teacher_path>/config.json


@dataclasses.dataclass
class PilotRun:
    """One pilot's dump dir: its config, held-out CE per step (and where it was read), tokens per step."""

    dump_dir: Path
    args: TrainArgs
    heldout: dict[int, float]
    source: str
    tokens_per_step: float


def read_run(key: str, dump_dir: str) -> PilotRun:
    """The run in `dump_dir`; a missing dir, config, training rows or held-out CE is one sentence naming `key`."""
    run_dir = RunDir(Path(dump_dir).expanduser())
    if not run_dir.root.is_dir():
        raise MissingPathError(f"{key}={dump_dir} does not exist; pass the dump_dir of the planner's {key.upper()} "
                               f"pilot run.")
    if not run_dir.config.is_file():
        raise MissingPathError(f"{key}={dump_dir} has no config.yaml; pass the dump_dir of a finished "
                               f"apps.main.train run.")
    args = parse_args(TrainArgs, [f"config={run_dir.config}"])
    trained = [row for row in train_rows(run_dir.root).values() if row.get("tokens") and row["step"] > 0]
    if not trained:
        raise DataError(f"{key}={dump_dir} has no training rows with tokens in metrics.jsonl; let the run log at "
                        f"least one step (logging.freq) and pass its dump_dir.")
    last = max(trained, key=lambda row: row["step"])
    in_loop = {step: row["eval/loss"] for step, row in eval_rows(run_dir.root).items()}
    checkpoint = {row["global_step"]: row["heldout"]["ce"] for row in read_jsonl(run_dir.root / METRICS_VALIDATION)
                  if isinstance(row.get("heldout"), dict) and "ce" in row["heldout"] and "global_step" in row}
    heldout, source = (in_loop, "metrics.jsonl") if in_loop else (checkpoint, METRICS_VALIDATION)
    if not heldout:
        raise DataError(f"{key}={dump_dir} logged no held-out CE (no eval/loss rows in metrics.jsonl, no heldout "
                        f"rows in {METRICS_VALIDATION}); rerun it with heldout.every=<steps> as the plan prints.")
    return PilotRun(run_dir.root, args, dict(sorted(heldout.items())), source, last["tokens"] / last["step"])


def check_pair(ce: PilotRun, kd: PilotRun) -> None:
    """The CE pilot trained CE-only, the KD pilot distilled and finished with a held-out eval, both from one config
    and measured on the same held-out source; else one sentence."""
    if ce.args.enable_distillation:
        raise ConfigError(f"ce={ce.dump_dir} distilled (enable_distillation=true); pass the CE-only pilot's dump_dir.")
    if not kd.args.enable_distillation:
        raise ConfigError(f"kd={kd.dump_dir} did not distill (enable_distillation=false); pass the KD pilot's "
                          f"dump_dir.")
    if ce.source != kd.source:
        raise DataError(f"ce= logged its held-out CE in {ce.source} and kd= in {kd.source}; evaluate both the same "
                        f"way (heldout.every=<steps> on both, as the plan prints).")
    last_eval = max(kd.heldout)
    if last_eval != kd.args.steps:
        raise DataError(f"kd={kd.dump_dir}'s last held-out CE is at step {last_eval} of its {kd.args.steps}; let it "
                        f"finish with heldout.every dividing steps (the plan prints heldout.every=steps).")
    theirs, ours = flat(to_dict(ce.args)), flat(to_dict(kd.args))
    differ = sorted(key for key in theirs.keys() | ours.keys()
                    if theirs.get(key) != ours.get(key) and (key in MUST_MATCH or (
                        not key.startswith(MAY_DIFFER_PREFIXES) and key not in MAY_DIFFER)))
    if differ:
        key = differ[0]
        raise ConfigError(f"ce= and kd= were trained with different configs ({key}: {theirs.get(key)!r} vs "
                          f"{ours.get(key)!r}{f' and {len(differ) - 1} more' if len(differ) > 1 else ''}); run both "
                          f"pilots from the plan's config as it prints them.")


def flat(config: dict, prefix: str = "") -> dict:
    """{"a.b": value} of a nested dict."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def measure(ce: PilotRun, kd: PilotRun, teacher_config: Optional[str] = None) -> dict:
    """The results.json of the two pilots: the one-pass study's shape with `mode: "pilot"`."""
    kd_args = kd.args
    kd_step = max(kd.heldout)
    kd_tokens, kd_final = kd_step * kd.tokens_per_step, kd.heldout[kd_step]
    ce_curve = [{"step": step, "tokens": step * ce.tokens_per_step, "heldout_ce": value}
                for step, value in ce.heldout.items()]
    # The CE curve's evals as multiples of the KD run's tokens: kd_study's budgets, read along one curve.
    reached = interpolate_multiplier({point["tokens"] / kd_tokens: point["heldout_ce"] for point in ce_curve},
                                     kd_final)
    seed = str(kd_args.model.seed)
    kd_arm_name = f"kd_{kd_args.distillation.output}{kd_args.distillation.k}"
    kd_curve = [{"step": step, "tokens": step * kd.tokens_per_step, "heldout_ce": value}
                for step, value in kd.heldout.items()]
    kd_arm = {"overrides": [], "source": "online", "steps": kd_args.steps, "tokens": kd_tokens,
              "seeds": {seed: {"final_heldout_ce": kd_final, "heldout": kd_curve, "tokens": kd_tokens}},
              "final_heldout_ce": spread([kd_final]), "token_multiplier": token_multiplier({seed: reached})}
    mean = kd_arm["token_multiplier"]["mean"]
    kd_arm["ce_tokens_equivalent"] = mean * kd_tokens if mean is not None else None
    ce_arm = {"overrides": ["enable_distillation=false"], "source": "corpus", "steps": ce.args.steps,
              "tokens": ce_curve[-1]["tokens"],
              "seeds": {str(ce.args.model.seed): {"final_heldout_ce": ce_curve[-1]["heldout_ce"], "heldout": ce_curve,
                                                  "tokens": ce_curve[-1]["tokens"]}}}
    shape = read_teacher_shape(Path(teacher_config).expanduser() if teacher_config else
                               Path(kd_args.distillation.teacher_path or "").expanduser() / "config.json")
    if kd_args.model.vocab_size <= 0:  # a distilled student shares its teacher's vocabulary (as the planner counts)
        kd_args.model = dataclasses.replace(kd_args.model, vocab_size=shape.vocab)
    student_params = num_parameters(kd_args.model)
    return {
        "mode": "pilot",
        "setup": {"config": str((kd.dump_dir / "config.yaml").resolve()), "overrides": [], "steps": kd_args.steps,
                  "seeds": [int(seed)], "tokens_per_run": kd_tokens, "eval_every": kd_args.heldout.every,
                  "student": {k: getattr(kd_args.model, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads")},
                  "teacher": kd_args.distillation.teacher_path, "k": kd_args.distillation.k,
                  "temperature": kd_args.distillation.temperature,
                  "pilot": {"ce": str(ce.dump_dir.resolve()), "kd": str(kd.dump_dir.resolve()),
                            "heldout_source": kd.source, "ce_tokens": ce_curve[-1]["tokens"]}},
        "arms": {"ce": ce_arm, kd_arm_name: kd_arm},
        "compute": {"student": {"params": student_params,
                                "train_per_token": student_flops_per_token(kd_args, student_params)},
                    "teacher": {"params": shape.parameters(),
                                "forward_per_token": shape.forward_flops_per_token(kd_args.data.seq_len)},
                    "counted": "as apps.plan counts them: the student's 6N+12LDS per trained token, the teacher's "
                               "2N+4LDS forward (N from its config.json)"},
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(results: dict, path: Path) -> None:
    """Write atomically, replacing only a pilot's results.json: any other file at `path` is left as it is."""
    if path.exists():
        try:
            ours = json.loads(path.read_text()).get("mode") == "pilot"
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            ours = False
        if not ours:
            raise ConfigError(f"out={path} exists and is not a pilot's results.json; name another file.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def summary(results: dict, out: str) -> str:
    """The measurement in a sentence, and the next command."""
    arm_name, arm = next((name, arm) for name, arm in results["arms"].items() if "token_multiplier" in arm)
    seed, reached = next(iter(arm["token_multiplier"]["per_seed"].items()))
    final = arm["seeds"][seed]["final_heldout_ce"]
    if reached["value"] is not None:
        worth = f"{reached['value']:.3g}x"
    elif "at_least" in reached:
        worth = f"at least {reached['at_least']:.3g}x (CE-only never reached it: run it longer to measure more)"
    else:
        worth = f"at most {reached['at_most']:.3g}x (worse than CE-only's first held-out eval)"
    return (f"{arm_name}: final held-out CE {final:.4f} after {arm['tokens']:,.0f} tokens; CE-only reaches it at "
            f"{worth} the tokens\nwrote {out}; rerun the plan with kd_measurement={out}")


def main(argv: Optional[list[str]] = None) -> dict:
    """Read both pilots, compute the multiplier, write the results.json; returns it."""
    args = parse_args(PilotArgs, list(sys.argv[1:] if argv is None else argv))
    for key in ("ce", "kd"):
        if not getattr(args, key):
            raise ConfigError(f"{key}= is missing; pass the dump_dir of the planner's {key.upper()} pilot run "
                              f"(python -m apps.plan prints both).")
    ce, kd = read_run("ce", args.ce), read_run("kd", args.kd)
    check_pair(ce, kd)
    results = measure(ce, kd, args.teacher_config)
    write_results(results, Path(args.out).expanduser())
    print(summary(results, args.out))
    return results


if __name__ == "__main__":
    run_cli(main)
