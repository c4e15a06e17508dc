"""Write the offline teacher cache: the training windows and the teacher's sparse outputs, once.

    torchrun --nproc-per-node N -m apps.main.teacher_cache config=<a distillation config> cache_dir=DIR [streams=M]
    torchrun --nproc-per-node M -m apps.main.train config=<the same config> distillation.source=cache \
        distillation.cache_dir=DIR

Every rank is a teacher: it loads the teacher, tokenizes and packs the data exactly as training does
(`DataLoader`, stream d = what data-parallel student d of `streams` would read) and writes the shards
assigned to it (shard i is chunk i // M of stream i % M; rank r writes shards r, r+N, ...). With
distillation.teacher_tp=T the N ranks form N / T replicas of T consecutive ranks (on one node), each
holding the teacher sharded tensor-parallel: replica j writes shards j, j + N/T, ..., its first rank
writing the files, every rank of it running the forward. A rank reads its next windows ahead on a thread
and hands finished shards to `encode_workers` processes that encode and write them while its teacher runs the
next forward (lingua/distillation/cache/writer.py; 0 = the serial writer, the same bytes). Shards are
written atomically, so a rerun skips the finished ones and resumes the others from the loader state
saved in the last finished shard of their stream. With distillation.cross_tokenizer=true the teacher keeps its
own tokenizer: each window is aligned on the read-ahead thread as an online teacher rank aligns it
(CrossTokenizerTeacher), and the shards hold the student-side targets (the students' ids and positions, a
kd_weight bit per position), so the cache trains any run of that student tokenizer. The teacher's held-out
CE (the students' reference line; not with another tokenizer) is computed last, its batches split over the
replicas. `cache.json` records the settings: training refuses a cache whose settings differ from its own.
`index.json`, written last, marks the cache complete. Then a sweep over alpha, temperature or student size
pays the teacher once (see lingua/distillation/cache/store.py). This module is the command line and its
arguments; the job is `lingua/distillation/cache/write_job.py`.
"""

if __name__ == "__main__":  # first, before the slow imports: see lingua.cli.entry.hold_sigterm
    from lingua.cli.entry import hold_sigterm

    hold_sigterm()

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from apps.main.train import TrainArgs
from lingua.args import parse_args, require, require_filled
from lingua.cli.entry import release_sigterm, run_cli
from lingua.distillation.cache.codec import ZSTD_LEVEL
from lingua.distillation.cache.write_job import write_cache
from lingua.distributed import clean_up, setup_torch_distributed
from lingua.logger import init_logger
from lingua.parallel.launch_plan import LaunchPlan, read_launch_env, tensor_parallel_replicas

@dataclass
class TeacherCacheArgs(TrainArgs):
    cache_dir: str = ""  # the folder to write the cache to (created; a rerun resumes it); required
    streams: int = 1  # data-parallel students the cache is laid out for (train from it with as many)
    sequences_per_stream: int = 0  # windows per stream; 0 = what the config trains on: steps x grad_acc x batch
    shard_sequences: int = 64  # windows per shard file (the unit of resuming)
    forward_rows: int = 8  # windows per teacher forward
    # Processes encoding and writing shards while the teacher runs (lingua/distillation/cache/writer.py); -1: one
    # per core the writer's main thread leaves free; 0: the serial writer (read, forward, encode, write in turn)
    encode_workers: int = -1
    # zstd's level for the shards: 1 (fast: a GPU teacher outruns level 19 many times over) to 19 (2.5-4% smaller
    # shards, 5-10x the encoding time); a cache keeps the level it was started with. Reading speed is the same.
    zstd_level: int = ZSTD_LEVEL

    def validate(self, world_size: Optional[int] = None, local_world_size: Optional[int] = None) -> None:
        """The trainer's pass for the config with an online teacher (whatever distillation.source says: this
        job is the teacher), then the cache's own keys. Every rank is a teacher here, so the launch is planned
        without teacher ranks, then cut into replicas of distillation.teacher_tp ranks."""
        listed = self.distillation.teachers
        require(len(listed) <= 1 and not any(t.sources for t in listed), "distillation.teachers",
                [t.path for t in listed],
                "the cache writer runs one teacher: write each teacher's cache with its distillation.teacher_path")
        if listed and not self.distillation.spelled_by_keys:  # a list of one: the writer runs its teacher's settings
            self.distillation = self.distillation.teacher_args(0)
        teacher = replace(self.distillation, source="online", n_teacher_ranks=self.distillation.teacher_tp, teachers=[])
        TrainArgs.validate(replace(self, enable_distillation=True, distillation=teacher))
        require(bool(self.cache_dir), "cache_dir", self.cache_dir, "pass cache_dir=<folder for the teacher cache>")
        require_filled("cache_dir", self.cache_dir, "the folder to write the teacher cache to")
        for key in ("streams", "shard_sequences", "forward_rows"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use a positive integer")
        require(type(self.zstd_level) is int and 1 <= self.zstd_level <= 22, "zstd_level", self.zstd_level,
                "use a zstd level from 1 (fastest) to 22 (smallest); 19 suits a CPU teacher, 1 a GPU one")
        require(self.encode_workers >= -1, "encode_workers", self.encode_workers,
                "use -1 (one per free core), 0 (the serial writer) or a number of worker processes")
        require(self.sequences_per_stream >= 0, "sequences_per_stream", self.sequences_per_stream,
                "use 0 (the config's steps x grad_acc_steps x data.batch_size) or a positive number of windows")
        if world_size is not None:
            LaunchPlan.for_launch(self.distributed, world_size, local_world_size or world_size)
            tp = self.distillation.teacher_tp
            require(world_size % tp == 0, "distillation.teacher_tp", tp,
                    f"the cache writer's {world_size} ranks form replicas of teacher_tp ranks; "
                    f"launch a multiple of {tp}")
            tensor_parallel_replicas(list(range(world_size)), tp, local_world_size or world_size)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(TeacherCacheArgs, argv)
    launch = read_launch_env()
    args.validate(launch.world_size, launch.local_world_size)  # every config error, before any process group
    release_sigterm()
    failure: Optional[BaseException] = None  # an exceptional exit aborts the process groups (clean_up)
    try:
        topo = setup_torch_distributed(args.distributed, (), args.dump_dir)
        init_logger(topo.global_rank, "cache", str(Path(args.cache_dir) / "logs" / f"rank_{topo.global_rank}.log"))
        write_cache(args, topo)
    except BaseException as err:
        failure = err
        raise
    finally:
        clean_up(failure)


if __name__ == "__main__":
    run_cli(main)
