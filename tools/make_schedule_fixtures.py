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
  * zb-h2 has no PyTorch implementation. Its orders are built here from the
    zero-bubble paper (Qi et al., 2023, "Zero Bubble Pipeline Parallelism",
    section 2.2 and figure 3), see zb_h2_order, and the script checks them
    against what the paper shows before writing them: figure 3's first and
    last rows at P = 4, M = 8, at most 2P - 1 microbatches held (F to W) on
    a rank, and, with unit F = B = W and M >= 2P - 1, every rank busy
    without a gap from r to r + 3M (the parallelogram).
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


def zb_h2_order(P, M):
    """ZB-H2 as the paper draws it, in 1-based microbatches per rank.

    Rank r warms up with 2(P - r) - 1 forwards (the bubble before the first
    B filled with forwards), then answers each B with the next forward; a
    forward that would hold a 2P-th microbatch waits for one W (the oldest),
    and once the forwards are done every B is followed by one W. The W's
    left run at the end (the tail that turns the trapezoid into a
    parallelogram).
    """
    cap = 2 * P - 1
    ranks = []
    for r in range(P):
        order = []
        fwd = bwd = wgt = 0
        while fwd < min(M, cap - 2 * r):
            fwd += 1
            order.append(("F", fwd))
        while bwd < M:
            bwd += 1
            order.append(("B", bwd))
            if fwd < M and fwd - wgt < cap:
                fwd += 1
                order.append(("F", fwd))
            else:
                wgt += 1
                order.append(("W", wgt))
                if fwd < M:
                    fwd += 1
                    order.append(("F", fwd))
        while wgt < M:
            wgt += 1
            order.append(("W", wgt))
        ranks.append(order)
    return ranks


# Figure 3 (bottom) of the paper, P = 4, M = 8: device 1 and device 4.
ZB_H2_FIGURE = {
    0: "F1 F2 F3 F4 F5 F6 F7 B1 W1 F8 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8",
    3: "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8",
}


def unit_time_spans(P, ranks):
    """Runs each rank's list in order with F = B = W = 1 and free transfers;
    returns each rank's (first busy slot, end, busy slots)."""
    done, pos, busy, t = {}, [0] * P, [[] for _ in range(P)], 0
    while any(pos[r] < len(ranks[r]) for r in range(P)):
        ready = []
        for r in range(P):
            if pos[r] == len(ranks[r]):
                continue
            kind, mb = ranks[r][pos[r]]
            need = {"F": ("F", r - 1), "B": ("B", r + 1)}.get(kind)
            if need is None or not 0 <= need[1] < P or done.get((need[0], need[1], mb), t + 1) <= t:
                ready.append(r)
        if not ready and t > 4 * P * len(ranks[0]):
            sys.exit("zb-h2: the orders deadlock")
        for r in ready:
            kind, mb = ranks[r][pos[r]]
            done[(kind, r, mb)] = t + 1
            busy[r].append(t)
            pos[r] += 1
        t += 1
    return [(b[0], b[-1] + 1, len(b)) for b in busy]


def zb_h2(P, V, M):
    ranks = zb_h2_order(P, M)
    text = lambda order: " ".join(f"{k}{mb}" for k, mb in order)
    if (P, M) == (4, 8):
        for r, row in ZB_H2_FIGURE.items():
            if text(ranks[r]) != row:
                sys.exit(f"zb-h2 rank {r} is not figure 3's row: {text(ranks[r])}")
    for r, order in enumerate(ranks):
        held = peak = 0
        for kind, _ in order:
            held += {"F": 1, "B": 0, "W": -1}[kind]
            peak = max(peak, held)
        if peak > 2 * P - 1:
            sys.exit(f"zb-h2 P={P} M={M} rank {r} holds {peak} > 2P - 1")
    for r, (first, end, slots) in enumerate(unit_time_spans(P, ranks)):
        if M >= 2 * P - 1 and (first, end, slots) != (r, r + 3 * M, 3 * M):
            sys.exit(f"zb-h2 P={P} M={M} rank {r}: not a parallelogram")
    # pipec's notation: 0-based microbatches, I for the split B.
    return [[f"{r}{'I' if k == 'B' else k}{mb - 1}" for k, mb in order] for r, order in enumerate(ranks)]


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
    "zb-h2": zb_h2,
    "zbv": lambda P, V, M: multi_stage_order(S.ScheduleZBVZeroBubble, P, 2, M, True),
    "dualpipev": lambda P, V, M: multi_stage_order(S.ScheduleDualPipeV, P, 2, M, True),
    "looped-bfs": lambda P, V, M: multi_stage_order(S.ScheduleLoopedBFS, P, V, M, False),
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
    ("zb-h2", 2, 1, 3),
    ("zb-h2", 2, 1, 4),
    ("zb-h2", 4, 1, 4),
    ("zb-h2", 4, 1, 8),
    ("zb-h2", 4, 1, 16),
    ("zb-h2", 3, 1, 7),
    ("zb-h2", 8, 1, 16),
    ("zbv", 2, 2, 4),
    ("zbv", 4, 2, 4),
    ("zbv", 4, 2, 8),
    ("zbv", 4, 2, 11),
    ("zbv", 8, 2, 16),
    ("dualpipev", 2, 2, 4),
    ("dualpipev", 4, 2, 8),
    ("dualpipev", 4, 2, 12),
    ("dualpipev", 8, 2, 20),
    ("looped-bfs", 2, 2, 4),
    ("looped-bfs", 4, 2, 3),
    ("looped-bfs", 4, 3, 8),
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
