"""The key check of the loop's reductions by key: the sentence, and the digest every process computes alike."""

import torch

from lingua.parallel.collectives import _keys_digest, dist_mean_dict, key_mismatch_sentence


def test_the_sentence_names_each_key_some_ranks_lack_and_those_ranks():
    sentence = key_mismatch_sentence([["a", "loss"], ["loss"], ["b", "loss"], ["a", "loss"]], [0, 1, 2, 3], "metric")
    assert sentence.startswith("metric 'a' is on ranks 0, 3 only (not on ranks 1, 2); metric 'b' is on rank 2 only "
                               "(not on ranks 0, 1, 3): every rank must report the same metric keys")
    assert "'loss'" not in sentence


def test_the_digest_is_the_same_in_every_process():
    """Python's hash() is salted per process; the digest the ranks compare must not be: this number was computed
    by another process (blake2b of the keys, so any process, any PYTHONHASHSEED)."""
    keys = ["kd/teacher_busy", "loss/ce", "loss/total"]
    assert _keys_digest(keys) == 1113768288784033261 != _keys_digest(keys[:2])
    assert 0 <= _keys_digest(keys) < 2**63  # fits the int64 tensor, and so does its negation


def test_one_rank_means_are_its_values(train_group):
    assert dist_mean_dict({"b": torch.tensor(2.0), "a": 1}, train_group, torch.device("cpu")) == {"a": 1.0, "b": 2.0}
