#!/usr/bin/env python3
"""Writes tests/fixtures/schedules/*.txt: PyTorch's per-rank compute orders.

Each fixture is the order in which torch.distributed.pipelining runs compute
actions on every rank, for one schedule and one (P, V, M) point. ScheduleTest
checks pipec's generators (compiler/schedule/Schedule.cpp) against them.

    pip install torch            # CPU is enough; no process group is made
    python3 tools/make_schedule_fixtures.py [--out DIR]

The checked-in fixtures come from torch 2.15.0 (git d0f2af8b66b2), PyPI wheel.

File name: <schedule>-p<P>-v<V>-m<M>.txt with pipec's schedule names. One line
per rank, rank 0 first; actions "<stage><kind><microbatch>" separated by
spaces. Only compute actions are kept (F, B = FULL_BACKWARD, I =
BACKWARD_INPUT, W = BACKWARD_WEIGHT); idle slots (None) and the communication,
FSDP and gradient-reduction actions that PyTorch's lowering adds are dropped.
An OVERLAP_F_B action (DualPipeV) is written as its sub-actions, forward first,
which is the order PyTorch's runtime executes them in.

Where the order comes from:
  * ScheduleGPipe, Schedule1F1B, _ScheduleForwardOnly (one stage per rank)
    run their own loop in _step_microbatches; the script runs that loop on a
    mock stage that records forward_one_chunk / backward_one_chunk calls. (Their
    _get_pipeline_order tables are only used by PyTorch's simulator, and the
    1F1B one drops microbatch 0 on the last rank, so it is not used.)
  * The multi-stage schedules (_PipelineScheduleRuntime) execute
    pipeline_order_with_comms; the script takes its compute actions and checks
    that they equal pipeline_order's, so either can be read as the reference.
  * zb-h1 is ScheduleInterleavedZeroBubble with one stage per rank.
  * zb-h2 has no PyTorch implementation and so no fixture.
"""

import argparse
import os
import sys

from torch.distributed.pipelining import schedules as S

KIND_LETTER = {
    S.FORWARD: "F",
    S.FULL_BACKWARD: "B",
    S.BACKWARD_INPUT: "I",
    S.BACKWARD_WEIGHT: "W",
}


class MockStage:
    """The attributes the schedule constructors and step loops read."""

    def __init__(self, stage_index, num_stages, group_size, group_rank, log=None):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.log = log

    # Single-stage step loops: record compute, do no communication.
    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(f"{self.stage_index}B{mb}")

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def release_fwd_send_outputs(self, mb):
        pass

    def perform_reduce_grad(self, scale):
        pass


def single_stage_order(cls, P, M):
    """Runs the schedule's own step loop on every rank's mock stage."""
    ranks = []
    for r in range(P):
        log = []
        schedule = cls(MockStage(r, P, P, r, log), M)
        schedule._initialize_stage = lambda *args, **kwargs: None
        schedule._step_microbatches(arg_mbs=[()] * M, kwarg_mbs=[{}] * M)
        ranks.append(log)
    return ranks


def compute_actions(actions):
    out = []
    for a in actions:
        if a is None:
            continue
        for leaf in a.sub_actions or (a,):
            if leaf.computation_type in KIND_LETTER:
                out.append(
                    f"{leaf.stage_index}{KIND_LETTER[leaf.computation_type]}"
                    f"{leaf.microbatch_index}"
                )
    return out


def multi_stage_order(cls, P, V, M, v_shape):
    ranks = []
    for r in range(P):
        chunks = [r, 2 * P - 1 - r] if v_shape else [r + P * v for v in range(V)]
        stages = [MockStage(s, P * V, P, r) for s in chunks]
        schedule = cls(stages, M)
        lowered = compute_actions(schedule.pipeline_order_with_comms[r])
        plain = compute_actions(schedule.pipeline_order[r])
        if lowered != plain:
            sys.exit(f"{cls.__name__} P={P} M={M} rank {r}: lowering reordered compute")
        ranks.append(lowered)
    return ranks


SCHEDULES = {
    "gpipe": lambda P, V, M: single_stage_order(S.ScheduleGPipe, P, M),
    "1f1b": lambda P, V, M: single_stage_order(S.Schedule1F1B, P, M),
    "forward": lambda P, V, M: single_stage_order(S._ScheduleForwardOnly, P, M),
    "interleaved": lambda P, V, M: multi_stage_order(
        S.ScheduleInterleaved1F1B, P, V, M, False
    ),
    "zb-h1": lambda P, V, M: multi_stage_order(
        S.ScheduleInterleavedZeroBubble, P, 1, M, False
    ),
    "zbv": lambda P, V, M: multi_stage_order(S.ScheduleZBVZeroBubble, P, 2, M, True),
    "dualpipev": lambda P, V, M: multi_stage_order(S.ScheduleDualPipeV, P, 2, M, True),
}

# (schedule, P, V, M): small points that a person can still read, plus the
# edges each schedule's formulas branch on (M = P, M not a multiple of P,
# M below the warm-up count, the smallest M DualPipeV takes).
POINTS = [
    ("gpipe", 2, 1, 2),
    ("gpipe", 4, 1, 6),
    ("forward", 4, 1, 5),
    ("1f1b", 2, 1, 3),
    ("1f1b", 4, 1, 4),
    ("1f1b", 4, 1, 8),
    ("1f1b", 8, 1, 12),
    ("interleaved", 2, 2, 4),
    ("interleaved", 4, 2, 4),
    ("interleaved", 4, 2, 8),
    ("interleaved", 4, 2, 10),
    ("interleaved", 4, 2, 6),
    ("interleaved", 4, 3, 8),
    ("interleaved", 8, 2, 16),
    ("zb-h1", 2, 1, 4),
    ("zb-h1", 4, 1, 4),
    ("zb-h1", 4, 1, 8),
    ("zb-h1", 8, 1, 12),
    ("zbv", 2, 2, 4),
    ("zbv", 4, 2, 4),
    ("zbv", 4, 2, 8),
    ("zbv", 4, 2, 11),
    ("zbv", 8, 2, 16),
    ("dualpipev", 2, 2, 4),
    ("dualpipev", 4, 2, 8),
    ("dualpipev", 4, 2, 12),
    ("dualpipev", 8, 2, 20),
]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(here, "..", "tests", "fixtures", "schedules")
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, P, V, M in POINTS:
        ranks = SCHEDULES[name](P, V, M)
        path = os.path.join(args.out, f"{name}-p{P}-v{V}-m{M}.txt")
        with open(path, "w") as f:
            for actions in ranks:
                f.write(" ".join(actions) + "\n")
        print(path)


if __name__ == "__main__":
    main()
