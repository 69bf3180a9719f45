"""Where the Mailbox posts its receives (chimera.runtime.p2p), with a recording transport.

- NCCL-like transports (no tag matching): each receive exactly where the plan's Post is;
- gloo (tags match): a rank about to wait posts the rest of its iteration's receives, once,
  in the plan's order; a Post after that is skipped; a receive already complete posts
  nothing ahead; every message is posted once per iteration, iteration after iteration;
- a program whose Posts leave the plan's order (the deadlock fault) still posts each once;
- an iteration that stopped midway with receives posted refuses the next one.
"""

import pytest
import torch

from chimera.check.comm_plan import Post, plan_comm
from chimera.ir import Action, Op
from chimera.passes import lower
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.p2p import Mailbox
from chimera.runtime.transport import Transport
from chimera.schedules import build


class _Work:
    def __init__(self, done: bool):
        self.done = done

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        return True


class _Recording(Transport):
    def __init__(self, matches_by_tag: bool, done: bool = False):
        self.matches_by_tag = matches_by_tag
        self.done, self.posts = done, []

    def irecv(self, tensor, src, tag=0, group=None):
        self.posts.append(tag)
        return _Work(self.done)

    def isend(self, tensor, dst, tag=0, group=None):
        return _Work(True)


def _box(schedule: str, rank: int, transport: _Recording):
    plan = plan_comm(lower(build(schedule, 4, 8), "eager"))
    grid = ProcessGrid(plan.schedule.placement, 1, rank)
    box = Mailbox(plan, grid, lambda m: (4,), torch.uint8, torch.device("cpu"), None, transport)
    return plan, box


def _run(box: Mailbox, steps, until_first_wait: bool = False) -> None:
    """The receive side of one iteration: Posts and RECVs in program order (or up to and
    including the first RECV)."""
    box.begin_iteration()
    for step in steps:
        if isinstance(step, Post):
            box.post(step.message)
        elif isinstance(step, Action) and step.op in (Op.RECV_F, Op.RECV_B):
            box.receive(step)
            if until_first_wait:
                return
    box.finish_iteration()


def _tags(plan, rank):
    return [s.message.tag(plan.schedule) for s in plan.steps[rank] if isinstance(s, Post)]


@pytest.mark.parametrize("schedule", ["zb-v", "chimera", "1f1b"])
def test_without_tag_matching_each_receive_is_posted_at_its_post(schedule):
    t = _Recording(matches_by_tag=False)
    plan, box = _box(schedule, 1, t)
    _run(box, plan.steps[1])
    assert t.posts == _tags(plan, 1)


@pytest.mark.parametrize("schedule", ["zb-v", "chimera", "1f1b"])
def test_on_gloo_the_first_wait_posts_the_rest_once_in_plan_order(schedule):
    t = _Recording(matches_by_tag=True)
    plan, box = _box(schedule, 1, t)
    _run(box, plan.steps[1], until_first_wait=True)
    assert t.posts == _tags(plan, 1)  # all of them by the first wait, in the plan's order
    plain = _Recording(matches_by_tag=False)
    _run(_box(schedule, 1, plain)[1], plan.steps[1], until_first_wait=True)
    assert len(plain.posts) < len(t.posts)  # (the plan alone posts fewer by then)
    for _ in range(2):  # whole iterations: each receive once, in the plan's order
        t.posts.clear()
        _, box = _box(schedule, 1, t)
        _run(box, plan.steps[1])
        _run(box, plan.steps[1])
        assert t.posts == _tags(plan, 1) * 2


def test_a_receive_already_complete_posts_nothing_ahead():
    t = _Recording(matches_by_tag=True, done=True)
    plan, box = _box("zb-v", 1, t)
    box.begin_iteration()
    steps = plan.steps[1]
    first = next(i for i, s in enumerate(steps) if isinstance(s, Action) and s.op is Op.RECV_F)
    for s in steps[:first]:
        if isinstance(s, Post):
            box.post(s.message)
    posted = len(t.posts)
    box.receive(steps[first])
    assert len(t.posts) == posted


def test_posts_out_of_the_plans_order_still_post_each_once():
    from chimera.train.faults import program_for  # the deadlock fault's reordered program

    t = _Recording(matches_by_tag=True)
    plan, box = _box("chimera", 1, t)
    steps = list(plan.steps[1])
    recvs = [i for i, s in enumerate(steps) if isinstance(s, Action) and s.op in (Op.RECV_F, Op.RECV_B)]
    wait = steps[recvs[-1]]
    post = next(s for s in steps if isinstance(s, Post) and s.message.micro == wait.micro
                and s.message.kind == wait.op and s.message.stage == wait.stage)
    reordered = [post, wait] + [s for s in steps if s is not post and s is not wait]
    assert program_for(tuple(steps), plan.schedule, 1, "") == tuple(steps)  # no fault set here
    _run(box, reordered)
    assert sorted(t.posts) == sorted(_tags(plan, 1))


def test_a_step_that_stopped_midway_refuses_the_next():
    t = _Recording(matches_by_tag=False)
    plan, box = _box("1f1b", 1, t)
    box.begin_iteration()
    box.post(next(s for s in plan.steps[1] if isinstance(s, Post)).message)
    with pytest.raises(RuntimeError, match="receives still posted"):
        box.begin_iteration()
