"""How a local launch names its failures (issue 38): the rank that failed first (killed by a
signal, or failed on its own) is the cause, not a peer that then failed on communication
with it, nor one the launcher stopped after the grace. In process: no ranks are started."""

from chimera.runtime import workers


def test_the_rank_that_failed_first_is_named_not_the_one_that_noticed():
    # rank 1 killed by SIGTERM; rank 0 then failed on communication with it, and saw it first
    codes = workers.Exits([workers.PEER_EXIT, -15], ended=[10.0, 10.2])
    assert workers.cause(codes) == 1
    assert workers.summary(codes) == ("rank 1 failed first (killed by SIGTERM); then rank 0 "
                                      "(failed on communication (a peer gone, or a wait past "
                                      "--comm-timeout))")
    # an exception on rank 2 (exit 1) before rank 0's; rank 1 stopped by the launcher
    codes = workers.Exits([1, -15, 1], ended=[5.0, 9.0, 4.0], stopped=[1])
    assert workers.cause(codes) == 2 and "rank 1 (stopped by the launcher)" in workers.summary(codes)
    # a rank stopped by the launcher is never the cause, even by a signal and first in order
    assert workers.cause(workers.Exits([-15, workers.PEER_EXIT], [1.0, 2.0], stopped=[0])) == 1
    # every rank a consequence (a hang both timed out on): the earliest; none failed: None
    assert workers.cause(workers.Exits([75, 75], [3.0, 2.0])) == 1
    assert workers.cause(workers.Exits([0, 0], [1.0, 1.0])) is None and workers.summary([0, 0]) == ""
    assert workers.cause([0, 1, 1]) == 1  # plain codes: the first failed


def test_a_communication_error_is_a_peer_failure():
    assert workers.is_peer_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert not workers.is_peer_failure(ValueError("loss is nan"))
