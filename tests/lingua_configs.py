"""Meta Lingua's three published configs (apps/main/configs at its last public commit), written here in Lingua's
shape key for key, and the local files their paths must point at.

A Lingua user changes only paths: `dump_dir` (commented out in Lingua's templates), `data.root_dir`,
`data.tokenizer.path` and, for llama_7B, `eval.dataset_dir`. `lingua_paths` makes those files (a source folder
named like Lingua's, a tiktoken file, a datasets folder) and returns the overrides that point at them.
"""

from pathlib import Path

DEBUG = """\
# Template config, need to change dump_dir, data.root_dir and data.tokenizer.path
name: "debug"
steps: 1000
probe_freq: 100
seed: 777
optim:
    lr: 3e-4
    warmup: 2000
    lr_min_ratio: 0.000001
    clip: 10.0

distributed:
    fsdp_type: full_shard
    compile: true
    model_dtype: bf16
    matmul_allow_tf32: false
    selective_activation_checkpointing: false
    tp_size: 1

model:
    dim: 1024
    n_layers: 8
    n_heads: 8

data:
    root_dir: data/shuffled
    sources:
        dclm_baseline_1.0: 1.0
    batch_size: 32
    prefetch_size: 64
    seq_len: 2048
    n_views: 2
    load_async: true
    tokenizer:
        name: bytes

profiling:
    run: true

checkpoint:
    dump:
        every: 100
        keep: 1
    eval:
        every: 100
        keep: 1

logging:
    freq: 10

eval:
    generator:
        max_tokens: 8192
        dtype: bf16
        temperature: 1.0
        top_p: 0.95
    harness:
        tasks:
            - hellaswag
            - piqa
            - task: nq_open
              num_fewshot: 5
    validation:
        max_steps: 100
"""

_HARNESS_1B = """\
      - hellaswag
      - task: boolq
        dataset_kwargs:
          trust_remote_code: true
      - piqa
      - task: social_iqa
        dataset_kwargs:
          trust_remote_code: true
      - winogrande
      - openbookqa
      - arc_easy
      - arc_challenge
      - race
      - commonsense_qa
"""

_PROFILING = """\
profiling:
  run: true
  mem_warmup: 0
  mem_steps: 4
  profile_warmup: 100
  profile_steps: 4
"""

LLAMA_1B = f"""\
name: large_lm
steps: 60_000
probe_freq: null
seed: 777

optim:
  lr: 3e-3
  weight_decay: 0.033
  warmup: 5000
  lr_min_ratio: 0.000001
  clip: 1.0

distributed:
  fsdp_type: full_shard
  compile: true
  model_dtype: bf16
  matmul_allow_tf32: false
  selective_activation_checkpointing: false
  tp_size: 1

model:
  dim: 2048
  n_layers: 25
  n_heads: 16

data:
  root_dir: data/shuffled
  sources:
    dclm_baseline_1.0: 100.0
  batch_size: 4
  prefetch_size: 1024
  seq_len: 4096
  n_views: 2
  load_async: true
  add_bos: true
  add_eos: true
  tokenizer:
    name: tiktoken
    path: tokenizers/cl_toplang_128k.tiktoken

{_PROFILING}
checkpoint:
  dump:
    every: 2500
    keep: 3
  eval:
    every: 5000
    keep: -1

logging:
  freq: 1

async_eval_gpus: 8
eval:
  harness:
    tasks:
{_HARNESS_1B}      - copa
  validation:
    max_steps: 1000
  generator:
    max_tokens: 16384
    dtype: bf16
"""

LLAMA_7B = f"""\
name: "7b_baseline"
steps: 100_000
grad_acc_steps: 1
probe_freq: 100

seed: 777
optim:
  lr: 1.0e-3
  weight_decay: 0.1
  warmup: 2000
  lr_min_ratio: 0.000001
  clip: 1.0

distributed:
  fsdp_type: full_shard
  compile: true
  model_dtype: bf16
  matmul_allow_tf32: false
  selective_activation_checkpointing: false
  tp_size: 1

model:
  dim: 4096
  n_layers: 32
  n_heads: 32
  rope_theta: 100_000
  ffn_dim_multiplier: 1.0
  multiple_of: 256

data:
  root_dir: data/shuffled
  sources:
    dclm_baseline_1.0: 1.0
  batch_size: 2
  prefetch_size: 1024
  seq_len: 4096
  n_views: 2
  load_async: true
  tokenizer:
    name: tiktoken
    path: tokenizers/cl_toplang_128k.tiktoken

{_PROFILING}
checkpoint:
  dump:
    every: 10000
    keep: -1
  eval:
    every: 1000
    keep: 3

logging:
  freq: 1

async_eval_gpus: 8
eval:
  dataset_dir: datasets/eval
  harness:
    tasks:
{_HARNESS_1B}      - copa
      - mmlu
      - mmlu_pro
  validation:
    max_steps: 1000
  generator:
    max_tokens: 8192
    dtype: bf16
"""

LINGUA_CONFIGS = {"debug": DEBUG, "llama_1B": LLAMA_1B, "llama_7B": LLAMA_7B}
SOURCE = "dclm_baseline_1.0"  # the source folder Lingua's configs name


def write_lingua_config(name: str, folder: Path) -> Path:
    path = Path(folder) / f"{name}.yaml"
    path.write_text(LINGUA_CONFIGS[name])
    return path


def lingua_paths(name: str, root: Path, corpus: Path, tokenizer_dir: Path | None = None) -> list[str]:
    """The path overrides a Lingua user writes: dump_dir, data.root_dir (a folder whose `dclm_baseline_1.0` is the
    test corpus's source), the tokenizer file or folder, and eval.dataset_dir. With `tokenizer_dir` (an HF
    tokenizer folder) the tokenizer is that one, as the shipped lm-eval task needs."""
    root = Path(root)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / SOURCE).exists():
        (data / SOURCE).symlink_to(Path(corpus) / "text", target_is_directory=True)
    overrides = [f"dump_dir={root / 'dump'}", f"data.root_dir={data}"]
    if tokenizer_dir is not None:
        overrides += ["data.tokenizer.name=hf", f"data.tokenizer.path={tokenizer_dir}"]
    elif "tiktoken" in LINGUA_CONFIGS[name]:
        ranks = root / "cl_toplang_128k.tiktoken"
        ranks.write_text("YQ== 0\nYg== 1\n")  # what validation reads of it: that the file exists
        overrides.append(f"data.tokenizer.path={ranks}")
    if "dataset_dir" in LINGUA_CONFIGS[name]:
        (root / "datasets" / "eval").mkdir(parents=True, exist_ok=True)
        overrides.append(f"eval.dataset_dir={root / 'datasets' / 'eval'}")
    return overrides


def cpu_sized(steps: int = 4) -> list[str]:
    """debug.yaml shrunk for a CPU by overrides only: model, batch, sequence, no compile/bf16/profiler, short
    schedule, a checkpoint evaluation every 2 steps on the shipped task and 4 held-out batches."""
    return [f"steps={steps}", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "data.batch_size=2",
            "data.seq_len=32", "data.prefetch_size=4", "data.load_async=false", "distributed.compile=false",
            "distributed.model_dtype=fp32", "profiling.run=false", "optim.warmup=2", "logging.freq=1",
            "probe_freq=null", "checkpoint.dump.every=2", "checkpoint.eval.every=2",
            "distributed.init_timeout_s=120", "distributed.train_timeout_s=120"]
