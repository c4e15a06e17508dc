"""A resumable loader as the teacher cache's is one, in a module light enough (no torch) for a producer to import
in a fraction of a second (tests/unit/lingua/loading/test_producer.py)."""

import os

import numpy as np


class CountingLoader:
    """Batches 0, 1, 2, ... with the pid that built them; the state is the next value."""

    def __init__(self):
        self.next_value = 0

    def __next__(self) -> dict:
        self.next_value += 1
        return {"value": np.array(self.next_value - 1), "pid": np.array(os.getpid())}

    def state_dict(self) -> dict:
        return {"kind": "count", "next": self.next_value}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "count":
            raise ValueError("not a counting state")
        self.next_value = state["next"]
